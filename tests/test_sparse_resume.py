"""Kill -9 and resume of the sparse stress recipe: masks, per-slot timesteps, optimizer state, the DST log and
the GNMR trace equal those of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "stress" / "sparse.py"
CONFIG = ROOT / "recipes" / "stress" / "configs" / "cpu_tiny.yaml"


def _overrides(cache: Path) -> list[str]:
    return ["train.max_steps=8", "train.save_steps=4", "train.eval_steps=100", "sparse.update_every=3",
            "sparse.density=0.3", "sparse.warmup_steps=3", "gnmr.max_active=4", "gnmr.alpha=1.02",
            "gnmr.alpha_init=1.02", "gnmr.beta=1.02", f"data.cache_dir={cache}"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow  # three recipe subprocesses (~30 s of CPU)
def test_sigkill_and_resume_equal_an_uninterrupted_run(tmp_path):
    cache = tmp_path / "cache"
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    cli = [sys.executable, str(RECIPE), "--config", str(CONFIG), "--method", "gnmr"]
    subprocess.run([*cli, "--output_dir", str(ref), *_overrides(cache)], check=True, env=_env(),
                   capture_output=True, timeout=300)
    # the run to kill hangs after step 6 (two steps past its checkpoint at 4, one topology update at 6 made)
    mark = tmp_path / "at_step_6"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(RECIPE.parent)!r})
        import sparse
        from transformers import TrainerCallback

        class Hang(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 6:
                    open({str(mark)!r}, "w").close()
                    time.sleep(600)

        cfg = sparse.base.load_config({str(CONFIG)!r}, {_overrides(cache)!r})
        sparse.run(cfg, "gnmr", {str(killed)!r}, extra_callbacks=[Hang()])
    """))
    proc = subprocess.Popen([sys.executable, str(child)], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not mark.exists():
            assert proc.poll() is None, "the run to kill ended on its own"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (killed / "checkpoint-4").is_dir() and not (killed / "result.json").exists()
    assert len((killed / "dst_updates.jsonl").read_text().splitlines()) == 2  # steps 3 and 6, the 6th lost
    subprocess.run([*cli, "--output_dir", str(killed), "--resume", *_overrides(cache)], check=True, env=_env(),
                   capture_output=True, timeout=300)

    a, b = ref / "checkpoint-8", killed / "checkpoint-8"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and any(k.endswith(".index") for k in wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k  # masks (index buffers) and weights
    sa = torch.load(a / "optimizer.pt", weights_only=False)["state"]
    sb = torch.load(b / "optimizer.pt", weights_only=False)["state"]
    assert sa.keys() == sb.keys()
    ages = [s["age"] for s in sa.values() if "age" in s]
    assert len(ages) == 14
    # the updates at steps 3 and 6 restarted some slots: ages 2 (moved at 6) and 5 (at 3) beside 8
    assert {2, 5, 8} <= set(torch.cat(ages).tolist())
    for pid in sa:
        for key in sa[pid]:
            assert torch.equal(sa[pid][key], sb[pid][key]), (pid, key)
    for name in ("gnmr_trace.jsonl", "dst_updates.jsonl"):
        la = [json.loads(x) for x in (ref / name).read_text().splitlines()]
        lb = [json.loads(x) for x in (killed / name).read_text().splitlines()]
        assert la == lb, name
    trace = [json.loads(x) for x in (ref / "gnmr_trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trace] == list(range(1, 9)) and any(r["active"] for r in trace)
    steps = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == list(range(1, 9))
