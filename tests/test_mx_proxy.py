"""The MX stress proxy (recipes/stress/mx_proxy.py), its sweep runner and its report, at tiny size."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "stress"))
sys.path.insert(0, str(ROOT / "bench" / "stress"))

import mx_proxy  # noqa: E402
import mx_report  # noqa: E402
import mx_sweep  # noqa: E402

from gnmr_hf.backends.base import set_active_units  # noqa: E402

TINY = dict(width=32, depth=4, batch=16, steps=6, val_batches=1, val_batch_size=32, val_every=3, log_every=1)


def tiny(**kw) -> mx_proxy.ProxyConfig:
    return mx_proxy.ProxyConfig(**{**TINY, **kw})


def losses_of(result: dict) -> list[float]:
    return [v for _, v in result["losses"]]


# ---------------------------------------------------------------- spike / divergence definitions
def test_mx_detect_spikes_hand_made():
    # running minimum before step 5 is 0.125: 1.5 > 10 * 0.125 opens a spike, 2.5 continues it, 0.125
    # ends it; exactly 10x the minimum (step 8: 1.25, exact in binary) is not a spike; a NaN is a spike
    losses = [1.0, 0.5, 0.25, 0.125, 1.5, 2.5, 0.125, 1.25, 0.0625, float("nan")]
    spikes = mx_proxy.detect_spikes(losses, factor=10.0)
    assert spikes == [{"start": 5, "end": 6, "peak": 2.5}, {"start": 10, "end": 10, "peak": math.inf}]
    # step 1 can never spike (no minimum yet), and a smaller factor finds more
    assert mx_proxy.detect_spikes([100.0, 1.0]) == []
    assert [s["start"] for s in mx_proxy.detect_spikes([1.0, 0.5, 0.9], factor=1.5)] == [3]


def test_mx_diverged_hand_made():
    # min 0.05; mean of the last 2 = 0.6 > 0.5 -> diverged; 0.425 < 0.5 -> not
    assert mx_proxy.diverged([1.0, 0.1, 0.05, 0.6, 0.6], factor=10.0, tail=2)
    assert not mx_proxy.diverged([1.0, 0.1, 0.05, 0.4, 0.45], factor=10.0, tail=2)
    assert mx_proxy.diverged([1.0, float("inf")], factor=10.0)
    assert mx_proxy.diverged([1.0, float("nan"), 0.1])
    assert not mx_proxy.diverged([])


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, field",
    [({"method": "int8"}, "method"), ({"fmt": "fp8"}, "fmt"), ({"width": 48}, "width"),
     ({"max_active": 5}, "max_active"), ({"lr": 0.0}, "lr"), ({"steps": 0}, "steps"),
     ({"checkpoint_every": 2}, "checkpoint_every"), ({"batch": 15, "method": "gsnr"}, "batch")],
)
def test_mx_proxy_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny(**kw)


def test_mx_proxy_config_defaults():
    cfg = tiny(depth=8, method="gsnr", steps=50)
    assert cfg.max_active == 2  # 25 % of 8 blocks
    assert cfg.microbatches == 2  # GSNR needs micro-batches
    assert cfg.adapt_warmup_steps == 5  # 10 % of the run


# ---------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def method_runs():
    torch.set_num_threads(1)
    return {m: mx_proxy.run(tiny(method=m, fmt="mxfp4_e2m1")) for m in mx_proxy.METHODS}


@pytest.mark.parametrize("method", mx_proxy.METHODS)
def test_mx_proxy_runs_each_method(method_runs, method):
    r = method_runs[method]
    losses = losses_of(r)
    assert r["steps_done"] == 6 and len(losses) == 6
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # it learns
    assert math.isfinite(r["final_val_loss"]) and [s for s, _ in r["val"]] == [3, 6]
    assert [s for s, _ in r["val_train_path"]] == [3, 6]
    if method == "bf16":  # the training path is the BF16 path
        assert r["final_val_loss_train_path"] == r["final_val_loss"]
    if method == "fixed":  # the MX path evaluates the same weights differently
        assert r["final_val_loss_train_path"] != r["final_val_loss"]
    assert r["n_spikes"] == 0 and not r["diverged"]
    # the BF16 share actually run: bf16 all, fixed none; random fills max_active = 1 of 4 blocks from
    # step 2 on (step 1 starts on the low path): 5 / 24; adapt runs its 1-step warm-up in BF16, then
    # its fixed block: (4 + 5) / 24
    expected = {"bf16": 1.0, "fixed": 0.0, "random": 5 / 24, "adapt": 9 / 24, "gsnr": 5 / 24}
    if method in expected:
        assert r["promotion_ratio"] == pytest.approx(expected[method])
    else:  # gnmr: within the budget
        assert 0.0 <= r["promotion_ratio"] <= 5 / 24
    if method in ("bf16", "fixed"):
        assert r["policy"] is None
    else:
        assert r["policy"]["steps"] == 6
        assert 0.0 <= r["hit_max_rate"] <= 1.0 and 0.0 <= r["gnmr_exceedance_rate"] <= 1.0


def test_mx_proxy_paths_differ_as_claimed(method_runs):
    """Step 1 sees the same weights and batch in every run: its loss tells the paths apart."""
    first = {m: losses_of(r)[0] for m, r in method_runs.items()}
    # every method but bf16 and adapt (BF16 warm-up) starts on the all-MX path
    assert first["fixed"] == first["gnmr"] == first["random"]
    # the same loss in FP32, with a plain student built from the same seeds
    cfg = tiny(method="bf16")
    torch.manual_seed(cfg.seed)
    plain = mx_proxy.Student(cfg.width, cfg.depth)
    teacher = mx_proxy.build(cfg)["teacher"]
    x = torch.randn(cfg.batch, cfg.width, generator=torch.Generator().manual_seed(40_000 + cfg.seed))
    with torch.no_grad():
        fp32 = F.mse_loss(plain(x), teacher(x)).item()
    assert first["bf16"] == first["adapt"]
    assert first["bf16"] == pytest.approx(fp32, rel=2e-2)  # BF16 rounding only
    assert first["bf16"] != fp32
    # MXFP4 is much further from FP32 than BF16 is
    assert abs(first["fixed"] - fp32) > 5 * abs(first["bf16"] - fp32)


def test_mx_proxy_gsnr_sees_microbatches(method_runs):
    # GSNR ranks by the micro-batch gradients: it refuses to run without them, so a finished run
    # with a full budget every step means they arrived
    assert method_runs["gsnr"]["hit_max_rate"] == 1.0


# ---------------------------------------------------------------- checkpoints and the in-situ switch
def test_mx_proxy_resume_exact_and_with_changed_precision(tmp_path):
    torch.set_num_threads(1)
    ckdir = tmp_path / "ck"
    base = mx_proxy.run(tiny(method="fixed", steps=8, checkpoint_every=4, checkpoint_dir=str(ckdir)))
    ckpt = ckdir / "step_4.pt"
    assert ckpt.is_file() and (ckdir / "step_8.pt").is_file()

    same = mx_proxy.run(tiny(method="fixed", steps=8, resume_from=str(ckpt)))
    assert losses_of(same) == losses_of(base)  # exact: weights, Adam, data stream all restored
    assert same["resumed_from"]["step"] == 4 and same["resumed_from"]["method"] == "fixed"

    switched = mx_proxy.run(tiny(method="bf16", steps=8, resume_from=str(ckpt)))
    a, b = losses_of(base), losses_of(switched)
    assert b[:4] == a[:4]
    assert b[4] != a[4]
    assert switched["resumed_from"] == {"path": str(ckpt), "step": 4, "fmt": "mxfp8_e4m3", "method": "fixed"}
    # step 5 of the switched run = the BF16 loss of the step-4 weights on batch 5, computed here
    cfg = tiny(method="bf16")
    parts = mx_proxy.build(cfg)
    state = torch.load(ckpt, weights_only=False)
    parts["student"].load_state_dict(state["student"])
    set_active_units(parts["student"], range(cfg.depth), units=mx_proxy.units)
    gen = torch.Generator()
    gen.set_state(state["data"])
    x = torch.randn(cfg.batch, cfg.width, generator=gen)
    with torch.no_grad():
        expected = F.mse_loss(parts["student"](x), parts["teacher"](x)).item()
    assert b[4] == pytest.approx(expected, rel=1e-6)
    # the run's only BF16 steps are the 4 after the switch
    assert switched["promotion_ratio"] == 1.0 and switched["steps_done"] == 8


def test_mx_proxy_resume_same_policy_restores_it(tmp_path):
    torch.set_num_threads(1)
    ckdir = tmp_path / "ck"
    cfg = dict(method="random", steps=8, checkpoint_every=4, checkpoint_dir=str(ckdir))
    base = mx_proxy.run(tiny(**cfg, record_units=True))
    resumed = mx_proxy.run(tiny(method="random", steps=8, resume_from=str(ckdir / "step_4.pt"), record_units=True))
    assert losses_of(resumed) == losses_of(base)
    assert resumed["per_unit"]["active"] == base["per_unit"]["active"][4:]


# ---------------------------------------------------------------- oracle
def test_mx_proxy_oracle_gap_matches_a_direct_computation():
    torch.set_num_threads(1)
    cfg = tiny(method="gnmr", steps=3, oracle=True, fmt="mxfp4_e2m1")
    r = mx_proxy.run(cfg)
    gaps = r["per_unit"]["gap"]
    assert len(gaps) == 3 and all(len(row) == 4 for row in gaps)
    assert all(math.isfinite(g) and g > 0 for row in gaps for g in row)
    assert r["oracle"]["steps"] == 3.0 and r["oracle"]["oracle_captured"] > 0
    assert r["per_unit"]["active"][0] == []
    # step 1, by hand: gradients of the initial weights on batch 1, all-MX vs all-BF16
    parts = mx_proxy.build(cfg)
    student, teacher = parts["student"], parts["teacher"]
    x = torch.randn(cfg.batch, cfg.width, generator=parts["data"])
    y = teacher(x)
    grads = {}
    for name, on in (("low", []), ("high", range(cfg.depth))):
        set_active_units(student, on, units=mx_proxy.units)
        student.zero_grad()
        F.mse_loss(student(x), y).backward()
        grads[name] = [torch.cat([p.grad.flatten() for p in b.parameters()]) for b in student.blocks]
    expected = [((lo - hi).norm() / hi.norm()).item() for lo, hi in zip(grads["low"], grads["high"])]
    assert gaps[0] == pytest.approx(expected, rel=1e-5)
    # nothing recovered at step 1 (GNMR starts on the low path): nothing captured
    assert r["oracle"]["captured"] < r["oracle"]["oracle_captured"]


# ---------------------------------------------------------------- sweep runner and report
def test_mx_sweep_grid_and_names():
    grid = mx_sweep.parse_grid(["lr=1e-3,3e-3", "seed=0,1", "method=fixed"])
    pts = mx_sweep.points(grid)
    assert len(pts) == 4 and pts[0] == {"lr": "1e-3", "seed": "0", "method": "fixed"}
    assert mx_sweep.run_name(pts[0]) == "fixed_lr1e-3_seed0"
    with pytest.raises(ValueError, match="key=v1"):
        mx_sweep.parse_grid(["lr"])


@pytest.mark.slow
def test_mx_sweep_runs_skips_and_reports(tmp_path, capsys):
    out = tmp_path / "sweep"
    grid = ["width=32", "depth=4", "batch=16", "steps=4", "val_every=2", "val_batch_size=32",
            "method=fixed,bf16", "seed=0"]
    mx_sweep.main(["--out", str(out), "--grid", *grid])
    runs = mx_report.load_runs(out)
    assert sorted(r["config"]["method"] for r in runs) == ["bf16", "fixed"]
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    mx_sweep.main(["--out", str(out), "--grid", *grid])  # everything done: nothing reruns
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == stamp
    assert "skip" in capsys.readouterr().out
    table = mx_report.sweep_table(runs)
    assert "| 0:. |" in table and table.count("\n") == 3
    assert "| bf16 | 1 | 0/1 | 0/1 |" in mx_report.methods_table(runs)


def test_mx_report_outcome_codes():
    assert mx_report.outcome({"diverged": True, "n_spikes": 2}) == "D"
    assert mx_report.outcome({"diverged": False, "n_spikes": 2}) == "S2"
    assert mx_report.outcome({"diverged": False, "n_spikes": 0}) == "."


@pytest.mark.slow
def test_mx_report_oracle_table_and_heatmap(tmp_path):
    torch.set_num_threads(1)
    r = mx_proxy.run(tiny(method="random", steps=3, oracle=True))
    (tmp_path / "run.json").write_text(json.dumps(r))
    runs = mx_report.load_runs(tmp_path)
    table = mx_report.oracle_table(runs)
    assert table.splitlines()[2].startswith("| random | 0 | 3 |")
    png = tmp_path / "heat.png"
    mx_report.heatmap(runs[0], png)
    assert png.stat().st_size > 1000


def test_mx_proxy_oracle_scores_only_steps_within_the_budget():
    torch.set_num_threads(1)
    # adapt runs its 2-step warm-up with all 4 blocks in BF16: those steps are not scored against a
    # budget of 1; the gaps are still recorded for the heat map
    r = mx_proxy.run(tiny(method="adapt", steps=5, adapt_warmup_steps=2, oracle=True))
    assert r["per_unit"]["active"][:2] == [[0, 1, 2, 3]] * 2 and len(r["per_unit"]["active"][2]) == 1
    assert r["oracle"]["over_budget_steps"] == 2 and r["oracle"]["steps"] == 3.0
    assert len(r["per_unit"]["gap"]) == 5


def test_mx_report_per_seed_table_pairs_by_seed():
    runs = [{"config": {"method": m, "seed": s}, "min_train_loss": v}
            for m, s, v in [("gnmr", 1, 0.5), ("bf16", 0, 0.25), ("bf16", 1, 0.125)]]
    table = mx_report.per_seed_table(runs).splitlines()
    assert table[0] == "| method | seed 0 | seed 1 |"
    assert table[2:] == ["| bf16 | 0.25 | 0.125 |", "| gnmr | - | 0.5 |"]
