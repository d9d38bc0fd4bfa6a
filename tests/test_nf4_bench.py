"""bench/value/nf4_bench.py: the recovery-gap probe against stock models, the held-out loss, the plan and the report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gnmr_hf
from tests.conftest import load_bench
from tests.test_dual_path import copy_lora, load, wrap

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parent.parent


nb = load_bench("nf4_bench")


def _unit_grads(pm, num_layers):
    """Per decoder layer, the LoRA gradients in a fixed order (float64)."""
    out = []
    for b in range(num_layers):
        layer = pm.base_model.model.model.layers[b]
        out.append([p.grad.double().clone() for n, p in sorted(layer.named_parameters()) if p.requires_grad])
    return out


def test_gap_probe_matches_stock_models_and_leaves_the_run_as_it_was(tiny_llama_dir):
    from gnmr_hf.backends.base import active_units, set_active_units
    from gnmr_hf.units import resolve_units

    path = str(tiny_llama_dir)
    dual = wrap(gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, dtype=torch.float32))
    units = resolve_units(dual)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "labels": ids}

    # independent references: stock PEFT over a stock NF4 load and over the FP32 load, same LoRA weights
    refs = []
    for quant in ("nf4", None):
        ref = copy_lora(wrap(load(path, quant), seed=1), dual)
        ref(**inputs).loss.backward()
        refs.append(_unit_grads(ref, len(units)))
    expected = []
    for low, high in zip(*refs):
        d = sum(float((lo - hi).square().sum()) for lo, hi in zip(low, high))
        h = sum(float(hi.square().sum()) for hi in high)
        expected.append(math.sqrt(d / h))

    set_active_units(dual, [1], units)
    dual.train()
    probe = nb.GapProbe(dual, units)
    gaps = probe.measure(inputs)

    assert gaps == pytest.approx(expected, rel=1e-5)
    assert all(g > 0 for g in gaps) and len(set(round(g, 6) for g in gaps)) == len(gaps)
    assert active_units(dual, units) == [1]  # the step's own set is back
    assert dual.training
    assert all(p.grad is None for p in dual.parameters())
    assert probe.seconds > 0


def test_heldout_loss_is_the_mean_response_token_loss(tiny_llama_dir, smollm2_dir):
    from transformers import AutoTokenizer

    class Script:
        prompt_template, response_template, max_seq_len, chat_template = "Q: {question}\nA:", " {answer}", 64, False

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))  # the real tokenizer (smollm2_dir: the slow tier)
    tok.pad_token = tok.eos_token
    model = load(str(tiny_llama_dir), None)
    model.resize_token_embeddings(len(tok))
    problems = [{"question": "2 + 3?", "answer": "5 #### 5"}, {"question": "10 - 4 times two?", "answer": "2 #### 2"},
                {"question": "1?", "answer": "one #### 1"}]
    # by hand: each problem alone, HF's own label-shifted mean loss, weighted by its response tokens
    total = count = 0.0
    for row in problems:
        p = tok(Script.prompt_template.format(**row))["input_ids"]
        r = tok(Script.response_template.format(**row), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p + r])
        labels = torch.tensor([[-100] * len(p) + r])
        with torch.no_grad():
            loss = float(model(input_ids=ids, labels=labels).loss)
        total += loss * len(r)
        count += len(r)
    assert nb.heldout_loss(model, tok, problems, Script, batch_size=2) == pytest.approx(total / count, rel=1e-5)


def test_the_plan_runs_the_references_before_the_runs_that_need_them():
    runs = nb.plan_runs([0, 1, 2], oracle_seed=0)
    assert len(runs) == 3 * (3 + 3 + 3 + 2)
    assert len(set(runs)) == len(runs)
    first_derived = min(i for i, r in enumerate(runs) if r[0] in nb.DERIVED)
    assert all(r[0] in nb.BASE_METHODS for r in runs[:first_derived]) and first_derived == 9
    assert [r for r in runs if r[2]] == [("gnmr", 0, True)]
    assert {r[0] for r in runs} == {"bf16", "nf4", "gnmr", "random", "static_gnmr", "edge", "gap-3", "gap-8",
                                    "gap-15", "rand-3", "rand-15"}


def test_a_lock_is_taken_once_and_a_dead_owners_lock_is_reclaimed(tmp_path):
    run_dir = tmp_path / "gnmr" / "seed0"
    assert nb.runner.claim(run_dir)
    assert not nb.runner.claim(run_dir)  # held by this (live) process
    nb.runner.release(run_dir)
    assert not (run_dir / "run.lock").exists()
    # a worker that took a lock and died without releasing it leaves the file behind, and its job free
    other = tmp_path / "gnmr" / "seed1"
    bench = str(Path(nb.runner.__file__).parent)
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {bench!r}); import runner; "
                    f"from pathlib import Path; sys.exit(0 if runner.claim(Path({str(other)!r})) else 1)"], check=True)
    assert (other / "run.lock").read_text() not in ("", str(os.getpid()))  # the dead worker's pid
    assert nb.runner.claim(other)
    assert (other / "run.lock").read_text() == str(os.getpid())
    # and a lock file of the former format (a pid, no flock held) does not hold a job either
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run.lock").write_text(str(os.getpid()))
    assert nb.runner.claim(tmp_path / "old")


def _result(out: Path, method: str, seed: int, nf4: float, bf16: float, mean_active: float, **kw) -> None:
    d = out / method / f"seed{seed}"
    d.mkdir(parents=True)
    r = {"method": method, "seed": seed, "heldout_loss_nf4_base": nf4, "heldout_loss_bf16_base": bf16,
         "mean_active": mean_active, "peak_active": math.ceil(mean_active), "peak_recovery_bytes": 2**20 * 3,
         "step_s_median": 1.5, "eval_problems": 48, "num_units": 30, "active_per_step": [], **kw}
    (d / "result.json").write_text(json.dumps(r))


def test_report_gap_closed_per_seed(tmp_path):
    for seed, shift in ((0, 0.0), (1, 0.1)):
        _result(tmp_path, "nf4", seed, 2.0 + shift, 1.8 + shift, 0)
        _result(tmp_path, "bf16", seed, 1.9 + shift, 1.0 + shift, 30)
    _result(tmp_path, "gnmr", 0, 1.95, 1.6, 4.5)      # BF16 base: (1.8 - 1.6) / (1.8 - 1.0) = 0.25
    _result(tmp_path, "gnmr", 1, 2.1, 1.3, 5.5)       # (1.9 - 1.3) / (1.9 - 1.1) = 0.75
    runs = nb._collect(tmp_path)
    assert nb.gap_closed(runs, "gnmr", "bf16") == pytest.approx([0.25, 0.75])
    assert nb.gap_closed(runs, "gnmr", "nf4") == pytest.approx([0.5, 0.0])  # (2 - 1.95) / (2 - 1.9); (2.1 - 2.1) / 0.1
    assert nb.gap_closed(runs, "bf16", "bf16") == pytest.approx([1.0, 1.0])
    text = nb.report(type("A", (), {"out": str(tmp_path), "plot": str(tmp_path / "p.png")})())
    row = next(line for line in text.splitlines() if line.startswith("| gnmr |"))
    assert "| 0.50 [0.25, 0.75] |" in row and "5.00 [4.50, 5.50]" in row and "| 6 |" in row
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_unknown_method_is_an_error(tmp_path):
    from gnmr_hf.core.controller import GNMRConfig

    with pytest.raises(SystemExit, match="unknown method"):
        nb._policy("bogus", 30, GNMRConfig(max_active=8), 0, tmp_path / "bogus" / "seed0", 3)
    with pytest.raises(SystemExit, match="missing: run that method first"):
        nb._policy("random", 30, GNMRConfig(max_active=8), 0, tmp_path / "random" / "seed0", 3)


def test_policies_match_their_definitions(tmp_path):
    from gnmr_hf.core.controller import GNMRConfig

    cfg = GNMRConfig(max_active=8)
    _result(tmp_path, "gnmr", 0, 2.0, 1.5, 2.4,
            active_per_step=[[], [29], [29, 28], [29, 3], [28, 29, 27]])
    p, extra = nb._policy("static_gnmr", 30, cfg, 0, tmp_path / "static_gnmr" / "seed0", 3)
    assert extra == {"k": 2, "units": [28, 29]} and p.initial_mask().nonzero().flatten().tolist() == [28, 29]
    p, extra = nb._policy("edge", 30, cfg, 0, tmp_path / "edge" / "seed0", 3)
    assert extra["units"] == [0, 1, 29]  # GNMR's peak was 3 layers
    p, extra = nb._policy("random", 30, cfg, 0, tmp_path / "random" / "seed0", 3)
    assert extra == {"mean_active_target": 2.4}
    counts = [int(p.initial_mask().sum())] + [int(p.step(torch.ones(30)).sum()) for _ in range(9)]
    assert sum(counts) / len(counts) == pytest.approx(2.4, abs=0.1)
    p, _ = nb._policy("nf4", 30, cfg, 0, tmp_path, 3)
    assert not p.initial_mask().any() and not p.step(torch.ones(30)).any()
    p, _ = nb._policy("bf16", 30, cfg, 0, tmp_path, 3)
    assert p.initial_mask().all()
    p, extra = nb._policy("gap-3", 30, cfg, 0, tmp_path, 3)
    assert extra == {"k": 3} and p.wants_gap(1) and p.wants_gap(3) and not p.wants_gap(4)
