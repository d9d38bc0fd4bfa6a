"""``gnmr-hf profile --serve gguf``: a precision-ladder plan over a GGUF type (Q4_0 by default; Q8_0 and BF16
rungs), profiled against the ``gguf`` package's own quantisers, and the GGUF export of it.

On a tiny LLaMA with a byte-level BPE tokenizer (tests/test_export_gguf.py's): the served weights the planner
computes with are ggml's blocks (checked against the hand-written reference quantisers of test_export_gguf and
against the tensors of an exported file read back with ``gguf.GGUFReader``); the prices are the file's tensor
bytes (the reader's ``n_bytes`` of a planned and a uniform file); the CLI's plan is ``choose_rungs`` of
``gguf_rung_gains`` computed here on batches built here; the export takes the plan's low type and writes each
linear at its rung's type; the bad inputs are one line each, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gnmr_hf.export_gguf import export_gguf  # noqa: E402
from gnmr_hf.planning.cli import main as profile_main  # noqa: E402
from gnmr_hf.planning.gguf_plan import (  # noqa: E402
    gguf_fake_quant,
    gguf_model_bytes,
    gguf_rung_gains,
    gguf_rung_prices,
)
from gnmr_hf.planning.ladder import choose_rungs  # noqa: E402
from gnmr_hf.planning.plan import Plan, PlanError  # noqa: E402
from tests.test_export_gguf import TEXT, _gguf_name, _linears, _save, q4_0, q8_0  # noqa: E402

SEQ, BS, NB = 16, 2, 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _save("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False},
                 tmp_path_factory.mktemp("gguf_llama") / "base")


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    words = " ".join(TEXT).split()
    r = random.Random(0)
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n".join(" ".join(r.choice(words) for _ in range(60)) for _ in range(4)))
    return path


def _profile(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = profile_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue().strip().splitlines()


def _base(model, docs, output):
    return ["--model", model, "--serve", "gguf", "--data", docs, "--max-seq-len", SEQ, "--batch-size", BS,
            "--batches", NB, "--quiet", "--output", output]


@pytest.fixture(scope="module")
def planned(llama, docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "p"
    rc, stdout, err = _profile(*_base(llama, docs, out), "--budget", "+10%q4_0")
    assert rc == 0, err
    return out, json.loads((out / "profile.json").read_text()), stdout


def _batches(model_dir, docs):
    """The CLI's profile batches, built here: the text's tokens in pieces of SEQ, BS pieces a batch."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok(docs.read_text())["input_ids"]
    pieces = [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)][: NB * BS]
    assert len(pieces) == NB * BS and all(len(p) == SEQ for p in pieces)
    out = []
    for i in range(0, len(pieces), BS):
        x = torch.tensor(pieces[i:i + BS])
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def test_the_served_weights_are_ggml_blocks():
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for name, hand in (("Q4_0", q4_0), ("Q8_0", q8_0)):
        got = gguf_fake_quant(w.float(), name)
        assert got.dtype == torch.float32 and torch.equal(got, hand(w))  # the reference block quantiser, bit for bit
        assert not torch.equal(got, w.float())  # and it did quantise
    assert torch.equal(gguf_fake_quant(w.float(), "BF16"), w.float())
    # Q4_1 (min and scale per block) is closer than Q4_0 on the same weight, Q8_0 closer still
    err = {t: (gguf_fake_quant(w.float(), t) - w.float()).abs().mean().item() for t in ("Q4_0", "Q4_1", "Q8_0")}
    assert err["Q8_0"] < err["Q4_1"] < err["Q4_0"]


def test_the_plan_is_choose_rungs_of_gguf_rung_gains_and_the_file_holds_it(llama, docs, planned, tmp_path):
    prof, saved, stdout = planned
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    linears = _linears(model)
    units = gguf_rung_gains(model, _batches(llama, docs), "q4_0", linears)
    assert all(set(u.gains) == {"int8", "bf16"} for u in units)
    uniform = gguf_model_bytes(model, linears, {}, "q4_0")
    budget = int(0.10 * uniform)
    want = choose_rungs(units, budget)
    assert want and saved["rungs"] == want
    assert saved["low"] == "q4_0" and saved["serve"] == "gguf" and saved["group_size"] is None
    assert saved["groups"] is None and saved["budget_bytes"] == budget
    assert saved["chosen_by"]["currency"] == "GGUF tensor bytes over the uniform Q4_0 file"
    mods = dict(model.named_modules())
    price = sum(gguf_rung_prices(mods[n].out_features, mods[n].in_features, "q4_0")[r] for n, r in want.items())
    assert saved["price_bytes"] == price and 0 < price <= budget
    assert "| memory over Q4_0 | plan | INT8 linears | BF16 linears |" in stdout
    assert "--format gguf" in stdout

    # the export: the plan's low type read from the plan, each linear at its rung's type
    f, u = tmp_path / "plan.gguf", tmp_path / "uniform.gguf"
    s = export_gguf(llama, prof, f)
    export_gguf(llama, None, u, uniform="Q4_0")
    types = {"low": "Q4_0", "int8": "Q8_0", "bf16": "BF16"}
    reader = gguf.GGUFReader(str(f))
    by_name = {t.name: t for t in reader.tensors}
    for n in linears:
        assert by_name[_gguf_name(n)].tensor_type.name == types[want.get(n, "low")], n
    assert s["rung_types"]["low"] == "Q4_0"
    # the prices are the file's: tensor data bytes as the reader sees them, planned and uniform
    data = {p: sum(int(t.n_bytes) for t in gguf.GGUFReader(str(p)).tensors) for p in (f, u)}
    assert data[u] == uniform and data[f] == gguf_model_bytes(model, linears, want, "q4_0")
    assert data[f] - data[u] == saved["price_bytes"]
    # the weights the planner computed with are the file's (v/o/gate/up/down: no rotary permutation)
    for n in linears:
        if n.endswith(("q_proj", "k_proj")):
            continue
        t = by_name[_gguf_name(n)]
        stored = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(mods[n].weight.shape)
        rung = want.get(n, "low")
        assert torch.equal(stored.float(), gguf_fake_quant(mods[n].weight, types[rung]).float()), n


def test_a_q4_1_plan_exports_at_q4_1_and_another_low_type_is_refused(llama, docs, tmp_path, capsys):
    from gnmr_hf.export import main as export_main

    rc, _, err = _profile(*_base(llama, docs, tmp_path / "p"), "--low", "q4_1", "--budget", "+10%q4_1")
    assert rc == 0, err
    plan = Plan.load(tmp_path / "p")
    assert plan.low == "q4_1" and plan.is_gguf and not plan.is_int4
    s = export_gguf(llama, tmp_path / "p", tmp_path / "x.gguf")
    assert s["linears_by_type"].get("Q4_1") and "Q4_0" not in s["linears_by_type"]
    capsys.readouterr()  # the loads' progress bars
    rc = export_main(["--model", str(llama), "--plan", str(tmp_path / "p"), "--format", "gguf", "--low-type", "Q4_0",
                      "--output", str(tmp_path / "y.gguf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "was profiled against Q4_1" in err[0], err
    assert not (tmp_path / "y.gguf").exists()


def test_the_other_exports_and_load_planned_refuse_a_gguf_plan(llama, planned, tmp_path, capsys):
    import gnmr_hf
    from gnmr_hf.export import main as export_main

    prof, _, _ = planned
    capsys.readouterr()
    for fmt in ("compressed-tensors", "bitsandbytes"):
        rc = export_main(["--model", str(llama), "--plan", str(prof), "--format", fmt, "--output", str(tmp_path / fmt)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "--format gguf" in err[0], (fmt, err)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(ValueError, match="export it with --format gguf"):
        gnmr_hf.load_planned(llama, prof)
    with pytest.raises(PlanError, match="group_size 32 with low q4_0"):
        Plan({}, low="q4_0", group_size=32)


@pytest.mark.parametrize("extra, want", [
    (["--low", "int4"], "--serve gguf plans over a GGUF type (q4_0, q4_1, q5_0, q5_1), not --low int4"),
    (["--budget", "+10%int4"], "is memory over the uniform W4A16 (int4) model, but --low is q4_0"),
    (["--budget", "+10%nf4"], "is memory over the nf4 model, but --low is q4_0"),
    (["--budget", "1B"], "buys nothing"),
    (["--group-size", "32"], "--group-size is the INT4 group of --low int4"),
    (["--criterion", "nope"], "unknown criterion 'nope'"),
])
def test_bad_gguf_profile_requests_are_one_line(llama, docs, tmp_path, extra, want):
    rc, _, err = _profile(*_base(llama, docs, tmp_path / "p"), *extra)
    assert rc == 2 and len(err) == 1 and want in err[0], err
    assert not (tmp_path / "p").exists()


def test_rows_that_are_not_whole_blocks_are_refused(docs, tmp_path):
    odd = _save("LlamaForCausalLM", "LlamaConfig", {"hidden_size": 48, "intermediate_size": 80,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2},
                tmp_path / "odd")
    rc, _, err = _profile(*_base(odd, docs, tmp_path / "p"), "--budget", "+10%q4_0")
    assert rc == 2 and len(err) == 1 and "not whole Q4_0 blocks of 32" in err[0], err
    assert not (tmp_path / "p").exists()
