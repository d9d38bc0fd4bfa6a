"""One run of the demo: the ``accelerate launch`` command of its recipe, and whether a run already on disk is the
one this invocation asks for (so an interrupted demo resumes where it stopped, and the comparisons share runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gnmr_hf.demo.config import CALLBACK_RUNS
from gnmr_hf.reporting.stored import exists


def run_complete(run_dir: Path, precision: str, max_steps: int | None = None,
                 compute_dtype: str | None = None, batch_size: int | None = None) -> bool:
    """Whether ``run_dir`` holds a finished run (run.json last, adapter, loss log, trace for gnmr), of
    ``max_steps`` steps of ``batch_size`` examples, computed in ``compute_dtype``, where those are given."""
    needed = ["run.json", "adapter_config.json", "adapter_model.safetensors", "trainer_state.json"]
    if precision in CALLBACK_RUNS:
        needed += ["gnmr_trace.jsonl", "gnmr_summary.json"]
    if not all(exists(run_dir / n) for n in needed):  # a trace may be kept compressed (.gz)
        return False
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except json.JSONDecodeError:
        return False
    if record.get("status") != "complete":
        return False
    config = record.get("config", {})
    if compute_dtype is not None and config.get("script", {}).get("compute_dtype", "bfloat16") != compute_dtype:
        return False
    training = config.get("training", {})
    if batch_size is not None and training.get("per_device_train_batch_size") != batch_size:
        return False
    return max_steps is None or training.get("max_steps") == max_steps


def same_plan(run_dir: Path, source_dir: Path) -> bool:
    """Whether the planned run in ``run_dir`` trained the plan of ``source_dir`` (both ``profile.json`` files hold
    the same ``rungs``): a run trained on an older profile's plan is trained again."""
    def rungs(d: Path) -> Any:
        try:
            return json.loads((d / "profile.json").read_text()).get("rungs")
        except (OSError, ValueError, AttributeError):
            return None

    mine = rungs(run_dir)
    return mine is not None and mine == rungs(source_dir)


def train_command(recipes: Path, precision: str, run_dir: Path, data_dir: Path,
                  overrides: list[str]) -> list[str]:
    """The ``accelerate launch`` command line of one SmolLM2 recipe."""
    import torch  # here, not at the top: `gnmr-hf demo --help` and `import gnmr_hf.demo` stay without torch

    # --quiet: a failing recipe's own one-line error is the last thing printed, not accelerate's traceback
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet"]
    if torch.cuda.is_available():
        cmd += ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    else:
        cmd += ["--config_file", str(recipes / "accelerate" / "cpu.yaml")]
    cmd += [str(recipes / "finetune.py"), "--config", str(recipes / "smollm2-135m" / f"{precision}.yaml"),
            "--output_dir", str(run_dir), "--data_dir", str(data_dir), *overrides]
    return cmd

