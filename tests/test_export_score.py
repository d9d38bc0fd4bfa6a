"""Every export scores itself (gnmr_hf.export_score, ``gnmr-hf export --score-data``): the three NLLs the command
prints (merged BF16, the export as its loader reads it, the uniform low form) equal ones worked out here on their
own (the merged model's forward in FP32; the plan's and the uniform rung quantised here, by the compressed-tensors
quantiser bit-exact to the library's, and for GGUF by the ``gguf`` package directly), on the tail blocks of the
text tokenised here; the card and the marker hold the same figures; the warning rule; no --score-data: one line,
nothing scored, the export written; a model without a tokenizer: one line, the export written."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("compressed_tensors")
gguf = pytest.importorskip("gguf")

from gnmr_hf.export import main as export_main  # noqa: E402
from gnmr_hf.export_score import HOW_TO_ASK, kept_share, loses_more, warning_line  # noqa: E402
from gnmr_hf.planning.groups import decoder_linears  # noqa: E402
from gnmr_hf.planning.int4 import fake_quantize_model  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_export_gguf import _save  # noqa: E402  (a tiny LLaMA with a byte-level BPE tokenizer)
from tests.test_profile_faults_r3 import WORDS, tiny_tokenizer  # noqa: E402

BLOCK, BLOCKS, GS = 16, 3, 32
L0, L1 = "model.layers.0.", "model.layers.1."
# a grouped plan (q/k/v and gate/up each on one rung)
RUNGS = {L0 + "self_attn.q_proj": "bf16", L0 + "self_attn.k_proj": "bf16", L0 + "self_attn.v_proj": "bf16",
         L1 + "mlp.down_proj": "int8"}
LINE = re.compile(r"scored on (\d+) held-out tokens .*merged BF16 NLL ([\d.]+), export ([\d.]+), uniform ([\d.]+); "
                  r"the export keeps (-?[\d.]+) of")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("score") / "model", num_layers=2, hidden=64)
    tiny_tokenizer().save_pretrained(path)
    return path


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
def text(tmp_path_factory):
    r = random.Random(0)
    path = tmp_path_factory.mktemp("held") / "held.txt"
    path.write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(30)) for _ in range(4)))
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "profile.json"
    path.write_text(json.dumps({"rungs": RUNGS}))
    return path


def _run(capsys, *argv):
    rc = export_main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out.strip().splitlines(), cap.err.strip()


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory):
    return _save("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False},
                 tmp_path_factory.mktemp("bpe") / "base")


def _tail_blocks(llama, text):
    ids = transformers.AutoTokenizer.from_pretrained(llama)(text.read_text(), add_special_tokens=False)["input_ids"]
    assert len(ids) > (BLOCKS + 1) * BLOCK  # the text is longer than what is scored: the tail is taken
    tail = ids[-BLOCKS * BLOCK:]
    return [tail[i * BLOCK:(i + 1) * BLOCK] for i in range(BLOCKS)]


def _nll(model, blocks):
    model = model.float().eval()
    losses = []
    with torch.no_grad():
        for b in blocks:
            x = torch.tensor([b])
            losses.append(model(input_ids=x, labels=x).loss.item())  # the model's own loss: mean over len - 1
    return sum(losses) / len(losses)  # equal blocks: the mean of block means is the mean over tokens


def _merged(llama, adapter=None):
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    if adapter is not None:
        base = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    return base.eval()


def _printed(lines):
    m = [LINE.search(x) for x in lines]
    m = [x for x in m if x]
    assert len(m) == 1, lines
    tokens, merged, export, uniform, kept = m[0].groups()
    return int(tokens), float(merged), float(export), float(uniform), float(kept)


def test_compressed_tensors_export_scores_itself_with_the_adapter_merged(llama, adapter, text, plan, tmp_path, capsys):
    out = tmp_path / "ct"
    rc, lines, err = _run(capsys, "--model", llama, "--plan", plan, "--adapter", adapter, "--format",
                          "compressed-tensors", "--group-size", GS, "--output", out, "--score-data", text,
                          "--score-block", BLOCK, "--score-blocks", BLOCKS)
    assert rc == 0, err
    tokens, merged, export, uniform, kept = _printed(lines)
    blocks = _tail_blocks(llama, text)
    assert tokens == BLOCKS * (BLOCK - 1)
    base = _merged(llama, adapter)
    want_merged = _nll(copy.deepcopy(base), blocks)
    want_export = _nll(fake_quantize_model(copy.deepcopy(base), RUNGS, GS), blocks)
    want_uniform = _nll(fake_quantize_model(copy.deepcopy(base), {}, GS), blocks)
    assert (merged, export, uniform) == pytest.approx((want_merged, want_export, want_uniform), abs=1e-4)
    # the adapter and the quantisation both moved the figures: the comparison is not of equal things
    assert abs(_nll(_merged(llama), blocks) - want_merged) > 1e-3
    assert abs(want_uniform - want_merged) > 1e-3 and abs(want_export - want_uniform) > 1e-4
    assert kept == pytest.approx(kept_share(want_merged, want_export, want_uniform), abs=2e-3)
    # the card and the marker hold the same figures
    card = (out / "README.md").read_text()
    assert "## Measured by the export" in card and f"{BLOCKS * (BLOCK - 1)} tokens scored" in card
    for v in (merged, export, uniform):
        assert f"| {v:.4f} |" in card
    assert "not measured by the export" not in card and "Loss: measured by the export" in card
    assert "held.txt" in card and str(text.parent) not in card  # the file's name, not this machine's folder
    marker = json.loads((out / ".gnmr_export.json").read_text())["measured_by_export"]
    assert marker["tokens"] == tokens and marker["merged"] == pytest.approx(want_merged, abs=1e-5)
    assert marker["export"] == pytest.approx(want_export, abs=1e-5)
    assert marker["warning"] is loses_more(want_merged, want_export, want_uniform)
    assert any(x.startswith("warning:") for x in lines) is marker["warning"]
    assert ("warning:" in card) is marker["warning"]


def _gguf_fake(model, types):
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in decoder_linears(model):
            qtype = types.get(name, "Q4_0")
            if qtype == "BF16":
                continue
            q = gguf.GGMLQuantizationType[qtype]
            w = modules[name].weight
            a = w.float().numpy()
            w.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, q), q).reshape(a.shape)))
    return model


def test_gguf_export_scores_itself(bpe_llama, text, plan, tmp_path, capsys):
    llama = bpe_llama
    out = tmp_path / "m.gguf"
    rc, lines, err = _run(capsys, "--model", llama, "--plan", plan, "--format", "gguf", "--output", out,
                          "--score-data", text, "--score-block", BLOCK, "--score-blocks", BLOCKS)
    assert rc == 0, err
    tokens, merged, export, uniform, _ = _printed(lines)
    blocks = _tail_blocks(llama, text)
    base = _merged(llama)
    types = {n: {"bf16": "BF16", "int8": "Q8_0"}[r] for n, r in RUNGS.items()}
    want = (_nll(copy.deepcopy(base), blocks), _nll(_gguf_fake(copy.deepcopy(base), types), blocks),
            _nll(_gguf_fake(copy.deepcopy(base), {}), blocks))
    assert (merged, export, uniform) == pytest.approx(want, abs=1e-4)
    assert abs(want[2] - want[0]) > 1e-3 and abs(want[1] - want[2]) > 1e-4
    assert tokens == BLOCKS * (BLOCK - 1)
    assert out.is_file() and not (tmp_path / "README.md").exists()  # one file: no card to write
    # the uniform baseline scores as the uniform form, and is not warned about (it has no plan)
    rc, lines, err = _run(capsys, "--model", llama, "--uniform", "Q4_0", "--format", "gguf", "--output",
                          tmp_path / "u.gguf", "--score-data", text, "--score-block", BLOCK, "--score-blocks", BLOCKS)
    assert rc == 0, err
    _, merged_u, export_u, uniform_u, kept_u = _printed(lines)
    assert (merged_u, export_u, uniform_u) == pytest.approx((want[0], want[2], want[2]), abs=1e-4)
    # near 0: the file and the torch quantiser differ by float order only (~1e-5 nats), over a gap of ~1e-3 here
    assert abs(kept_u) < 0.05 and "the uniform baseline" in lines[-1]
    assert loses_more(merged_u, export_u, uniform_u) and not any(x.startswith("warning:") for x in lines)


def test_no_score_data_scores_nothing_and_says_how(llama, tmp_path, capsys):
    out = tmp_path / "u"
    rc, lines, err = _run(capsys, "--model", llama, "--uniform", "w4a16", "--format", "compressed-tensors",
                          "--group-size", GS, "--output", out)
    assert rc == 0, err
    assert lines[-1] == HOW_TO_ASK and not any("scored on" in x for x in lines)
    card = (out / "README.md").read_text()
    assert (out / "config.json").is_file() and "Measured by the export" not in card
    assert "Loss: not measured by the export" in card
    assert "measured_by_export" not in json.loads((out / ".gnmr_export.json").read_text())


def test_a_model_without_a_tokenizer_is_not_scored_but_exported(tmp_path, text, capsys):
    bare = make_tiny_llama(tmp_path / "bare", num_layers=1, hidden=64)
    out = tmp_path / "b"
    rc, lines, err = _run(capsys, "--model", bare, "--uniform", "w4a16", "--format", "compressed-tensors",
                          "--group-size", GS, "--output", out, "--score-data", text)
    assert rc == 0, err
    assert lines[-1].startswith("not scored:") and "tokenizer" in lines[-1] and (out / "config.json").is_file()


def test_bad_score_options_are_refused_before_anything_is_written(llama, text, tmp_path, capsys):
    rc, _, err = _run(capsys, "--model", llama, "--uniform", "w4a16", "--format", "compressed-tensors",
                      "--group-size", GS, "--output", tmp_path / "x", "--score-data", tmp_path / "missing.txt")
    assert rc == 2 and "--score-data" in err and not (tmp_path / "x").exists()
    rc, _, err = _run(capsys, "--model", llama, "--plan", tmp_path / "p", "--output", tmp_path / "y",
                      "--score-data", text)
    assert rc == 2 and "bitsandbytes" in err and not (tmp_path / "y").exists()


def test_the_warning_rule():
    # the export loses 0.6 nats to quantisation, its plan recovered 0.4 of the uniform 1.0: warned
    assert loses_more(2.0, 2.6, 3.0) and kept_share(2.0, 2.6, 3.0) == pytest.approx(0.4)
    assert not loses_more(2.0, 2.4, 3.0) and kept_share(2.0, 2.4, 3.0) == pytest.approx(0.6)
    assert not loses_more(2.0, 2.5, 3.0)  # exactly half: not more than recovered
    r = {"merged": 2.0, "export": 2.6, "uniform": 3.0, "warning": True}
    assert warning_line(r).startswith("warning: ") and "0.6000" in warning_line(r)
    assert warning_line({**r, "export": 2.4, "warning": False}) is None


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A tiny LLaMA with weights 5 times the default spread (initializer_range 0.1): uniform W4A16 costs it
    about 0.05 nats on the test text, where the default tiny model's 0.0005 is below the noise of one linear."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, initializer_range=0.1)
    path = tmp_path_factory.mktemp("sharp") / "model"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_the_warning_comes_with_a_plan_that_buys_what_does_not_matter(sharp, text, tmp_path, capsys):
    """A plan that keeps one down_proj that does not matter on BF16 recovers nothing of the uniform W4A16 loss:
    warned on the terminal and the card; a plan that keeps all but one linear on BF16 recovers most of it: no
    warning."""
    llama = sharp
    linears = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    plans = {"bad": {L0 + "mlp.down_proj": "bf16"},
             "good": {n: "bf16" for n in linears if n != L1 + "mlp.down_proj"}}
    warned = {}
    for name, rungs in plans.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"rungs": rungs}))
        out = tmp_path / name
        rc, lines, err = _run(capsys, "--model", llama, "--plan", path, "--format", "compressed-tensors",
                              "--group-size", GS, "--output", out, "--score-data", text, "--score-block", BLOCK,
                              "--score-blocks", BLOCKS)
        assert rc == 0, err
        _, merged, export, uniform, kept = _printed(lines)
        warned[name] = (any(x.startswith("warning: ") for x in lines), "warning: " in (out / "README.md").read_text(),
                        loses_more(merged, export, uniform), kept)
    assert warned["bad"][:3] == (True, True, True) and warned["bad"][3] < 0.5
    assert warned["good"][:3] == (False, False, False) and warned["good"][3] > 0.5
