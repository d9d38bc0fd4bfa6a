"""``gnmr-hf export --replan DATA``: the export of a trained run planned anew for what it writes (the adapter
merged, the merged model profiled against the export's own quantiser on the start of the run's text), the plan
saved beside the output, the export scored on the text's end.

On a tiny LLaMA with a byte-level BPE tokenizer and a random LoRA adapter (tests/test_export_gguf.py's): the
saved plan is ``choose_rungs`` of the rung gains computed here on the merged model and on batches cut here from
the text's first tokens (and those gains are not the base model's: the adapter changed what is planned); the
GGUF file holds it at its types, the compressed-tensors folder for vLLM's CPU build holds BF16 groups only; bad
input is one line with nothing written.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
peft = pytest.importorskip("peft")

from gnmr_hf.export import main as export_main  # noqa: E402
from gnmr_hf.export_replan import BATCH_SIZE, BLOCK  # noqa: E402
from gnmr_hf.planning.gguf_plan import gguf_model_bytes, gguf_rung_gains  # noqa: E402
from gnmr_hf.planning.ladder import choose_rungs  # noqa: E402
from gnmr_hf.planning.plan import Plan  # noqa: E402
from tests.test_export_gguf import TEXT, _gguf_name, _linears, _save  # noqa: E402

SCORE = ["--score-block", "64", "--score-blocks", "2", "--replan-batches", "1"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _save("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False},
                 tmp_path_factory.mktemp("replan_llama") / "base")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.mul_(20)  # a fine-tune that moved the weights well past their quantisation steps
    path = tmp_path_factory.mktemp("adapter") / "lora"
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text(llama, tmp_path_factory):
    words = " ".join(TEXT).split()
    r = random.Random(0)
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    lines = []
    while len(tok("\n".join(lines), add_special_tokens=False)["input_ids"]) < BATCH_SIZE * BLOCK + 2 * 64 + 200:
        lines.append(" ".join(r.choice(words) for _ in range(50)))
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text("\n".join(lines))
    return path


def _run(capsys, *argv):
    rc = export_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.strip().splitlines() if "it/s]" not in ln and ln]


def _first_batch(llama, text):
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    ids = tok(text.read_text(), add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids[i * BLOCK:(i + 1) * BLOCK] for i in range(BATCH_SIZE)])
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}]


def test_gguf_replan_plans_the_merged_model_against_q4_0(llama, adapter, text, tmp_path, capsys):
    out = tmp_path / "run.gguf"
    rc, stdout, err = _run(capsys, "--model", llama, "--adapter", adapter, "--format", "gguf", "--replan", text,
                           "--output", out, *SCORE)
    assert rc == 0, err
    saved = Plan.load(tmp_path / "run.gguf.plan.json")
    assert (saved.low, saved.serve, saved.groups) == ("q4_0", "gguf", None)
    assert saved.chosen_by["writer"] == "gnmr-hf export --replan" and saved.chosen_by["data"] == "train.txt"
    # the plan, worked out here: the merged model's rung gains on the text's first 4 x 512 tokens, +10 % of the
    # uniform Q4_0 file's tensor bytes
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    merged = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().float().eval()
    linears = _linears(merged)
    units = gguf_rung_gains(merged, _first_batch(llama, text), "q4_0", linears)
    budget = int(0.10 * gguf_model_bytes(merged, linears, {}, "q4_0"))
    want = choose_rungs(units, budget)
    assert want and saved.rungs == want and saved.budget_bytes == budget
    # the adapter changed what was planned on: the base model's gains on the same batch are not these
    plain = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    before = {u.name: u.gains for u in gguf_rung_gains(plain, _first_batch(llama, text), "q4_0", linears)}
    assert any(abs(before[u.name]["bf16"] - u.gains["bf16"]) > 1e-6 for u in units)
    # the file holds the plan; the export scored itself on the text's last blocks
    by_name = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    types = {"low": "Q4_0", "int8": "Q8_0", "bf16": "BF16"}
    assert all(by_name[_gguf_name(n)] == types[want.get(n, "low")] for n in linears)
    assert "[export] the serving plan:" in stdout, stdout
    assert "scored on 126 held-out tokens (2 x 64 from the end of train.txt)" in stdout, stdout


def test_compressed_tensors_replan_for_vllm_cpu_buys_bf16_groups_only(llama, adapter, text, tmp_path, capsys):
    out = tmp_path / "ct"
    rc, stdout, err = _run(capsys, "--model", llama, "--adapter", adapter, "--format", "compressed-tensors", "--replan",
                           text, "--target", "vllm-cpu", "--group-size", "64", "--budget", "+25%int4", "--output", out,
                           *SCORE)
    assert rc == 0, err
    saved = json.loads((tmp_path / "ct.plan.json").read_text())
    assert saved["low"] == "int4" and saved["group_size"] == 64 and saved["serve"] == "vllm-cpu"
    assert saved["groups"] == "vllm" and saved["rungs"] and set(saved["rungs"].values()) == {"bf16"}
    card = (out / "README.md").read_text()
    assert "this export's own INT4 quantiser (W4A16, group 64" in card
    assert "scored on 126 held-out tokens" in stdout


@pytest.mark.parametrize("extra, want", [
    (["--format", "gguf", "--plan", "p.json"], "--replan makes the plan: give it or --plan, not both"),
    (["--format", "bitsandbytes"], "--replan is for --format compressed-tensors and gguf"),
    (["--format", "gguf", "--low-type", "Q8_0"], "--replan plans a GGUF file over Q4_0, Q4_1, Q5_0, Q5_1"),
    (["--format", "gguf", "--replan-batches", "9"], "planning on 9 batch(es) of 4 x 512 takes 18432 from its start"),
    (["--format", "gguf", "--budget", "1B"], "buys no unit"),
])
def test_bad_replan_requests_are_one_line(llama, adapter, text, tmp_path, capsys, extra, want):
    out = tmp_path / ("x.gguf" if "gguf" in extra else "x")
    rc, _, err = _run(capsys, "--model", llama, "--adapter", adapter, "--replan", text, "--output", out, *SCORE, *extra)
    assert rc == 2 and len(err) == 1 and want in err[0], err
    assert not out.exists() and not (tmp_path / f"{out.name}.plan.json").exists()


def test_replan_options_without_replan_and_an_existing_plan_file(llama, adapter, text, tmp_path, capsys):
    rc, _, err = _run(capsys, "--model", llama, "--format", "gguf", "--uniform", "Q4_0", "--budget", "+10%q4_0",
                      "--output", tmp_path / "u.gguf")
    assert rc == 2 and len(err) == 1 and "--budget goes with --replan" in err[0], err
    (tmp_path / "y.gguf.plan.json").write_text("{}")
    rc, _, err = _run(capsys, "--model", llama, "--adapter", adapter, "--format", "gguf", "--replan", text,
                      "--output", tmp_path / "y.gguf", *SCORE)
    assert rc == 2 and len(err) == 1 and "exists (an earlier --replan's plan)" in err[0], err
    assert not (tmp_path / "y.gguf").exists()


def test_an_nf4_plan_exported_for_another_quantiser_says_how_to_replan(llama, tmp_path, capsys):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    rungs = {_linears(model)[0]: "int8"}
    (tmp_path / "nf4.json").write_text(json.dumps({"low": "nf4", "rungs": rungs}))
    rc, stdout, err = _run(capsys, "--model", llama, "--format", "gguf", "--plan", tmp_path / "nf4.json",
                           "--output", tmp_path / "x.gguf")
    assert rc == 0, err
    assert "note: the plan was profiled against NF4 (the training's low path), not this export's GGUF types: " \
           "--replan TRAIN_TEXT" in stdout
    # a plan over the export's own GGUF type gets no such line
    Plan(rungs, low="q4_0", rung_set=("int8", "bf16"), serve="gguf").save(tmp_path / "q4.json")
    rc, stdout, err = _run(capsys, "--model", llama, "--format", "gguf", "--plan", tmp_path / "q4.json",
                           "--output", tmp_path / "y.gguf")
    assert rc == 0 and "wrote" in stdout and "note:" not in stdout, err


def test_replan_takes_a_folder_of_text_and_refuses_a_json_dataset(llama, adapter, text, tmp_path, capsys):
    from gnmr_hf.offline.text_data import read_text_source

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    body = text.read_text()
    half = len(body) // 2
    (docs / "a.txt").write_text(body[:half])
    (docs / "sub" / "b.md").write_text(body[half:])
    (docs / ".hidden.txt").write_text("never read")
    assert read_text_source(docs) == body[:half] + "\n\n" + body[half:]  # sorted by path, hidden skipped
    rc, stdout, err = _run(capsys, "--model", llama, "--adapter", adapter, "--format", "gguf", "--replan", docs,
                           "--output", tmp_path / "f.gguf", *SCORE)
    assert rc == 0, err
    assert Plan.load(tmp_path / "f.gguf.plan.json").chosen_by["data"] == "docs" and "from the end of docs" in stdout
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    rc, _, err = _run(capsys, "--model", llama, "--adapter", adapter, "--format", "gguf", "--replan",
                      tmp_path / "train.jsonl", "--output", tmp_path / "g.gguf")
    assert rc == 2 and len(err) == 1 and "a JSON dataset, not plain text" in err[0], err
    assert not (tmp_path / "g.gguf").exists() and not (tmp_path / "g.gguf.plan.json").exists()
