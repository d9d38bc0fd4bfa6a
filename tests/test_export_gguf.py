"""The plan as a GGUF file (gnmr_hf.export_gguf): the gguf reader sees each tensor at its planned type; stock
transformers' GGUF loader gives the logits of the plan's fake-quantised model (ggml's Q4_0 / Q8_0 blocks written out
by hand here), with a LoRA adapter merged, on a tiny LLaMA and a tiny Gemma3; the tokenizer round-trips; bad input is
refused in one line with nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
peft = pytest.importorskip("peft")

from gnmr_hf.export_folder import ExportError  # noqa: E402
from gnmr_hf.export_gguf import export_gguf, main  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
L0, L1 = "model.layers.0.", "model.layers.1."
PLAN = {L0 + "self_attn.q_proj": "int8", L0 + "self_attn.k_proj": "int8", L0 + "mlp.up_proj": "bf16",
        L1 + "self_attn.o_proj": "int8", L1 + "mlp.down_proj": "bf16"}
TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "The quick brown fox jumps over the lazy dog.", "import torch\nx = torch.zeros(3)\nprint(x.sum())\n"]
# both sides compute in FP32 on the same dequantised weights: only the order of float operations differs
LOGIT_ATOL = 1e-4


def _tokenizer(path):
    """A byte-level BPE tokenizer (SmolLM2's kind) of ~300 tokens with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                                pad_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    fast.save_pretrained(path)
    return fast


def _save(model_cls: str, cfg_cls: str, extra: dict, path, tokenizer: bool = True):
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    if tokenizer:
        _tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _save("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False},
                 tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _save("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 32, "sliding_window": 64},
                 tmp_path_factory.mktemp("gemma3") / "base")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    path = tmp_path_factory.mktemp("adapter") / "lora"
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


# ggml's reference quantisers (ggml-quants.c quantize_row_q4_0_ref / q8_0_ref), block of 32 along a row, the
# scale stored as FP16, written out here independently of gguf.quants


def q4_0(w: torch.Tensor) -> torch.Tensor:
    b = w.float().reshape(-1, 32)
    peak = b.gather(1, b.abs().argmax(1, keepdim=True))  # the value of largest magnitude, with its sign
    d = peak / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15)
    return ((q - 8) * d.half().float()).reshape(w.shape)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    b = w.float().reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = b * inv
    a = x.abs()
    q = x.sign() * (a.floor() + (2 * (a - a.floor())).floor())  # C's roundf: halves away from zero (torch.round: to even)
    return (q * d.half().float()).reshape(w.shape)


FAKE = {"Q4_0": q4_0, "Q8_0": q8_0, "BF16": lambda w: w.float()}


def _fake_quantised(model_path, adapter, types: dict[str, str]):
    """The merged BF16 model in FP32 with each decoder linear replaced by its type's quantise-dequantise."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model = model.float().eval()
    with torch.no_grad():
        for name, qtype in types.items():
            lin = model.get_submodule(name)
            lin.weight.copy_(FAKE[qtype](lin.weight))
    return model


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if ".layers." in n and isinstance(m, torch.nn.Linear)]


def _gguf_name(hf: str) -> str:
    i, rest = hf.split(".")[2], ".".join(hf.split(".")[3:])
    leaf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}[rest]
    return f"blk.{i}.{leaf}.weight"


def test_hand_quantisers_agree_with_gguf():
    # the hand-written blocks above are ggml's: the same values as the gguf package's quantise-dequantise
    import numpy as np

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    w[0, :32] = torch.cat([torch.arange(-16, 15) + 0.5, torch.tensor([127.0])])  # Q8_0 scale 1: codes on halves
    for name, fn in (("Q4_0", q4_0), ("Q8_0", q8_0)):
        t = gguf.GGMLQuantizationType[name]
        ref = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), t), t)
        assert np.abs(fn(w).numpy() - ref).max() < 1e-6
        assert (fn(w) - w).abs().max() > 1e-3  # it quantised


def test_llama_plan_with_adapter_loads_as_the_fake_quantised_model(llama, adapter, ids, tmp_path):
    out = tmp_path / "plan.gguf"
    s = export_gguf(str(llama), PLAN, out, adapter=adapter)
    assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["plan.gguf"]  # no temporary file left
    assert s["linears_by_type"] == {"Q4_0": 9, "Q8_0": 3, "BF16": 2}
    # (a) the reader sees each linear at its planned type; norms F32, embedding and lm_head BF16
    reader = gguf.GGUFReader(out)
    seen = {t.name: t.tensor_type.name for t in reader.tensors}
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    linears = _linears(base)
    types = {n: {"int8": "Q8_0", "bf16": "BF16"}.get(PLAN.get(n), "Q4_0") for n in linears}
    assert {_gguf_name(n): t for n, t in types.items()} == {k: v for k, v in seen.items() if k.startswith("blk.")
                                                           and "norm" not in k}
    assert seen["token_embd.weight"] == seen["output.weight"] == "BF16"
    assert seen["output_norm.weight"] == seen["blk.0.attn_norm.weight"] == "F32"
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.attention.head_count_kv"].contents() == 2
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()
    del reader
    # (b) transformers' GGUF loader (it un-permutes q/k) gives the fake-quantised merged model's logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    expected = _fake_quantised(llama, adapter, types)
    merged = _fake_quantised(llama, adapter, {})
    with torch.no_grad():
        got, want, unquantised = loaded(ids).logits, expected(ids).logits, merged(ids).logits
    assert torch.isfinite(got).all()
    assert (want - unquantised).abs().max() > 1e-2  # the quantisation moved the logits
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    # the adapter was merged: without it the logits differ
    plain = _fake_quantised(llama, None, types)
    with torch.no_grad():
        assert (plain(ids).logits - got).abs().max() > 1e-2
    # the tokenizer round-trips through transformers' GGUF tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    source = transformers.AutoTokenizer.from_pretrained(llama)
    for text in TEXT:
        assert tok(text).input_ids == source(text).input_ids


def test_gemma3_uniform_through_the_cli(gemma3, ids, tmp_path, capsys):
    out = tmp_path / "u.gguf"
    assert main(["--model", str(gemma3), "--uniform", "q8_0", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Q8_0 x14" in printed and f"{out.stat().st_size:,} bytes" in printed
    reader = gguf.GGUFReader(out)
    seen = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in seen  # tied: written once
    assert seen["blk.0.attn_q_norm.weight"] == "F32"
    assert fields_value(reader, "gemma3.attention.key_length") == 32
    assert fields_value(reader, "gemma3.attention.sliding_window") == 64
    # the norms are written as 1 + w (llama.cpp's RMSNorm scales by the stored weight)
    stored = torch.from_numpy(next(t.data for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight").copy())
    src = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.bfloat16)
    torch.testing.assert_close(stored, src.model.layers[0].self_attn.q_norm.weight.float() + 1)
    del reader
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    types = dict.fromkeys(_linears(src), "Q8_0")
    expected, plain = _fake_quantised(gemma3, None, types), _fake_quantised(gemma3, None, {})
    with torch.no_grad():
        got, want, unquantised = loaded(ids).logits, expected(ids).logits, plain(ids).logits
    assert (want - unquantised).abs().max() > 1e-4
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


def test_a_plan_file_exports_as_its_rungs_and_a_profile_without_plan_is_refused(llama, tmp_path):
    from gnmr_hf.planning.plan import Plan

    Plan(rungs=PLAN, rung_set=("int8", "bf16")).save(tmp_path / "plan")
    (tmp_path / "out").mkdir()
    s = export_gguf(str(llama), tmp_path / "plan", tmp_path / "out" / "p.gguf")  # the folder holding profile.json
    assert s["linears_by_type"] == {"Q4_0": 9, "Q8_0": 3, "BF16": 2}
    Plan(rungs={}, planned=False).save(tmp_path / "none")
    (tmp_path / "none_out").mkdir()
    with pytest.raises(ExportError, match="without a plan"):
        export_gguf(str(llama), tmp_path / "none", tmp_path / "none_out" / "x.gguf")
    assert list((tmp_path / "none_out").iterdir()) == []


def fields_value(reader, key):
    return reader.fields[key].contents()


def _refused(tmp_path, match, *args, **kwargs):
    out = tmp_path / "x.gguf"
    with pytest.raises(ExportError, match=match) as e:
        export_gguf(*args, output=out, **kwargs)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file
    return str(e.value)


def test_bad_input_is_refused_in_one_line_before_anything_is_written(llama, adapter, gemma3, tmp_path_factory):
    t = tmp_path_factory.mktemp
    assert "llama-quantize" in _refused(t("k"), "cannot quantise", str(llama), None, uniform="Q4_K")
    _refused(t("nosuch"), "has no such type", str(llama), None, uniform="Q3_0")
    _refused(t("rung"), "int8 rung's type", str(llama), PLAN, rung_types={"int8": "Q6_K"})
    _refused(t("plan"), "not a decoder linear", str(llama), {"model.layers.9.mlp.up_proj": "int8"})
    _refused(t("rungname"), "a rung is one of", str(llama), {L0 + "mlp.up_proj": "fp8"})
    _refused(t("both"), "not both", str(llama), PLAN, uniform="Q8_0")
    # an architecture the exporter does not know (the config alone decides)
    other = t("mistral") / "m"
    shutil.copytree(llama, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    _refused(t("arch"), "architecture 'MistralForCausalLM'", str(other), None, uniform="Q8_0")
    # a row length that is not a multiple of the block: intermediate 80 (down_proj's rows) under Q4_0's 32
    odd = _save("LlamaForCausalLM", "LlamaConfig", {"intermediate_size": 80}, t("odd") / "m", tokenizer=False)
    msg = _refused(t("block"), "not a multiple of Q4_0's block of 32", str(odd), None, uniform="Q4_0")
    assert "down_proj" in msg
    # an adapter of another model (Gemma3's layers are not this LLaMA's shapes)
    _refused(t("adapter"), "adapter", str(gemma3), None, uniform="Q8_0", adapter=adapter)


def test_gnmr_hf_export_format_gguf_is_the_library_call_and_refuses_other_formats_options(llama, tmp_path, capsys):
    from gnmr_hf.export import main as export_main
    from gnmr_hf.planning.plan import Plan

    Plan(rungs=PLAN, rung_set=("int8", "bf16")).save(tmp_path / "plan")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert export_main(["--model", str(llama), "--plan", str(tmp_path / "plan"), "--format", "gguf",
                        "--output", str(tmp_path / "a" / "p.gguf")]) == 0
    line = capsys.readouterr().out
    assert "GGUF" in line and "Q4_0 9" in line and "Q8_0 3" in line and "BF16 2" in line
    export_gguf(str(llama), tmp_path / "plan", tmp_path / "b" / "p.gguf")
    assert (tmp_path / "a" / "p.gguf").read_bytes() == (tmp_path / "b" / "p.gguf").read_bytes()
    assert export_main(["--model", str(llama), "--format", "gguf", "--uniform", "Q8_0",
                        "--output", str(tmp_path / "a" / "u.gguf")]) == 0
    assert "Q8_0 14" in capsys.readouterr().out
    for extra, says in ((["--quant", "int8"], "--low-type"), (["--group-size", "64"], "block"),
                        (["--uniform", "Q8_0"], "not both"), (["--merge"], "merges --adapter")):
        assert export_main(["--model", str(llama), "--plan", str(tmp_path / "plan"), "--format", "gguf",
                            "--output", str(tmp_path / "a" / "x.gguf"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert export_main(["--model", str(llama), "--format", "gguf", "--output", str(tmp_path / "a" / "x.gguf")]) == 2
    assert "--uniform TYPE" in capsys.readouterr().err
    assert export_main(["--model", str(llama), "--plan", str(tmp_path / "plan"), "--uniform", "Q8_0",
                        "--output", str(tmp_path / "c")]) == 2  # the bitsandbytes format has no GGUF types
    assert "--format gguf's" in capsys.readouterr().err
    assert not (tmp_path / "a" / "x.gguf").exists() and not (tmp_path / "c").exists()
