"""``gnmr-hf eval`` scores every form a user ends with, through lm-evaluation-harness offline (WikiText-2 on two
local documents, as tests/test_eval.py): an exported bitsandbytes folder, a compressed-tensors folder, a ladder
plan on its training base (``--plan profile.json``, through ``gnmr_hf.load_planned``) and the merged BF16 model
(``gnmr-hf export --merge``). Each summary states what was scored: the form, the linears per precision (known
from the plan), the bytes held and the checkpoint's bytes on disk (counted here from the files and shapes).
The tiny model carries a byte-level tokenizer built here, so no real model is needed."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("bitsandbytes")
pytest.importorskip("compressed_tensors")
peft = pytest.importorskip("peft")

import gnmr_hf  # noqa: E402
from gnmr_hf.evaluation.evaluate import EvalError, evaluate, format_scored, main  # noqa: E402
from gnmr_hf.memory import model_bytes  # noqa: E402
from tests.test_eval import write_fixture_data  # noqa: E402

L0, L1 = "model.layers.0.", "model.layers.1."
# a grouped ladder plan: 4 INT8 linears, 3 BF16, the other 7 decoder linears on the low path
LADDER = {L0 + "self_attn.q_proj": "int8", L0 + "self_attn.k_proj": "int8", L0 + "self_attn.v_proj": "int8",
          L0 + "mlp.gate_proj": "bf16", L0 + "mlp.up_proj": "bf16", L1 + "self_attn.o_proj": "int8",
          L1 + "mlp.down_proj": "bf16"}
KEPT = [L1 + "self_attn.o_proj", L0 + "mlp.down_proj"]  # the BF16-only plan of the bitsandbytes export
VOCAB = 320  # 256 byte tokens + <eos>, padded


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("forms")


@pytest.fixture(scope="module")
def base(root):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, eos_token_id=256, bos_token_id=256)
    path = root / "base"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tok = _byte_tokenizer()
    assert tok("Tower .")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "Tower" + "Ġ."]  # one token a byte
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_dir(root):
    return write_fixture_data(root / "data")


@pytest.fixture(scope="module")
def adapter(base, root):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    lora.save_pretrained(root / "adapter")
    return root / "adapter"


@pytest.fixture(scope="module")
def ladder_plan(root):
    (root / "ladder").mkdir()
    (root / "ladder" / "profile.json").write_text(json.dumps({"rungs": LADDER}))
    return root / "ladder" / "profile.json"


def _score(model, data_dir, **kw):
    kw.setdefault("compute_dtype", "float32")
    r = evaluate(str(model), "wikitext", data_dir=data_dir, device="cpu", bootstrap_iters=0, **kw)
    return r["summary"], r["results"]["wikitext"]["word_perplexity,none"]


def _disk(folder) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def test_exported_bitsandbytes_folder(base, root, data_dir):
    from gnmr_hf.export import export_planned

    model = gnmr_hf.prepare_dual_path(
        transformers.AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)),
        recovery_source=base, units="linears", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    prof = gnmr_hf.profile_sensitivity(model, [{"input_ids": ids, "labels": ids}], criteria=("first_order",))
    prof.to_json(root / "bnbprof" / "profile.json", skip_modules=["lm_head", *KEPT])
    out = root / "bnb"
    export = export_planned(base, root / "bnbprof", out, target="transformers")
    summary, ppl = _score(out, data_dir, compute_dtype="bfloat16")  # the folder's compute dtype
    s = summary["scored"]
    assert s["form"] == "an exported bitsandbytes folder (nf4)"
    assert s["linears"] == {"BF16": 2, "NF4": 12} and s["lm_head"] == "BF16"
    assert s["checkpoint_bytes"] == _disk(out) and s["weights_held_bytes"] == export["weights_held_bytes"]
    assert "14 linears (2 BF16, 12 NF4), lm_head BF16" in format_scored(s)
    # the same mixed model by the other route: the BF16 checkpoint quantised at load with the plan's skip list
    same, ppl_at_load = _score(base, data_dir, precision="nf4", skip_modules=["lm_head", *KEPT],
                               compute_dtype="bfloat16")
    assert same["scored"]["linears"] == s["linears"] and same["scored"]["form"].startswith("a BF16 checkpoint quantised")
    assert ppl == pytest.approx(ppl_at_load, rel=1e-6)
    bf16, ppl_bf16 = _score(base, data_dir)
    assert bf16["scored"]["linears"] == {"FP32": 14} and ppl != pytest.approx(ppl_bf16, rel=1e-4)


def test_compressed_tensors_folder(base, ladder_plan, adapter, root, data_dir):
    from gnmr_hf.export_ct import export_compressed_tensors

    out = root / "ct"
    export = export_compressed_tensors(base, ladder_plan, out, adapter=adapter)
    summary, ppl = _score(out, data_dir, compute_dtype="bfloat16")  # the folder's dtype
    s = summary["scored"]
    assert s["form"] == "an exported compressed-tensors folder"
    assert s["linears"] == {"BF16": 3, "W4A16": 7, "W8A16": 4} and s["lm_head"] == "BF16"
    assert s["checkpoint_bytes"] == _disk(out)
    # held at load: what the folder stores (packed codes, scales, shapes; the rest BF16), as the export counted it,
    # and the buffers the model makes at load (the rotary frequencies); held when scoring ended: more, since
    # transformers de-compresses the folder on the first forward (tests/test_faults_r5_eval.py counts it)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    buffers = sum(b.numel() * b.element_size() for b in plain.buffers())
    assert buffers > 0 and s["weights_held_at_load_bytes"] == export["tensor_bytes"] + buffers
    assert s["weights_held_bytes"] > s["weights_held_at_load_bytes"] and "de-compressed" in s["held_decompressed"]
    # the merged model it was made from scores otherwise (the quantisation is in what was scored)
    merged = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                                            str(adapter)).merge_and_unload()
    merged.save_pretrained(root / "merged_by_hand")
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(root / "merged_by_hand")
    _, ppl_merged = _score(root / "merged_by_hand", data_dir, compute_dtype="bfloat16")
    assert ppl != pytest.approx(ppl_merged, rel=1e-4)


def test_ladder_plan_on_its_training_base(base, ladder_plan, adapter, data_dir):
    summary, ppl = _score(base, data_dir, plan=ladder_plan, adapter=adapter)
    s = summary["scored"]
    assert s["form"].startswith("a plan on its training base (profile.json, gnmr_hf.load_planned; the other linears NF4)")
    assert s["form"].endswith("+ the LoRA adapter adapter")
    # the BF16 rungs and lm_head upcast to the compute dtype (FP32 here) as load_planned loads them
    assert s["linears"] == {"FP32": 3, "INT8": 4, "NF4": 7} and s["lm_head"] == "FP32"
    assert s["checkpoint_bytes"] == _disk(base) and summary["plan"] == str(ladder_plan.resolve())
    # the same as load_planned by hand + PEFT, scored by the harness
    loaded = gnmr_hf.load_planned(base, ladder_plan, dtype=torch.float32)
    assert s["weights_held_bytes"] == model_bytes(
        peft.PeftModel.from_pretrained(loaded, str(adapter)))["total"]
    int8, ppl_int8 = _score(base, data_dir, plan=ladder_plan, precision="int8")
    assert int8["scored"]["linears"] == {"FP32": 3, "INT8": 11} and ppl_int8 != pytest.approx(ppl, rel=1e-4)


def test_merged_bf16_model(base, ladder_plan, adapter, root, data_dir):
    from gnmr_hf.export import export_planned

    out = root / "merged"
    export_planned(base, ladder_plan, out, adapter=adapter, merge=True)  # a ladder plan merges too
    summary, ppl = _score(out, data_dir)
    s = summary["scored"]
    assert s["form"] == "the merged BF16 model (gnmr-hf export --merge)"
    assert s["linears"] == {"FP32": 14} and s["lm_head"] == "FP32"  # BF16 weights upcast to the compute dtype
    assert s["checkpoint_bytes"] == _disk(out)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    n = sum(p.numel() for p in plain.parameters()) + sum(b.numel() for b in plain.buffers())
    assert s["weights_held_bytes"] == 4 * n


def test_bad_combinations_are_one_line_before_loading(base, ladder_plan, root, capsys, tmp_path):
    from gnmr_hf.export_ct import export_compressed_tensors

    folder = root / "ct_bad"
    export_compressed_tensors(base, ladder_plan, folder)
    capsys.readouterr()
    cases = [
        (["--model", folder, "--precision", "nf4"], "pre-quantised compressed-tensors folder"),
        (["--model", folder, "--plan", ladder_plan], "leave --plan out"),
        (["--model", base, "--plan", ladder_plan, "--precision", "bf16"], "--precision nf4 (the default with --plan)"),
        (["--model", base, "--plan", ladder_plan, "--skip-modules", "lm_head"], "give one"),
        (["--model", base, "--plan", tmp_path / "nope.json"], "no such file"),
        (["--model", base, "--skip-modules", ladder_plan, "--precision", "nf4"], "score it with --plan"),
    ]
    for argv, needle in cases:
        rc = main(list(map(str, argv)) + ["--tasks", "wikitext"])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and err.count("\n") == 1, (argv, err)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rungs": {"model.layers.5.mlp.down_proj": "int8"}}))
    with pytest.raises(EvalError, match=r"--plan .*other.json: 1 planned name\(s\) are not linears"):
        evaluate(str(base), "wikitext", plan=other, device="cpu", data_dir=root / "data")
