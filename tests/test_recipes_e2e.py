"""End-to-end recipe runs through ``accelerate launch`` on the real SmolLM2-135M-Instruct (CPU): the five
precisions on one process, gnmr and gnmr-nf4 as two-process gloo DDP, the demo with --low nf4, and the
13B-shape bench's refusal without a GPU (its dry run is a stage of
bench/gpu/gpu_check.sh's, tests/test_gpu_check.py).

Runs are shortened with overrides (3 steps, 16 problems, batch 2, 64 tokens) and compute in float32
(``--compute_dtype float32``: several times faster than BF16 on CPUs without BF16 matrix units); one run,
``test_smollm2_recipe_as_shipped_computes_in_bf16``, keeps the recipes' BF16. Each subprocess gets one
OpenMP thread, which on a busy 2-core machine is several times faster than two competing ones.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SHORT = ["--max_steps", "3", "--num_generated", "16", "--per_device_train_batch_size", "2", "--max_seq_len", "64",
         "--compute_dtype", "float32"]
RUN_FIELDS = {"status", "config", "config_file", "model", "versions", "device", "world_size",
              "num_train_examples", "global_step", "wall_time_s", "train_runtime_s", "final_loss", "first_loss",
              "mean_train_loss", "peak_memory_bytes", "peak_memory_kind", "gnmr_summary"}
LAYERS = 30  # SmolLM2-135M's decoder layers
PRECISIONS = ("bf16", "int8", "gnmr", "nf4", "gnmr-nf4")


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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def _trace(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "gnmr_trace.jsonl").read_text().splitlines()]


class _Runs(dict):
    """The SmolLM2 recipes, 3 steps each on one process, launched on first use (so ``-k nf4`` trains only
    what it checks); bf16 carries the callback monitor-only."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root
        self.output: dict[str, str] = {}  # what each run printed (stdout + stderr)

    def __missing__(self, precision: str) -> Path:
        out = self.root / precision
        proc = _launch("cpu.yaml", precision, out, *(["--gnmr.monitor", "true"] if precision == "bf16" else []))
        self.output[precision] = proc.stdout + proc.stderr
        self[precision] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return _Runs(tmp_path_factory.mktemp("recipes"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_smollm2_recipe_three_steps(runs, precision, smollm2_dir):
    out = runs[precision]
    record = json.loads((out / "run.json").read_text())
    assert RUN_FIELDS <= set(record)
    assert record["status"] == "complete" and record["global_step"] == 3 and record["world_size"] == 1
    assert record["config"]["script"]["precision"] == precision and record["config"]["training"]["max_steps"] == 3
    assert record["config_file"] == str(RECIPES / "smollm2-135m" / f"{precision}.yaml")
    assert record["num_train_examples"] == 16 and record["config"]["script"]["compute_dtype"] == "float32"
    assert record["versions"]["torch"] and record["versions"]["peft"]
    assert record["peak_memory_kind"] == "peak RSS (CPU)"
    losses = _losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert record["final_loss"] == losses[-1] and record["first_loss"] == losses[0]
    # said once, or not at all where it is not ours (tests/test_faults_r5_noise.py): bitsandbytes' INT8 cast note at
    # most once, its failed optional Hub-kernel lookup never
    printed = runs.output[precision].splitlines()
    assert [line for line in printed if "kernels-community" in line] == []
    assert len([line for line in printed if "MatMul8bitLt: inputs will be cast" in line]) <= 1
    if precision in ("gnmr", "gnmr-nf4"):  # a controller that moves logs its per-step counts at every step
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        steps = [h for h in history if "loss" in h]
        assert len(steps) == 3 and all({"gnmr/active", "gnmr/promoted", "gnmr/over_gnmr"} <= set(h) for h in steps)

    # the adapter is a plain PEFT adapter: it loads on the BF16 base with stock PEFT, and training moved it
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, str(out))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == LAYERS * 7  # every projection of every decoder layer
    assert all(torch.isfinite(p).all() for p in lora_b)
    assert all(int(p.count_nonzero()) > 0 for p in lora_b)  # PEFT starts lora_B at zero

    if precision in ("gnmr", "gnmr-nf4"):
        lines = _trace(out)
        assert [x["step"] for x in lines] == [1, 2, 3]
        for x in lines:
            assert len(x["gnmr"]) == LAYERS and len(x["delta"]) == LAYERS
            assert len(x["active"]) <= 8  # maxO of the SmolLM2 recipes
        assert lines[0]["gnmr"] == [1.0] * LAYERS  # GNMR_{b,1} = 1
        summary = record["gnmr_summary"]["summary"]
        assert summary["steps"] == 3
        # promotion ratio = active unit-steps / recoverable unit-steps (step 1 runs all on the low path)
        active_steps = sum(len(x["active"]) for x in lines[:-1])
        assert summary["promotion_ratio"] == pytest.approx(active_steps / (LAYERS * 3))
        assert record["gnmr_summary"]["recoverable"] == [True] * LAYERS
    elif precision == "bf16":
        lines = _trace(out)
        assert [x["step"] for x in lines] == [1, 2, 3] and all(x["active"] == [] for x in lines)
        assert all(len(x["gnmr"]) == LAYERS for x in lines) and lines[1]["gnmr"] != [1.0] * LAYERS
        assert record["gnmr_summary"]["recoverable"] == [False] * LAYERS  # no dual path on a BF16 model
    else:
        assert not (out / "gnmr_trace.jsonl").exists() and record["gnmr_summary"] is None


@pytest.mark.slow
def test_smollm2_recipe_as_shipped_computes_in_bf16(tmp_path):
    """The gnmr recipe with its own dtype (BF16 weights, BF16 recovery path): the precision the recipes ship
    with, while the other runs here compute in float32 for speed. BF16 matmuls are slow on CPUs without BF16
    instructions, so this run is smaller (2 steps of one 32-token problem); its float32 twin (the same
    overrides and --compute_dtype float32, one step) gives the first loss to compare against."""
    small = ["--num_generated", "16", "--per_device_train_batch_size", "1", "--max_seq_len", "32"]
    env = _env()

    def launch(out: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(RECIPES / "accelerate" / "cpu.yaml"), str(RECIPES / "finetune.py"), "--config",
               str(RECIPES / "smollm2-135m" / "gnmr.yaml"), "--output_dir", str(out), "--data_dir",
               str(tmp_path / "data"), *small, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    out, twin = tmp_path / "gnmr-bf16", tmp_path / "gnmr-fp32"
    launch(out, "--max_steps", "2")
    launch(twin, "--max_steps", "1", "--compute_dtype", "float32")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "complete" and record["global_step"] == 2
    assert record["config"]["script"]["compute_dtype"] == "bfloat16"
    assert json.loads((twin / "run.json").read_text())["config"]["script"]["compute_dtype"] == "float32"
    losses = _losses(out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    lines = _trace(out)
    assert [x["step"] for x in lines] == [1, 2] and all(len(x["gnmr"]) == LAYERS for x in lines)
    # the same batch and LoRA start as the float32 twin: a close but different first loss (BF16 rounding)
    first_fp32 = _losses(twin)[0]
    assert losses[0] != first_fp32 and losses[0] == pytest.approx(first_fp32, rel=0.05)


def _same_until_promoted(gnmr_run: Path, low_run: Path) -> int:
    """Check that a GNMR run's losses equal its fixed low path's up to the first step that ran a layer on
    BF16, and differ at that step; returns that step (0 if nothing was promoted)."""
    lines, gnmr_losses, low_losses = _trace(gnmr_run), _losses(gnmr_run), _losses(low_run)
    # the active set of trace line t is what step t + 1 runs on the recovery path
    first = next((x["step"] + 1 for x in lines if x["active"]), 0)
    if first == 0 or first > len(gnmr_losses):
        assert gnmr_losses == low_losses
        return 0
    # same batches, same LoRA initialisation, the same low-path matmuls: identical up to the switch
    assert gnmr_losses[:first - 1] == low_losses[:first - 1]
    assert gnmr_losses[first - 1] != low_losses[first - 1]
    return first


@pytest.mark.slow
@pytest.mark.parametrize("low", ["int8", "nf4"])
def test_gnmr_run_is_its_low_path_until_a_layer_is_promoted(runs, low):
    gnmr = "gnmr" if low == "int8" else "gnmr-nf4"
    first = _same_until_promoted(runs[gnmr], runs[low])
    assert first >= 2  # step 1 always runs on the low path


@pytest.mark.slow
def test_first_step_losses_across_precisions(runs):
    """Step 1 sees the same batch everywhere with lora_B = 0: the quantised bases move its loss away from
    BF16's, INT8 by little and NF4 by much more (measured with BF16 compute: 2.188 and 2.806 against
    2.192; the runs here compute in float32)."""
    first = {p: _losses(runs[p])[0] for p in ("bf16", "int8", "nf4")}
    assert all(math.isfinite(x) for x in first.values())
    assert first["int8"] != first["bf16"] and first["int8"] == pytest.approx(first["bf16"], rel=0.05)
    assert abs(first["nf4"] - first["bf16"]) > 5 * abs(first["int8"] - first["bf16"])
    assert first["nf4"] == pytest.approx(first["bf16"], rel=0.5)


@pytest.mark.slow
def test_nf4_adapter_loads_on_a_4bit_base(runs, smollm2_dir):
    import bitsandbytes as bnb
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    ids = AutoTokenizer.from_pretrained(smollm2_dir)("Question: 2 + 3?\nAnswer:", return_tensors="pt")["input_ids"]
    outputs = {}
    for name in ("nf4", "gnmr-nf4"):
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16, quantization_config=q)
        if not outputs:
            with torch.no_grad():
                outputs["base"] = base(input_ids=ids).logits.float()
        model = PeftModel.from_pretrained(base, str(runs[name]))
        assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
        with torch.no_grad():
            outputs[name] = model(input_ids=ids).logits.float()
        assert torch.isfinite(outputs[name]).all()
        assert not torch.equal(outputs[name], outputs["base"])  # the adapter changes the 4-bit model
    assert not torch.equal(outputs["nf4"], outputs["gnmr-nf4"])  # GNMR's BF16 steps trained another adapter


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["gnmr", "gnmr-nf4"])
def test_two_process_cpu_ddp(precision, tmp_path, tiny_tok):
    # the 2-process (gloo) plumbing of the recipes as shipped, on the tiny LLaMA with SmolLM2's tokenizer (--model; 2
    # decoder layers): a launch is mostly imports, and the real model's figures are the one-process runs' above
    out = tmp_path / "ddp"
    proc = _launch("cpu-ddp.yaml", precision, out, "--model", str(tiny_tok))
    record = json.loads((out / "run.json").read_text())
    # the Trainer saw a 2-process (gloo) world, and only rank 0 wrote the outputs
    assert record["world_size"] == 2 and record["global_step"] == 3 and record["device"] == "cpu"
    assert (proc.stdout + proc.stderr).count("run.json: final loss") == 1
    assert (out / "adapter_model.safetensors").is_file()
    losses = _losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # one trace for both ranks: the promoted sets were agreed, so each line is written once
    lines = _trace(out)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(len(x["gnmr"]) == 2 and len(x["active"]) <= 2 for x in lines)
    assert record["gnmr_summary"]["summary"]["steps"] == 3


@pytest.mark.slow  # a subprocess that imports torch: seconds
def test_bench_13b_shape_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "gpu_13b_shape.py")], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr


@pytest.mark.slow
def test_demo_nf4_end_to_end_and_resume(runs, tmp_path):
    out = tmp_path / "demo"
    # gnmr-nf4 is this module's recipe run (the same overrides and 3 steps), copied where the demo keeps its run:
    # the demo finds it complete and keeps it (a launch less), and trains planned-nf4 itself
    shutil.copytree(runs["gnmr-nf4"], out / "gnmr-nf4")
    kept_mtime = (out / "gnmr-nf4" / "run.json").stat().st_mtime
    # the installed console script, next to this interpreter
    cmd = [str(Path(sys.executable).parent / "gnmr-hf"), "demo", "--out", str(out), "--low", "nf4", "--precisions",
           "planned-nf4,gnmr-nf4", "--max-steps", "3", "--tasks", "wikitext", "--eval-limit", "1", "--threads", "1",
           "--set", "num_generated=16", "--set", "per_device_train_batch_size=2", "--set", "max_seq_len=64",
           "--set", "compute_dtype=float32"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert "[demo] train gnmr-nf4 (2/2): complete in" in first.stdout  # kept, not trained again
    assert (out / "gnmr-nf4" / "run.json").stat().st_mtime == kept_mtime
    assert json.loads((out / "planned-nf4" / "run.json").read_text())["global_step"] == 3  # trained by the demo
    rows = json.loads((out / "summary_nf4.json").read_text())
    assert [r["run"] for r in rows] == ["base (no fine-tune)", "planned-nf4", "gnmr-nf4"]
    base, planned, gnmr = rows
    # the planned run: its plan in run.json and named under the table, its profile.json beside the adapter
    plan = json.loads((out / "planned-nf4" / "run.json").read_text())["profile"]["plan"]
    assert planned["plan"] == plan and plan["indices"] and plan["price_over_nf4_bytes"] <= plan["budget_bytes"]
    assert json.loads((out / "planned-nf4" / "profile.json").read_text())["skip_modules"]
    assert f"planned-nf4: {len(plan['indices'])} linears kept on BF16" in (out / "summary_nf4.md").read_text()
    assert planned["wikitext_word_ppl"] != gnmr["wikitext_word_ppl"]
    record = json.loads((out / "gnmr-nf4" / "run.json").read_text())
    assert gnmr["steps"] == 3 and gnmr["final_loss"] == record["final_loss"]
    assert gnmr["promotion_ratio"] == record["gnmr_summary"]["summary"]["promotion_ratio"]
    assert math.isfinite(base["wikitext_word_ppl"]) and math.isfinite(gnmr["wikitext_word_ppl"])
    assert base["wikitext_word_ppl"] != gnmr["wikitext_word_ppl"]  # the adapter changed the model
    table = (out / "summary_nf4.md").read_text()
    assert table.startswith("| run | steps | loss first -> last |") and "| gnmr-nf4 | 3 |" in table
    for png in ("loss_curves_nf4.png", "gnmr_heatmap_nf4.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "eval" / "gnmr-nf4.json").is_file()

    # a second call finds the run and the evaluations complete and redoes neither
    mtime = (out / "gnmr-nf4" / "run.json").stat().st_mtime
    second = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "[demo] train gnmr-nf4 (2/2): complete in" in second.stdout and "kept" in second.stdout
    assert "[demo] train planned-nf4 (1/2): complete in" in second.stdout
    # every task of the adapter's evaluation is read back from its earlier result, none scored again
    assert "[demo] eval gnmr-nf4" in second.stdout
    assert "gnmr-hf eval: wikitext (1/1): read from" in second.stderr + second.stdout
    assert (out / "gnmr-nf4" / "run.json").stat().st_mtime == mtime
    assert json.loads((out / "summary_nf4.json").read_text()) == rows
