"""bench/cost/step_cost.py in its short mode (a tiny random LLaMA, the four recipes, a few interleaved steps): the
cell's record has every method's step times and peaks, the profiles' figures, and the report prints them. No
timing is asserted: the figures live in the bench's output and docs/reference.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "cost" / "step_cost.py"


def _run(*args, timeout=1500):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_short_run_record_and_report(tmp_path):
    out = tmp_path / "sc"
    _run("run", "--short", "--out", str(out))
    cell = out / "tiny_float32.json"
    record = json.loads(cell.read_text())
    assert record["model"] == "tiny" and record["dtype"] == "float32"
    assert "cpu_model" in record["machine"] and "bf16_instructions" in record["machine"]
    rounds = record["rounds_raw"]
    assert len(rounds) == record["rounds"] == 3
    for row in rounds:
        assert set(row) == {"bf16", "nf4", "planned", "ladder"}
        for rec in row.values():
            assert all(_positive(rec[k]) for k in ("seconds", "cpu_seconds", "peak_bytes")), rec
    # the same step of every method in a round: the Trainer's sampler gives each the same batch there
    assert len({tuple(sorted({r["step"] for r in row.values()})) for row in rounds}) == 3
    s = record["summary"]
    assert s["methods"]["nf4"]["time_vs_nf4"]["median"] == 1.0
    for name, m in s["methods"].items():
        for key in ("step_seconds", "time_vs_nf4", "cpu_vs_nf4"):
            assert m[key]["n"] == 3 and m[key]["min"] <= m[key]["median"] <= m[key]["max"], (name, key)
            assert all(_positive(m[key][k]) for k in ("median", "min", "max")), (name, key)
        assert _positive(m["peak_bytes"]) and _positive(m["peak_vs_nf4"])
    assert set(s["profiles"]) == {"profile", "profile-own-loss", "ladder-profile"}
    for kind, p in s["profiles"].items():
        assert p["batches"] == 2
        for key in ("seconds", "steps", "steps_per_batch"):
            assert all(_positive(p[key][k]) for k in ("median", "min", "max")), (kind, key)
        assert _positive(p["peak_bytes"]) and _positive(p["peak_vs_step"]) and _positive(p["step_peak_bytes"])
    assert record["profiles_raw"]["profile"][0]["planned_linears"] > 0
    assert sum(record["profiles_raw"]["ladder-profile"][0]["rung_counts"].values()) > 0
    # resumable: the written cell is skipped
    again = _run("run", "--short", "--out", str(out))
    assert "already written, skipped" in again
    report = _run("report", str(out))
    assert "| ladder |" in report and "| profile |" in report and "Machine:" in report
    assert cell.stat().st_size < 200 * 1024


@pytest.mark.slow
def test_where_writes_a_profiler_table(tmp_path):
    _run("where", "--short", "--methods", "nf4", "--out", str(tmp_path))
    text = (tmp_path / "where_tiny_float32.md").read_text()
    assert "## nf4" in text and "Self CPU" in text
