"""GPU readiness check: every GPU-side check of the project in one run, one JSON and one Markdown table.

Started by ``bench/gpu/gpu_check.sh`` (see there for the commands). Four stages, each a subprocess with its
own time limit, all inside one overall budget (570 s by default: the check must fit in 10 minutes on one
GPU); a stage that would start with too little of the budget left is recorded as skipped, never silently
dropped:

1. ``pytest -m gpu`` over the test files that carry the ``gpu`` marker (pass/fail/skip counts);
2. ``bench/cost/switch.py``: promote / demote time of one decoder layer of SmolLM2-135M, per storage;
3. ``bench/gpu/gpu_13b_shape.py``: bf16 / int8 / gnmr step time and peak device memory on a model of
   LLaMA-2 13B's layer shape;
4. 20 steps of each SmolLM2 recipe (``recipes/smollm2-135m/*.yaml`` but ``base.yaml``) through
   ``recipes/finetune.py``: steps, mean step time, peak memory, first and last loss;
5. ``bench/cost/train_memory.py`` on SmolLM2 and Gemma 3 270M (when installed): the weights' bytes and the
   training peak (``torch.cuda.max_memory_allocated``) of LoRA on all-NF4, NF4 with every ``v_proj`` on
   BF16 (a plan) and BF16.

``--dry-run`` runs every stage at its smallest size on the CPU (the gpu tests skip themselves there, the
switch bench and the recipes use a tiny random LLaMA, the 13B-shape bench its own ``--dry-run``) and still
writes both files: that is what ``tests/test_gpu_check.py`` runs. Figures are written, never asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECIPE_DIR = ROOT / "recipes" / "smollm2-135m"
# seconds per stage on a GPU ("recipe": per SmolLM2 recipe, 5 of them; "memory": per model, SmolLM2 and
# Gemma 3); together 560 s, inside the 570 s default budget. The dry run multiplies them by 4: on a CPU every subprocess pays seconds of imports.
LIMITS = {"pytest_gpu": 60, "switch": 60, "shape_13b": 200, "recipe": 30, "memory": 45}
# the least time a stage needs to say anything useful; below it the stage is skipped
MIN_START_S = 10


def recipe_precisions() -> list[str]:
    """The SmolLM2 recipe variants, one per YAML file (``base.yaml`` only holds shared values)."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml") if p.stem != "base")


def gpu_test_files() -> list[str]:
    """Test files that use the ``gpu`` marker, so the run collects only those."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def parse_switch_output(text: str) -> list[dict[str, Any]]:
    """The table rows of ``bench/cost/switch.py``'s output, one dict per storage.

    Columns (as switch.py prints them): storage, prepare s, promote ms min/med, ready ms min/med,
    demote ms min/med, layer MiB, peak recovery MiB, and on CUDA the device allocation increase in MiB.
    """
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("host", "device", "disk"):
            continue
        nums = [p for p in parts[1:] if p != "/"]
        try:
            values = [float(x) for x in nums]
        except ValueError:
            continue
        if len(values) < 9:
            continue
        row = {"storage": parts[0], "prepare_s": values[0], "promote_ms_min": values[1],
               "promote_ms_median": values[2], "ready_ms_min": values[3], "ready_ms_median": values[4],
               "demote_ms_min": values[5], "demote_ms_median": values[6], "layer_mib": values[7],
               "peak_recovery_mib": values[8]}
        if len(values) > 9:
            row["device_alloc_increase_mib"] = values[9]
        rows.append(row)
    return rows


def junit_counts(path: Path) -> dict[str, int]:
    """Passed / failed / errors / skipped from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


class Runner:
    """Runs stage commands as subprocesses inside the overall budget, each with its own log file."""

    def __init__(self, out: Path, budget_s: float, limit_scale: float = 1.0, min_start_s: float = MIN_START_S) -> None:
        self.out = out
        self.limit_scale = limit_scale
        self.min_start_s = min_start_s
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], limit_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run ``cmd``; returns status (ok / failed / timeout / skipped), seconds, return code and log path."""
        log = self.logs / f"{name}.log"
        limit = min(limit_s * self.limit_scale, self.left())
        if limit < self.min_start_s:
            return {"status": "skipped", "reason": f"{self.left():.0f} s of the budget left", "seconds": 0.0}
        t0 = time.monotonic()
        with open(log, "w") as fh:
            fh.write("$ " + shlex.join(cmd) + "\n")
            fh.flush()
            # a session of its own, so that a timeout ends the stage's whole process group and nothing else
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                status = "timeout"
        return {"status": status, "returncode": rc, "seconds": round(time.monotonic() - t0, 2),
                "limit_s": round(limit, 1), "log": str(log.relative_to(self.out))}


def stage_pytest(r: Runner, dry_run: bool) -> dict[str, Any]:
    files = gpu_test_files()
    if not files:
        return {"status": "failed", "reason": "no test file carries the gpu marker", "seconds": 0.0}
    xml = r.logs / "pytest_gpu.xml"
    res = r.run("pytest_gpu", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                               f"--junitxml={xml}", *files], LIMITS["pytest_gpu"])
    res["files"] = files
    if xml.is_file():
        res.update(junit_counts(xml))
    if res["status"] == "ok" and not dry_run and res.get("skipped"):
        res["status"] = "failed"  # on a GPU machine a skipped gpu test means the GPU was not seen
        res["reason"] = "gpu tests skipped on a GPU run"
    return res


def stage_switch(r: Runner, dry_run: bool, tiny: Path | None) -> dict[str, Any]:
    if dry_run:
        cmd = [sys.executable, "bench/cost/switch.py", "--cpu", "--model", str(tiny), "--layer", "1", "--reps", "2",
               "--storage", "host", "device", "disk"]
    else:
        cmd = [sys.executable, "bench/cost/switch.py", "--reps", "20"]
    res = r.run("switch", cmd, LIMITS["switch"])
    res["command"] = shlex.join(cmd[1:])
    if res["status"] in ("ok", "failed", "timeout"):
        res["rows"] = parse_switch_output((r.out / res["log"]).read_text())
        if res["status"] == "ok" and not res["rows"]:
            res["status"] = "failed"
            res["reason"] = "no table rows in bench/cost/switch.py's output"
    # bench/cost/switch.py times the copy alone; a training step with a promotion in flight on the side stream
    # against one without is not measured by it
    res["side_stream_overlap"] = "not measured by bench/cost/switch.py"
    return res


def stage_shape_13b(r: Runner, dry_run: bool) -> dict[str, Any]:
    js = r.logs / "shape_13b.json"
    cmd = [sys.executable, "bench/gpu/gpu_13b_shape.py", "--json", str(js)]
    # 4 of the 40 layers and 6 steps keep the three precisions inside the stage's limit on one GPU
    cmd += ["--dry-run"] if dry_run else ["--layers", "4", "--steps", "6", "--warmup", "2"]
    res = r.run("shape_13b", cmd, LIMITS["shape_13b"])
    res["command"] = shlex.join(cmd[1:])
    if js.is_file():
        res.update(json.loads(js.read_text()))
    elif res["status"] == "ok":
        res["status"] = "failed"
        res["reason"] = "no JSON written"
    return res


def stage_memory(r: Runner, dry_run: bool, tiny: Path | None) -> list[dict[str, Any]]:
    """bench/cost/train_memory.py per model: NF4, the plan (v_proj on BF16) and BF16, weights and peak."""
    from gnmr_hf.offline.gguf_models import is_installed

    models = [str(tiny)] if dry_run else ["smollm2-135m-instruct"] + (["gemma3-270m"] if is_installed("gemma3-270m") else [])
    rows = []
    for model in models:
        name = "tiny" if dry_run else model
        js = r.logs / f"memory_{name}.json"
        cmd = [sys.executable, "bench/cost/train_memory.py", "--model", model, "--keep", "v_proj", "--out", str(js)]
        cmd += ["--steps", "1", "--batch", "1", "--seq", "16"] if dry_run else ["--steps", "3", "--batch", "4", "--seq", "512"]
        res = r.run(f"memory_{name}", cmd, LIMITS["memory"])
        res.update(model=name, command=shlex.join(cmd[1:]))
        if js.is_file():
            res["rows"] = json.loads(js.read_text())["rows"]
        elif res["status"] == "ok":
            res.update(status="failed", reason="no JSON written")
        rows.append(res)
    return rows


def recipes_worker(spec_file: Path) -> int:
    """Run the recipes listed in ``spec_file`` one after the other in this process (imports paid once).

    A recipe that raises is recorded with its error and the next one still runs; the outcome of each is
    written to ``<spec_file>.result.json`` after every recipe, so a timeout keeps what finished.
    """
    import gc
    import traceback

    import torch

    spec = importlib.util.spec_from_file_location("finetune_recipe", ROOT / "recipes" / "finetune.py")
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    outcome: dict[str, Any] = {}
    result_file = spec_file.with_suffix(".result.json")
    for item in json.loads(spec_file.read_text()):
        print(f"=== recipe {item['precision']}: {shlex.join(item['argv'])}", flush=True)
        t0 = time.monotonic()
        try:
            ft.run(ft.load_config(item["argv"]))
            outcome[item["precision"]] = {"status": "ok"}
        except Exception as e:  # one failing recipe must not hide the others' figures
            traceback.print_exc()
            outcome[item["precision"]] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}
        outcome[item["precision"]]["seconds"] = round(time.monotonic() - t0, 2)
        result_file.write_text(json.dumps(outcome, indent=2) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0 if all(o["status"] == "ok" for o in outcome.values()) else 1


def stage_recipes(r: Runner, dry_run: bool, tiny: Path | None, steps: int) -> list[dict[str, Any]]:
    items = []
    for precision in recipe_precisions():
        argv = ["--config", str(RECIPE_DIR / f"{precision}.yaml"), "--max_steps", str(steps),
                "--output_dir", str(r.out / "recipes" / precision), "--logging_steps", "1",
                "--save_strategy", "no"]
        if dry_run:  # the tiny model and a handful of short problems: the machinery, not the figures
            argv += ["--model", str(tiny), "--num_generated", "16", "--max_seq_len", "64",
                     "--per_device_train_batch_size", "2"]
        items.append({"precision": precision, "argv": argv})
    spec_file = r.logs / "recipes.json"
    spec_file.write_text(json.dumps(items, indent=2) + "\n")
    stage = r.run("recipes", [sys.executable, str(Path(__file__).resolve()), "--recipes-worker", str(spec_file)],
                  LIMITS["recipe"] * len(items))
    result_file = spec_file.with_suffix(".result.json")
    outcome = json.loads(result_file.read_text()) if result_file.is_file() else {}
    rows = []
    for item in items:
        precision = item["precision"]
        res: dict[str, Any] = {"precision": precision, "command": "recipes/finetune.py " + shlex.join(item["argv"]),
                               "log": stage.get("log")}
        if precision in outcome:
            res.update(outcome[precision])
        else:  # never reached: the stage was skipped, or timed out before this recipe ended
            res.update(status="skipped" if stage["status"] == "skipped" else "timeout", seconds=0.0,
                       reason=stage.get("reason", f"the recipes stage ended ({stage['status']}) before it"))
        run_json = r.out / "recipes" / precision / "run.json"
        if res["status"] == "ok" and run_json.is_file():
            rec = json.loads(run_json.read_text())
            steps_done = rec.get("global_step") or 0
            runtime = rec.get("train_runtime_s")
            res.update(
                global_step=steps_done,
                mean_step_s=runtime / steps_done if runtime and steps_done else None,
                first_loss=rec.get("first_loss"),
                final_loss=rec.get("final_loss"),
                peak_memory_gib=rec["peak_memory_bytes"] / 2**30,
                peak_memory_kind=rec.get("peak_memory_kind"),
                device=rec.get("device"),
                promotion_ratio=((rec.get("gnmr_summary") or {}).get("summary") or {}).get("promotion_ratio"),
            )
        elif res["status"] == "ok":
            res.update(status="failed", reason="no run.json written")
        rows.append(res)
    return rows


def _f(x: Any, fmt: str) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def markdown(report: dict[str, Any]) -> str:
    """One Markdown table with a row per check, under a line naming the date, the device and the commit."""
    s = report["stages"]
    lines = [f"GPU check, {report['date']}, device: {report['device']}, commit {report['commit']}"
             + (" (dry run on the CPU: machinery only, not figures)" if report["dry_run"] else ""), "",
             "| check | status | s | result |", "| --- | --- | --- | --- |"]
    p = s["pytest_gpu"]
    counts = ", ".join(f"{p[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if k in p)
    lines.append(f"| pytest -m gpu | {p['status']} | {p['seconds']:.0f} | {counts or p.get('reason', '')} |")
    sw = s["switch"]
    if not sw.get("rows"):
        lines.append(f"| switch | {sw['status']} | {sw['seconds']:.0f} | {sw.get('reason', '')} |")
    for row in sw.get("rows", []):
        text = (f"promote {row['promote_ms_min']:.2f}/{row['promote_ms_median']:.2f} ms, ready "
                f"{row['ready_ms_min']:.2f}/{row['ready_ms_median']:.2f} ms, demote "
                f"{row['demote_ms_min']:.2f}/{row['demote_ms_median']:.2f} ms (min/median), layer "
                f"{row['layer_mib']:.2f} MiB, peak recovery {row['peak_recovery_mib']:.2f} MiB")
        lines.append(f"| switch, storage {row['storage']} | {sw['status']} | {sw['seconds']:.0f} | {text} |")
    sh = s["shape_13b"]
    if not sh.get("results"):
        lines.append(f"| 13B shape | {sh['status']} | {sh['seconds']:.0f} | {sh.get('reason', '')} |")
    for row in sh.get("results", []):
        text = (f"{sh['layers']} layers, batch {sh['batch_size']} x {sh['seq_len']}: median step "
                f"{_f(row['median_step_s'], '.3f')} s, peak {_f(row['peak_memory_gib'], '.2f')} GiB "
                f"({row['peak_memory_kind']}), final loss {_f(row['final_loss'], '.4f')}"
                + ("" if row.get("promotion_ratio") is None else f", promotion ratio {row['promotion_ratio']:.3f}"))
        lines.append(f"| 13B shape, {row['precision']} | {sh['status']} | {row['total_s']:.0f} | {text} |")
    for row in s["recipes"]:
        if "global_step" not in row:
            text = row.get("reason", "")
        else:
            text = (f"{row['global_step']} steps, mean step {_f(row['mean_step_s'], '.3f')} s, peak "
                    f"{_f(row['peak_memory_gib'], '.2f')} GiB ({row['peak_memory_kind']}), loss "
                    f"{_f(row['first_loss'], '.4f')} -> {_f(row['final_loss'], '.4f')}"
                    + ("" if row.get("promotion_ratio") is None
                       else f", promotion ratio {row['promotion_ratio']:.3f}"))
        lines.append(f"| SmolLM2 recipe {row['precision']} | {row['status']} | {row['seconds']:.0f} | {text} |")
    for res in s.get("memory", []):
        if not res.get("rows"):
            lines.append(f"| memory {res['model']} | {res['status']} | {res['seconds']:.0f} | {res.get('reason', '')} |")
        for row in res.get("rows", []):
            lines.append(f"| memory {res['model']}, {row['config']} | {res['status']} | {res['seconds']:.0f} | weights "
                         f"{row['weights_bytes'] / 2**20:.1f} MiB, training peak {row['peak_bytes'] / 2**20:.1f} MiB "
                         f"({row['peak_kind']}), step {row['step_s']:.2f} s |")
    lines += ["", f"Side-stream overlap (step time with a promotion in flight vs without): {sw['side_stream_overlap']}.",
              f"Total {report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget."]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="output folder: gpu_check.json, gpu_check.md, logs/")
    p.add_argument("--dry-run", action="store_true", help="every stage at its smallest size on the CPU")
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall time budget in seconds (default 570; dry run 1800, for a loaded CPU)")
    p.add_argument("--recipe-steps", type=int, default=None, help="steps per SmolLM2 recipe (20; dry run 2)")
    p.add_argument("--recipes-worker", default=None, help=argparse.SUPPRESS)  # the recipes stage's own process
    args = p.parse_args(argv)
    if args.recipes_worker:
        return recipes_worker(Path(args.recipes_worker))
    if not args.out:
        p.error("--out is required")
    if args.budget_s is None:
        args.budget_s = 1800.0 if args.dry_run else 570.0
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.recipe_steps is not None and args.recipe_steps < 1:
        p.error(f"--recipe-steps must be at least 1, got {args.recipe_steps}")
    steps = args.recipe_steps or (2 if args.dry_run else 20)

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        print("gpu_check: no CUDA device; use --dry-run to check the machinery on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # on a CPU every subprocess pays seconds of imports the GPU limits do not allow for
    r = Runner(out, args.budget_s, limit_scale=4.0 if args.dry_run else 1.0)

    tiny = None
    if args.dry_run:  # a 2-layer random LLaMA with a tokenizer, shared by the switch bench and the recipes
        spec = importlib.util.spec_from_file_location("gpu_13b_shape", ROOT / "bench" / "gpu" / "gpu_13b_shape.py")
        shape = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shape)
        tiny = shape.build_checkpoint(out / "tiny_model", 2, shape.SHAPE_TINY, "cpu")
    else:  # the SmolLM2 checkpoint is converted from its GGUF once per machine: not part of any stage's time
        import gnmr_hf

        t1 = time.monotonic()
        gnmr_hf.smollm2_checkpoint()
        from gnmr_hf.offline.gguf_models import is_installed

        if is_installed("gemma3-270m"):
            gnmr_hf.gemma3_checkpoint()
        print(f"offline checkpoints ready in {time.monotonic() - t1:.0f} s", flush=True)

    stages: dict[str, Any] = {}
    stages["pytest_gpu"] = stage_pytest(r, args.dry_run)
    stages["switch"] = stage_switch(r, args.dry_run, tiny)
    stages["shape_13b"] = stage_shape_13b(r, args.dry_run)
    stages["recipes"] = stage_recipes(r, args.dry_run, tiny, steps)
    stages["memory"] = stage_memory(r, args.dry_run, tiny)

    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "commit": _commit(),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "recipe_steps": steps,
        "total_s": round(time.monotonic() - t0, 1),
        "stages": stages,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    statuses = [stages[k]["status"] for k in ("pytest_gpu", "switch", "shape_13b")]
    statuses += [row["status"] for row in stages["recipes"]] + [row["status"] for row in stages["memory"]]
    return 0 if all(st == "ok" for st in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
