"""End-to-end recipe runs through ``accelerate launch`` on the real SmolLM2-135M-Instruct (CPU), the
two-process gloo DDP run, and the dry run of bench/gpu_13b_shape.py.

Runs are shortened with overrides (3 steps, 16 problems, batch 2, 64 tokens); each subprocess gets one
OpenMP thread, which on a busy 2-core machine is several times faster than two competing ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SHORT = ["--max_steps", "3", "--num_generated", "16", "--per_device_train_batch_size", "2", "--max_seq_len", "64"]
RUN_FIELDS = {"status", "config", "config_file", "model_path", "versions", "device", "world_size",
              "num_train_examples", "global_step", "wall_time_s", "train_runtime_s", "final_loss", "first_loss",
              "mean_train_loss", "peak_memory_bytes", "peak_memory_kind", "gnmr_summary"}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(accelerate_config: str, recipe: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(RECIPES / "accelerate" / accelerate_config), str(RECIPES / "finetune.py"),
           "--config", str(RECIPES / "smollm2-135m" / f"{recipe}.yaml"), "--output_dir", str(out),
           "--data_dir", str(out.parent / "data"), *SHORT, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "int8", "gnmr"])
def test_smollm2_recipe_three_steps(precision, tmp_path, smollm2_dir):
    out = tmp_path / precision
    # the bf16 run also carries the callback monitor-only (gnmr_monitor): a trace without any switching
    _launch("cpu.yaml", precision, out, *(["--gnmr_monitor", "true"] if precision == "bf16" else []))

    record = json.loads((out / "run.json").read_text())
    assert RUN_FIELDS <= set(record)
    assert record["status"] == "complete" and record["global_step"] == 3 and record["world_size"] == 1
    assert record["config"]["precision"] == precision and record["config"]["max_steps"] == 3
    assert record["num_train_examples"] == 16
    assert record["versions"]["torch"] and record["versions"]["peft"]
    assert record["peak_memory_kind"] == "peak RSS (CPU)" and record["peak_memory_bytes"] > 2**27
    assert record["wall_time_s"] > 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    assert record["final_loss"] == losses[-1] and record["first_loss"] == losses[0]

    # the adapter is a plain PEFT adapter: it loads on the BF16 base with stock PEFT, and training moved it
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, str(out))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 30 * 7  # every projection of every decoder layer
    assert all(torch.isfinite(p).all() for p in lora_b)
    assert sum(int(p.count_nonzero()) for p in lora_b) > 0  # PEFT starts lora_B at zero

    if precision == "gnmr":
        lines = [json.loads(x) for x in (out / "gnmr_trace.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3]
        for x in lines:
            assert len(x["gnmr"]) == 30 and len(x["delta"]) == 30
            assert len(x["active"]) <= 8  # maxO of the SmolLM2 recipe
        assert lines[0]["gnmr"] == [1.0] * 30  # GNMR_{b,1} = 1
        summary = record["gnmr_summary"]["summary"]
        assert summary["steps"] == 3
        # promotion ratio = active unit-steps / recoverable unit-steps (step 1 runs all on INT8)
        active_steps = sum(len(x["active"]) for x in lines[:-1])
        assert summary["promotion_ratio"] == pytest.approx(active_steps / (30 * 3))
        assert record["gnmr_summary"]["recoverable"] == [True] * 30

        from gnmr_hf import plots

        png = plots.plot_gnmr_heatmap(out / "gnmr_trace.jsonl", tmp_path / "heat.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        png = plots.plot_loss_curves({"gnmr": out}, tmp_path / "loss.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    elif precision == "bf16":
        lines = [json.loads(x) for x in (out / "gnmr_trace.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3] and all(x["active"] == [] for x in lines)
        assert all(len(x["gnmr"]) == 30 for x in lines) and lines[1]["gnmr"] != [1.0] * 30
        assert record["gnmr_summary"]["recoverable"] == [False] * 30  # no dual path on a BF16 model
    else:
        assert not (out / "gnmr_trace.jsonl").exists() and record["gnmr_summary"] is None


@pytest.mark.slow
def test_two_process_cpu_ddp(tmp_path):
    out = tmp_path / "ddp"
    proc = _launch("cpu-ddp.yaml", "int8", out, "--max_steps", "2")
    record = json.loads((out / "run.json").read_text())
    # the Trainer saw a 2-process (gloo) world, and only rank 0 wrote the outputs
    assert record["world_size"] == 2 and record["global_step"] == 2 and record["device"] == "cpu"
    assert (proc.stdout + proc.stderr).count("run.json: final loss") == 1
    assert (out / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_bench_13b_shape_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_13b_shape.py"), "--dry-run", "--json",
                           str(tmp_path / "b.json")], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["dry_run"] is True and data["layers"] == 2
    assert [r["precision"] for r in data["results"]] == ["bf16", "int8", "gnmr"]
    for r in data["results"]:
        assert r["steps"] == 2 and r["median_step_s"] > 0 and r["peak_memory_gib"] > 0
    assert data["results"][2]["promotion_ratio"] is not None
    for precision in ("bf16", "int8", "gnmr"):
        assert f"{precision}: median step" in proc.stdout


def test_bench_13b_shape_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_13b_shape.py")], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr


@pytest.mark.slow
def test_demo_end_to_end_and_resume(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "gnmr_hf.cli", "demo", "--out", str(out), "--precisions", "gnmr", "--max-steps", "2",
           "--tasks", "wikitext", "--eval-limit", "1", "--threads", "1", "--set", "num_generated=16",
           "--set", "per_device_train_batch_size=2", "--set", "max_seq_len=64"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    rows = json.loads((out / "summary.json").read_text())
    assert [r["run"] for r in rows] == ["base (no fine-tune)", "gnmr"]
    base, gnmr = rows
    assert gnmr["steps"] == 2 and gnmr["promotion_ratio"] is not None
    assert 1 < base["wikitext_word_ppl"] < 1e4 and 1 < gnmr["wikitext_word_ppl"] < 1e4
    assert base["wikitext_word_ppl"] != gnmr["wikitext_word_ppl"]  # the adapter changed the model
    table = (out / "summary.md").read_text()
    assert table.startswith("| run | steps | loss first -> last |") and "| gnmr | 2 |" in table
    for png in ("loss_curves.png", "gnmr_heatmap.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "eval" / "gnmr.json").is_file() and (out / "gnmr" / "gnmr_trace.jsonl").is_file()

    # a second call finds the run and the evaluations complete and redoes neither
    mtime = (out / "gnmr" / "run.json").stat().st_mtime
    second = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "[demo] gnmr: complete in" in second.stdout and "skipped" in second.stdout
    assert "[demo] eval gnmr:" in second.stdout and "exists, skipped" in second.stdout
    assert (out / "gnmr" / "run.json").stat().st_mtime == mtime
    assert json.loads((out / "summary.json").read_text()) == rows
