"""``gnmr-hf eval`` says what it scored, and a resume reads back only what was scored on the same contents.

- A compressed-tensors folder: the summary (its ``precision``, the row's method, the ``scored`` record and the
  printed ``scored:`` line) names the folder's format (``compressed-tensors W4A16+W8A16+BF16``), not ``bf16``; and
  the bytes held are what the model holds when scoring ends. transformers de-compresses such a folder on the first
  forward (the packed W4A16/W8A16 codes unpacked to BF16, the scales kept), so that is more than it held at load:
  the record says so, and the bytes are counted here on an independently loaded model after one forward.
- ``--resume-dir``: a folder re-exported in place (``--force``), a checkpoint re-saved with other weights of the same
  shapes, an adapter re-trained into the same path or a plan file rewritten is scored again; an unchanged folder
  is still read back.

The tiny Llama and its byte-level tokenizer come from tests/test_eval_forms.py, the WikiText documents from
tests/test_eval.py."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("bitsandbytes")
pytest.importorskip("compressed_tensors")
peft = pytest.importorskip("peft")

from gnmr_hf.evaluation.evaluate import evaluate, format_scored, main  # noqa: E402
from tests.test_eval import write_fixture_data  # noqa: E402
from tests.test_eval_forms import LADDER, VOCAB, _byte_tokenizer  # noqa: E402

CT_FORMAT = "compressed-tensors W4A16+W8A16+BF16"


def _save_base(path, seed: int) -> None:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, eos_token_id=256, bos_token_id=256)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("r5eval")


@pytest.fixture(scope="module")
def base(root):
    _save_base(root / "base", 0)
    return root / "base"


@pytest.fixture(scope="module")
def data_dir(root):
    return write_fixture_data(root / "data")


def _score(model, data_dir, **kw):
    kw.setdefault("compute_dtype", "bfloat16")
    r = evaluate(str(model), "wikitext", data_dir=data_dir, device="cpu", bootstrap_iters=0, limit=1, **kw)
    return r["summary"], r["results"]["wikitext"]["word_perplexity,none"]


def _held_after_a_forward(folder) -> tuple[int, int]:
    """(bytes at load, bytes after one forward) of the folder loaded as stock from_pretrained loads it: every
    parameter and buffer, a shared one once."""

    def held(model) -> int:
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": "cpu"})
    model.eval()
    at_load = held(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
    return at_load, held(model)


@pytest.fixture(scope="module")
def ct_scored(base, root, data_dir):
    """A compressed-tensors folder of the ladder plan (4 W8A16, 7 W4A16, 3 BF16 linears), scored with a resume
    folder: (folder, resume folder, summary)."""
    from gnmr_hf.export_ct import export_compressed_tensors

    plan = root / "ladder.json"
    plan.write_text(json.dumps({"rungs": LADDER}))
    out = root / "ct"
    export_compressed_tensors(base, plan, out)
    parts = root / "ct_parts"
    summary, _ = _score(out, data_dir, resume_dir=parts)
    return out, parts, summary


def test_compressed_tensors_folder_is_named_by_its_format_not_bf16(ct_scored, data_dir, capsys):
    out, parts, summary = ct_scored
    assert summary["precision"] == CT_FORMAT
    assert summary["method"] == f"{CT_FORMAT} ct" and summary["row"].startswith(f"| {CT_FORMAT} ct |")
    s = summary["scored"]
    assert s["linears"] == {"BF16": 3, "W4A16": 7, "W8A16": 4} and s["lm_head"] == "BF16"  # how the folder stores them
    # the CLI's table (read back from the resume folder: the same name)
    capsys.readouterr()
    assert main(["--model", str(out), "--tasks", "wikitext", "--data-dir", str(data_dir), "--limit", "1",
                 "--device", "cpu", "--resume-dir", str(parts)]) == 0
    printed = capsys.readouterr().out
    assert f"| {CT_FORMAT} ct |" in printed and "| BF16 ct |" not in printed


def test_compressed_tensors_folder_records_the_bytes_held_when_scoring_ends(ct_scored, data_dir, capsys):
    out, parts, summary = ct_scored
    s = summary["scored"]
    at_load, after = _held_after_a_forward(out)
    assert after > at_load  # transformers unpacked the weights on the forward
    assert s["weights_held_bytes"] == after and s["weights_held_at_load_bytes"] == at_load
    assert s["held_when"] == "after scoring"
    assert s["held_decompressed"].startswith("11 linears de-compressed")  # the 7 W4A16 + 4 W8A16
    line = format_scored(s)
    assert f"weights held {after / 2**20:.1f} MiB after scoring ({at_load / 2**20:.1f} MiB at load)" in line
    assert "scores a compressed-tensors folder de-compressed" in line
    # the resume file keeps the same record: a read-back summary states the same
    stored = json.loads((parts / "wikitext.json").read_text())
    assert stored["gnmr_hf_scored"]["weights_held_bytes"] == after
    again, _ = _score(out, data_dir, resume_dir=parts)
    assert again["read_back"] == ["wikitext"] and again["scored"] == s
    capsys.readouterr()
    assert main(["--model", str(out), "--tasks", "wikitext", "--data-dir", str(data_dir), "--limit", "1",
                 "--device", "cpu", "--resume-dir", str(parts)]) == 0
    printed = capsys.readouterr().out
    assert "de-compressed" in printed and "after scoring" in printed


def test_a_bitsandbytes_folder_names_its_format_too(root):
    from gnmr_hf.evaluation.evaluate import default_method_name, folder_format

    folder = root / "bnb_config"
    folder.mkdir()
    folder.joinpath("config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "llm_int8_skip_modules": ["lm_head", "model.layers.0.mlp.down_proj"]}}))
    assert folder_format(folder) == "bitsandbytes NF4+BF16"
    assert default_method_name(str(folder), folder_format(folder), None) == "bitsandbytes NF4+BF16 bnb_config"
    assert folder_format(root) is None  # no config.json: not a pre-quantised folder


def test_resume_scores_again_a_folder_re_exported_in_place(base, root, data_dir, capsys):
    from gnmr_hf.export_ct import export_compressed_tensors

    out, parts = root / "ct_resume", root / "ct_resume_parts"
    export_compressed_tensors(base, {}, out)  # every decoder linear W4A16
    first, ppl = _score(out, data_dir, resume_dir=parts)
    assert first["read_back"] == []

    unchanged, ppl_unchanged = _score(out, data_dir, resume_dir=parts)
    assert unchanged["read_back"] == ["wikitext"] and ppl_unchanged == ppl  # the same folder: read back

    export_compressed_tensors(base, LADDER, out, force=True)  # the same path, other contents
    capsys.readouterr()
    again, ppl_again = _score(out, data_dir, resume_dir=parts)
    assert again["read_back"] == []  # scored again, not the old folder's score
    assert "the model's files changed" in capsys.readouterr().err
    assert ppl_again != pytest.approx(ppl, rel=1e-6)
    assert again["scored"]["linears"] == {"BF16": 3, "W4A16": 7, "W8A16": 4}

    reread, ppl_reread = _score(out, data_dir, resume_dir=parts)
    assert reread["read_back"] == ["wikitext"] and ppl_reread == ppl_again


def test_resume_scores_again_a_checkpoint_re_saved_with_other_weights(root, data_dir):
    """Same names, same sizes, same safetensors header: only the values (and the times) differ."""
    folder, parts = root / "resaved", root / "resaved_parts"
    _save_base(folder, 0)
    _, ppl = _score(folder, data_dir, resume_dir=parts)
    _save_base(folder, 1)
    again, ppl_again = _score(folder, data_dir, resume_dir=parts)
    assert again["read_back"] == [] and ppl_again != pytest.approx(ppl, rel=1e-6)


def test_resume_scores_again_an_adapter_or_plan_rewritten_in_place(base, root, data_dir):
    def save_adapter(seed: int) -> None:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                          target_modules=["q_proj", "v_proj"]))
        lora.save_pretrained(root / "lora")

    parts = root / "lora_parts"
    save_adapter(1)
    _, ppl = _score(base, data_dir, adapter=root / "lora", resume_dir=parts)
    assert _score(base, data_dir, adapter=root / "lora", resume_dir=parts)[0]["read_back"] == ["wikitext"]
    save_adapter(2)
    again, ppl_again = _score(base, data_dir, adapter=root / "lora", resume_dir=parts)
    assert again["read_back"] == [] and ppl_again != pytest.approx(ppl, rel=1e-6)

    plan, plan_parts = root / "plan" / "profile.json", root / "plan_parts"
    plan.parent.mkdir()
    plan.write_text(json.dumps({"rungs": {"model.layers.0.self_attn.q_proj": "bf16"}}))
    _score(base, data_dir, plan=plan.parent, resume_dir=plan_parts)
    assert _score(base, data_dir, plan=plan.parent, resume_dir=plan_parts)[0]["read_back"] == ["wikitext"]
    plan.write_text(json.dumps({"rungs": LADDER}))
    again, _ = _score(base, data_dir, plan=plan.parent, resume_dir=plan_parts)
    assert again["read_back"] == [] and again["scored"]["linears"].get("INT8") == 4
