"""bench/gpu/gpu_check.sh: the GPU readiness check, run here as its CPU dry run (every stage at its smallest size)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import load_bench

ROOT = Path(__file__).resolve().parents[1]


gpu_check = load_bench("gpu_check")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ------------------------------------------------------------------------------ the stage runner


def test_stage_skipped_when_the_budget_is_spent(tmp_path):
    runner = gpu_check.Runner(tmp_path, budget_s=5.0)  # below the 10 s a stage needs to start
    res = runner.run("never", [sys.executable, "-c", "open('ran', 'w')"], limit_s=60)
    assert res["status"] == "skipped" and "budget" in res["reason"]
    assert not (ROOT / "ran").exists() and not (tmp_path / "logs" / "never.log").exists()


def test_stage_status_and_log(tmp_path):
    runner = gpu_check.Runner(tmp_path, budget_s=120.0, min_start_s=0)
    ok = runner.run("ok", [sys.executable, "-c", "print('hello from the stage')"], limit_s=60)
    failed = runner.run("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], limit_s=60)
    assert (ok["status"], ok["returncode"]) == ("ok", 0)
    assert (failed["status"], failed["returncode"]) == ("failed", 3)
    assert "hello from the stage" in (tmp_path / ok["log"]).read_text()


@pytest.mark.slow
def test_stage_timeout_ends_the_whole_process_group(tmp_path):
    runner = gpu_check.Runner(tmp_path, budget_s=120.0, min_start_s=0)
    pid_file = tmp_path / "grandchild.pid"
    # the stage starts a grandchild that would outlive a kill of the stage's own process
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    res = runner.run("hang", [sys.executable, "-c", code], limit_s=3)
    assert res["status"] == "timeout" and time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    for _ in range(50):  # the grandchild is killed with the group; its reaping by init may take a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's grandchild {pid} survived the timeout")


def test_switch_output_parsing_keeps_every_column():
    # the layout bench/cost/switch.py prints on CUDA (the dry run below checks the CPU layout from the real script)
    text = ("storage  prepare s promote ms min/med ready ms min/med demote ms min/med layer MiB peak rec MiB"
            " dev alloc +MiB\n"
            "host          1.25        0.50 / 0.61      2.00 / 2.50       0.10 / 0.12      9.00         9.00"
            "           9.00\n"
            "promote = the set_active_units call; ...\n")
    (row,) = gpu_check.parse_switch_output(text)
    assert row == {"storage": "host", "prepare_s": 1.25, "promote_ms_min": 0.5, "promote_ms_median": 0.61,
                   "ready_ms_min": 2.0, "ready_ms_median": 2.5, "demote_ms_min": 0.1, "demote_ms_median": 0.12,
                   "layer_mib": 9.0, "peak_recovery_mib": 9.0, "device_alloc_increase_mib": 9.0}


@pytest.mark.slow
def test_without_gpu_and_without_dry_run_it_says_so(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "gpu_check.sh"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


# ------------------------------------------------------------------------------ the dry run (slow)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads((out / "gpu_check.json").read_text())
    return proc, report, (out / "gpu_check.md").read_text(), out


@pytest.mark.slow
def test_dry_run_passes_every_stage(dry_run):
    proc, report, _, out = dry_run
    failed = {k: v for k, v in report["stages"].items() if k not in ("recipes", "memory") and v["status"] != "ok"}
    failed.update({r["precision"]: r for r in report["stages"]["recipes"] if r["status"] != "ok"})
    failed.update({"memory " + r["model"]: r for r in report["stages"]["memory"] if r["status"] != "ok"})
    logs = {k: (out / v["log"]).read_text()[-1500:] for k, v in failed.items() if v.get("log")}
    assert failed == {}, f"{json.dumps(failed, indent=1)}\n{logs}"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["dry_run"] is True and report["device"] == "cpu" and report["recipe_steps"] == 2


@pytest.mark.slow
def test_dry_run_gpu_tests_are_collected_and_skip_on_cpu(dry_run):
    _, report, _, _ = dry_run
    p = report["stages"]["pytest_gpu"]
    assert p["files"] == gpu_check.gpu_test_files() and p["files"]
    # every gpu-marked test was collected and, with no CUDA device, skipped itself
    assert (p["passed"], p["failed"], p["errors"]) == (0, 0, 0) and p["skipped"] >= len(p["files"])


@pytest.mark.slow
def test_dry_run_switch_bytes_are_those_of_the_tiny_layer(dry_run):
    _, report, _, _ = dry_run
    rows = {r["storage"]: r for r in report["stages"]["switch"]["rows"]}
    assert sorted(rows) == ["device", "disk", "host"]
    # one decoder layer of the tiny LLaMA (hidden 64, MLP 128, 4 KV heads): q, k, v, o 64x64 and
    # gate, up, down 64x128, in BF16
    layer_mib = 2 * (4 * 64 * 64 + 3 * 64 * 128) / 2**20
    for row in rows.values():
        assert row["layer_mib"] == pytest.approx(layer_mib, abs=0.005)
        assert all(_finite(row[k]) for k in ("promote_ms_min", "ready_ms_median", "demote_ms_median"))
        assert row["promote_ms_min"] <= row["promote_ms_median"]
    # host and disk hold the promoted layer only; device keeps both layers resident all the time
    assert rows["host"]["peak_recovery_mib"] == pytest.approx(layer_mib, abs=0.005)
    assert rows["disk"]["peak_recovery_mib"] == pytest.approx(layer_mib, abs=0.005)
    assert rows["device"]["peak_recovery_mib"] == pytest.approx(2 * layer_mib, abs=0.005)


def _recipe_precision(name: str) -> str:
    import sys

    sys.path.insert(0, str(gpu_check.ROOT / "recipes"))
    import finetune

    return finetune.load_config(["--config", str(gpu_check.RECIPE_DIR / f"{name}.yaml")]).script.precision


@pytest.mark.slow
def test_dry_run_13b_shape_and_recipes_report_real_runs(dry_run):
    _, report, md, out = dry_run
    shape = report["stages"]["shape_13b"]
    assert [r["precision"] for r in shape["results"]] == ["bf16", "int8", "gnmr"]
    assert shape["dry_run"] is True and shape["layers"] == 2
    for row in shape["results"]:
        assert row["steps"] == 2 and _finite(row["final_loss"]) and _finite(row["median_step_s"])
        assert row["peak_memory_gib"] > 0
    assert shape["results"][2]["promotion_ratio"] is not None  # the gnmr run's controller reported
    printed = (out / shape["log"]).read_text()  # bench/gpu/gpu_13b_shape.py's own output
    for precision in ("bf16", "int8", "gnmr"):
        assert f"{precision}: median step" in printed
    recipes = {r["precision"]: r for r in report["stages"]["recipes"]}
    assert sorted(recipes) == gpu_check.recipe_precisions()
    assert {"bf16", "int8", "gnmr", "nf4", "gnmr-nf4"} <= set(recipes)
    for precision, row in recipes.items():
        assert row["global_step"] == 2 and row["device"] == "cpu", precision
        assert _finite(row["first_loss"]) and _finite(row["final_loss"]) and _finite(row["mean_step_s"])
        # the callback runs in the recipes whose precision has a recovery path (gnmr, gnmr-nf4, and the
        # profiled planned-nf4 / hybrid-nf4, which are gnmr-nf4 with a profile block)
        assert (row["promotion_ratio"] is not None) == (_recipe_precision(precision) in ("gnmr", "gnmr-nf4")), precision
    # the low path changed the numbers: INT8 and NF4 bases give other losses than the BF16 one
    assert recipes["int8"]["final_loss"] != recipes["bf16"]["final_loss"]
    assert recipes["nf4"]["final_loss"] != recipes["bf16"]["final_loss"]
    # GNMR with nothing promoted is the fixed low path, step for step
    for gnmr, low in (("gnmr", "int8"), ("gnmr-nf4", "nf4")):
        if recipes[gnmr]["promotion_ratio"] == 0:
            assert recipes[gnmr]["final_loss"] == recipes[low]["final_loss"]
    # the Markdown table carries the JSON's figures, one row per check
    for precision, row in recipes.items():
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| SmolLM2 recipe {precision} |"))
        assert f"{row['final_loss']:.4f}" in line and f"{row['global_step']} steps" in line
    for row in shape["results"]:
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| 13B shape, {row['precision']} |"))
        assert f"final loss {row['final_loss']:.4f}" in line
    assert "| pytest -m gpu | ok |" in md and md.count("| switch, storage ") == 3


@pytest.mark.slow
def test_dry_run_memory_stage_prices_nf4_plan_bf16(dry_run):
    _, report, md, _ = dry_run
    (res,) = report["stages"]["memory"]
    rows = {r["config"]: r for r in res["rows"]}
    assert sorted(rows) == ["bf16", "nf4", "plan"]
    # the plan keeps every v_proj on BF16: more than all-NF4, less than BF16, and nothing upcast on the way
    assert rows["nf4"]["weights_bytes"] < rows["plan"]["weights_bytes"] < rows["bf16"]["weights_bytes"]
    assert all(r["prepared_weights_bytes"] == r["weights_bytes"] for r in rows.values())
    assert rows["plan"]["kept"] > 0 and all(_finite(r["last_loss"]) and r["peak_bytes"] > 0 for r in rows.values())
    for config, row in rows.items():
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| memory tiny, {config} |"))
        assert f"weights {row['weights_bytes'] / 2**20:.1f} MiB" in line
