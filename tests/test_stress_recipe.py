"""The activation-quantisation stress recipe: a short real Trainer run of every method, and the report.

Runs on the corpus sample shipped in recipes/stress/corpus_sample (no apt package, no download).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRESS = ROOT / "recipes" / "stress"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"stress_{name}", STRESS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pretrain():
    return _load("pretrain")


@pytest.fixture(scope="module")
def runs(pretrain, tmp_path_factory):
    """Every method for 4 optimizer steps (2 micro-batches each) on the tiny config."""
    base = tmp_path_factory.mktemp("stress")
    cfg = pretrain.load_config(STRESS / "configs" / "cpu_tiny.yaml", [f"data.cache_dir={base / 'cache'}"])
    out = {}
    for method in pretrain.METHODS:
        if method != "fixed":  # "fixed" is the MX path's all-low method
            out[method] = (pretrain.run(cfg, method, base / method), base / method)
    return out


@pytest.fixture(scope="module")
def mx_runs(pretrain, tmp_path_factory):
    """The MX low path (--low mxfp4) for 4 steps, each kind of method once."""
    base = tmp_path_factory.mktemp("stress_mx")
    cfg = pretrain.load_config(STRESS / "configs" / "cpu_tiny.yaml", [f"data.cache_dir={base / 'cache'}"])
    return {m: (pretrain.run(cfg, m, base / m, low="mxfp4"), base / m) for m in ("bf16", "fixed", "gnmr", "adapt")}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_config_overrides_and_data_split(pretrain):
    cfg = pretrain.load_config(STRESS / "configs" / "cpu_tiny.yaml", ["train.max_steps=7", "gnmr.alpha=2.5", "train.learning_rate=5e-3"])
    assert cfg["train"]["max_steps"] == 7 and cfg["gnmr"]["alpha"] == 2.5
    assert cfg["train"]["learning_rate"] == 5e-3
    files = pretrain.corpus_files(STRESS / "corpus_sample")
    train, val = pretrain.split_files(files, 5)
    assert len(files) == 5 and len(val) == 1 and not set(train) & set(val)
    with pytest.raises(ValueError, match="key=value"):
        pretrain.load_config(STRESS / "configs" / "cpu_tiny.yaml", ["oops"])
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        pretrain.corpus_files("/nonexistent/corpus")


def test_every_method_trains(runs):
    finals = {}
    for method, (res, out) in runs.items():
        assert res["method"] == method
        # below the uniform-prediction loss log(384): every method learned something in 4 steps
        assert math.isfinite(res["final_eval_loss"]) and res["final_eval_loss"] < math.log(384)
        finals[method] = res["final_eval_loss"]
        lines = _lines(out / "metrics.jsonl")
        steps = [r for r in lines if "step_time" in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        assert (out / "result.json").is_file()
        assert res["num_units"] == 14  # 7 projections x 2 layers
    # the methods really differ in their weight gradients, so the trajectories differ
    assert len({round(v, 7) for v in finals.values()}) >= 5
    # saved-activation memory: 4-bit < 8-bit < unquantised
    mem = {m: runs[m][0]["peak_saved_act_MB"] for m in ("fixed4", "fixed8", "bf16")}
    assert mem["fixed4"] < mem["fixed8"] < mem["bf16"]


def test_fixed_methods_never_switch(runs):
    for method in ("bf16", "fixed4", "fixed8"):
        res, out = runs[method]
        # monitored by the controller with max_active = 0: statistics, never a promotion
        assert res["monitor_only"] and res["policy_summary"]["promotion_ratio"] == 0.0
        assert res["policy_summary"]["gnmr_exceedance_rate"] > 0
        assert all(r["active"] == [] for r in _lines(out / "metrics.jsonl") if "step_time" in r)
        assert all(r["active"] == [] for r in _lines(out / "gnmr_trace.jsonl"))


@pytest.mark.parametrize("method", ["gnmr", "adapt", "gsnr", "random"])
def test_callback_drives_act_quant_units(runs, method):
    """The decision GNMRCallback takes at step t (trace) is the set of ActQuantLinear operators on the
    8-bit path during step t+1 (read from the modules at step begin): the same actuator as INT8/BF16."""
    res, out = runs[method]
    trace = _lines(out / "gnmr_trace.jsonl")
    seen = {r["step"]: r["active"] for r in _lines(out / "metrics.jsonl") if "step_time" in r}
    assert [r["step"] for r in trace] == [1, 2, 3, 4]
    assert seen[1] == []  # step 1 runs everything on the low-cost path
    for rec in trace[:-1]:
        assert seen[rec["step"] + 1] == rec["active"]
        assert len(rec["active"]) <= 3  # max_active of the tiny config
    summary = res["policy_summary"]
    assert summary["steps"] == 4
    assert {"promotion_ratio", "hit_max_rate", "switches"} <= set(summary)
    if method in ("gsnr", "random"):
        assert all(len(r["active"]) == 3 for r in trace)  # full-budget rankers
        assert summary["hit_max_rate"] == 1.0
    if method == "adapt":
        # warm-up (W = 2) saved BF16 activations; afterwards the fixed set never moves
        bytes_ = {r["step"]: r["saved_act_bytes"] for r in _lines(out / "metrics.jsonl") if "step_time" in r}
        assert bytes_[1] == bytes_[2] > bytes_[3] == bytes_[4]
        assert trace[1]["active"] == trace[2]["active"] == trace[3]["active"] != []


def test_report_tables_and_plot(runs, tmp_path):
    report = _load("report")
    results = [report.load_result(out) for _, out in runs.values()]
    md = report.render(results)
    for heading in ("Validation perplexity", "Threshold exceedance", "Matched-trigger"):
        assert heading in md
    for method in ("fixed4", "gnmr", "adapt", "gsnr", "random", "bf16", "fixed8"):
        assert f"| {report.LABELS[method]} |" in md
    ppl = runs["gnmr"][0]["final_ppl"]
    assert f"{ppl:.2f}" in md
    png = tmp_path / "loss.png"
    report.plot(results, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_resume_from_checkpoint_is_exact(pretrain, runs, tmp_path):
    """Interrupt after step 2 (keep only checkpoint-2) and resume: same final loss and policy summary."""
    cfg = pretrain.load_config(STRESS / "configs" / "cpu_tiny.yaml",
                               [f"data.cache_dir={tmp_path / 'cache'}", "train.save_steps=2", "train.save_total_limit=2"])
    out = tmp_path / "gsnr"
    pretrain.run(cfg, "gsnr", out)
    import shutil

    shutil.rmtree(out / "checkpoint-4")
    resumed = pretrain.run(cfg, "gsnr", out, resume=True)
    full = runs["gsnr"][0]
    # it really resumed: the second run appended only steps 3 and 4 (a fresh start would add 1-4)
    assert [r["step"] for r in _lines(out / "metrics.jsonl") if "step_time" in r] == [1, 2, 3, 4, 3, 4]
    assert resumed["final_eval_loss"] == full["final_eval_loss"]
    assert resumed["policy_summary"] == full["policy_summary"]


# ---------------------------------------------------------------- the MX low path (--low mxfp4)
@pytest.mark.slow
def test_stress_mx_low_path_trains_and_switches_layers(mx_runs):
    finals = {}
    for method, (res, out) in mx_runs.items():
        assert res["low"] == "mxfp4_e2m1" and res["num_units"] == 2  # the decoder layers are the units
        assert math.isfinite(res["final_eval_loss"]) and res["final_eval_loss"] < math.log(384)
        finals[method] = res["final_eval_loss"]
        seen = {r["step"]: r["active"] for r in _lines(out / "metrics.jsonl") if "step_time" in r}
        assert sorted(seen) == [1, 2, 3, 4]
        if method == "bf16":
            assert all(v == [0, 1] for v in seen.values())
        if method == "fixed":
            assert all(v == [] for v in seen.values())
        if method == "adapt":  # BF16 warm-up (W = 2), then its fixed set of 1 (25 % of 2 layers, at least 1)
            assert seen[1] == seen[2] == [0, 1] and seen[3] == seen[4] and len(seen[3]) == 1
        if method == "gnmr":
            trace = _lines(out / "gnmr_trace.jsonl")
            assert seen[1] == [] and all(seen[r["step"] + 1] == r["active"] for r in trace[:-1])
    # the MX path changes the numbers: BF16 and all-MX end at different losses
    assert finals["bf16"] != finals["fixed"]


def test_stress_mx_low_path_converts_the_layers(pretrain):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gnmr_hf.backends.mx import MXLinear

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=16))
    units = pretrain.apply_method(model, "gnmr", {"mx": {}}, pretrain.resolve_low("mxfp8"))
    assert [n for n, _ in units] == ["model.layers.0", "model.layers.1"]
    assert sum(isinstance(m, MXLinear) for m in model.modules()) == 14  # 7 projections x 2 layers
    assert not isinstance(model.lm_head, MXLinear)  # outside the units
    with pytest.raises(ValueError, match="--low"):
        pretrain.resolve_low("fp4")
    with pytest.raises(ValueError, match="use 'fixed'"):
        pretrain.apply_method(model, "fixed4", {"mx": {}}, "mxfp4_e2m1")
    with pytest.raises(ValueError, match="needs an MX low path"):
        pretrain.apply_method(model, "fixed", {"quant": {"low_bits": 4, "high_bits": 8}}, "act")


@pytest.mark.slow
def test_stress_mx_seeds_report_and_plot(mx_runs, tmp_path):
    """The per-method table over seeds (report.py --seeds) from real MX runs, and its command line."""
    report = _load("report")
    results = [report.load_result(out) for _, out in mx_runs.values()]
    md = report.render_seeds(results)
    assert "low path mxfp4_e2m1" in md
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"method", "mxfp4_e2m1", "GNMR+Δ", "ADAPT-style static", "BF16"}
    for method, label in (("fixed", "mxfp4_e2m1"), ("gnmr", "GNMR+Δ"), ("bf16", "BF16")):
        loss = mx_runs[method][0]["final_eval_loss"]
        assert f"{loss:.4f} [{loss:.4f}, {loss:.4f}]" in rows[label]  # one seed: median = min = max
    gnmr_summary = mx_runs["gnmr"][0]["policy_summary"]
    assert f"| {gnmr_summary['promotion_ratio']:.3f} |" in rows["GNMR+Δ"]
    bf16_row = rows["BF16"].split(" | ")
    assert bf16_row[5] == bf16_row[6] == "–"  # no difference from itself, no promotion ratio (never switches)
    fixed_loss, bf16_loss = mx_runs["fixed"][0]["final_eval_loss"], mx_runs["bf16"][0]["final_eval_loss"]
    d = fixed_loss - bf16_loss
    assert rows["mxfp4_e2m1"].split(" | ")[5] == f"{d:+.4f} [{d:+.4f}, {d:+.4f}]"
    png = tmp_path / "seeds.png"
    report.plot_seeds(results, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    # the command line finds the runs recursively (seed folders) and writes the same table
    seed_dir = tmp_path / "bench" / "s0"
    seed_dir.mkdir(parents=True)
    for method, (_, out) in mx_runs.items():
        shutil.copytree(out, seed_dir / method, ignore=shutil.ignore_patterns("checkpoint-*", "final"))
    report.main([str(tmp_path / "bench"), "--seeds", "--out", str(tmp_path / "t.md")])
    assert (tmp_path / "t.md").read_text() == md
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "empty_nothing_here"), "--seeds"])


def test_mx_seeds_table_counts_spikes_and_divergence(tmp_path):
    """Hand-made loss curves: spike runs and divergence counted as defined (factor x running minimum)."""
    report = _load("report")

    def fake(method: str, losses: list[float], final: float, seed: int) -> dict:
        return {
            "method": method, "low": "mxfp4_e2m1", "final_eval_loss": final, "wall_s": 10.0 * (seed + 1),
            "run_dir": f"s{seed}/{method}", "monitor_only": method == "fixed",
            "train_curve": list(enumerate(losses, start=1)),
            "config": {"train": {"max_steps": len(losses), "seed": seed}},
            "policy_summary": {"promotion_ratio": 0.25, "hit_max_rate": 0.5, "gnmr_exceedance_rate": 0.1,
                               "delta_exceedance_rate": 0.2},
        }

    # diverged = mean of the last 20 losses above 1.2 x the minimum (3.0 here, so 3.6)
    calm = [5.0, 4.0, 3.5, 3.2] + [3.0] * 16  # tail mean 3.185
    # 3.7 > 1.2 * 3.0 = 3.6: one spike (steps 4-5); then 3.1 is back under 1.2 x 3.0; tail mean 3.38
    one_spike = [5.0, 4.0, 3.0, 3.7, 3.8, 3.1] + [3.0] * 6
    # two spikes; tail mean 24 / 7 = 3.43, not diverged
    two_spikes = [4.0, 3.0, 4.0, 3.0, 4.0, 3.0, 3.0]
    # non-finite: diverged, and a spike
    nan_run = [5.0, 4.0, float("nan"), 4.0]
    runs = [fake("fixed", one_spike, 3.5, 0), fake("fixed", two_spikes, 3.3, 1), fake("fixed", nan_run, 9.0, 2),
            fake("gnmr", calm, 3.0, 0), fake("gnmr", calm, 3.2, 1), fake("bf16", calm, 3.1, 0), fake("bf16", calm, 3.0, 1)]
    assert report.instability(runs[0], 1.2) == (1, False)
    assert report.instability(runs[1], 1.2) == (2, False)
    assert report.instability(runs[2], 1.2) == (1, True)
    assert report.instability(runs[3], 1.2) == (0, False)
    assert report.instability(fake("gnmr", calm[:5], 3.0, 0), 1.2) == (0, True)  # tail mean 3.74: never came down
    # a higher factor sees none of the small spikes
    assert report.instability(runs[0], 1.5) == (0, False)
    table = report.table_seeds(runs, 1.2)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    fixed, gnmr = rows["mxfp4_e2m1"], rows["GNMR+Δ"]
    assert fixed[1:5] == ["3", "3 (4)", "1", "3.5000 [3.3000, 9.0000]"]
    # paired with BF16 of the same seed: 3.5 - 3.1 and 3.3 - 3.0 (seed 2 has no BF16 run)
    assert fixed[5] == "+0.3500 [+0.3000, +0.4000]"
    assert fixed[6] == "–" and fixed[-1] == "20 |"  # median wall of 10, 20, 30
    assert gnmr[1:5] == ["2", "0 (0)", "0", "3.1000 [3.0000, 3.2000]"]
    assert gnmr[5] == "+0.0500 [-0.1000, +0.2000]"  # 3.0 - 3.1 and 3.2 - 3.0
    assert gnmr[6:10] == ["0.250", "0.500", "10.0%", "20.0%"]
    # a run logged every 10 steps cannot be checked for spikes: a clear error, not a silent 0
    sparse = fake("gnmr", calm, 3.0, 0)
    sparse["train_curve"] = [(2, 4.0), (4, 3.2)]
    with pytest.raises(ValueError, match="logging_steps=1"):
        report.instability(sparse, 1.2)
