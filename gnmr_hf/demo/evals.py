"""The demo's lm-eval phase: the base model and each adapter scored with the bundled harness script
(:func:`gnmr_hf.evaluation.evaluate.evaluate`), one task at a time, each task kept in ``eval/<run>/<task>.json``
as soon as it finishes, so an interrupted evaluation resumes at the task it was in."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gnmr_hf import hardware
from gnmr_hf.demo.config import DemoError
from gnmr_hf.demo.report import PhaseTimer
from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.evaluation.tasks import parse_tasks
from gnmr_hf.reporting.report import summary_from_results


def eval_setup(tasks: str, limit: int | float | None, eval_dtype: str, batch_size: int,
               max_gen_toks: int) -> tuple[list[str], str, str]:
    """``--tasks`` as a task list (a bad one is a :class:`DemoError`), the dtype the evaluations compute in
    (``auto`` resolved) and how they are run, for the notes under the table."""
    try:
        task_list = parse_tasks(tasks)
    except EvalError as e:
        raise DemoError(f"--tasks: {e}") from None
    if eval_dtype == "auto":
        eval_dtype = hardware.auto_compute_dtype()[0]
    settings = (f"{', '.join(task_list)}; {'all' if limit is None else limit} documents per task "
                f"(per MMLU subject), zero-shot, on the BF16 base computing in {eval_dtype}, "
                f"batches of {batch_size}, GSM8K generation up to {max_gen_toks} tokens "
                "(stops at EOS or 'Question:')")
    return task_list, eval_dtype, settings


def drop_eval(out: Path, name: str) -> None:
    """Forget the evaluation of ``name`` (its adapter is being retrained, or --fresh)."""
    shutil.rmtree(out / "eval" / name, ignore_errors=True)
    (out / "eval" / f"{name}.json").unlink(missing_ok=True)


def eval_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The table's figures of one evaluation: GSM8K exact match (strict and flexible), MMLU and HellaSwag
    accuracy, WikiText-2 word perplexity, and the dtype it computed in."""
    strict = summary_from_results(results, "x", "strict-match")
    flexible = summary_from_results(results, "x", "flexible-extract")
    return {"gsm8k_em": strict["gsm8k_em"], "gsm8k_em_flexible": flexible["gsm8k_em"],
            "mmlu_acc": strict["mmlu_acc"], "hellaswag_acc": strict["hellaswag_acc"],
            "wikitext_word_ppl": strict["wikitext_word_ppl"],
            "eval_compute_dtype": (results.get("summary") or {}).get("compute_dtype")}


def evaluate_runs(out: Path, precisions: list[str], checkpoint: Path, data_dir: Path, task_list: list[str],
                  limit: int | float | None, eval_dtype: str, batch_size: int, max_gen_toks: int, fresh: bool,
                  timer: PhaseTimer) -> dict[str, dict[str, Any]]:
    """Evaluate the untuned base and each run's adapter (on the BF16 base), each one phase of ``timer``; a task
    scored before with these settings on the same adapter is read back. ``{name: figures}``."""
    # here, not at the top: the evaluation loads torch (`gnmr-hf demo --help` stays without it)
    from gnmr_hf.evaluation.evaluate import evaluate

    (out / "eval").mkdir(exist_ok=True)
    evals: dict[str, dict[str, Any]] = {}
    names = ["base", *precisions]
    for i, name in enumerate(names, 1):
        adapter = None if name == "base" else out / name
        parts = out / "eval" / name
        if fresh or (adapter is not None and parts.is_dir() and any(
                f.stat().st_mtime < (adapter / "run.json").stat().st_mtime for f in parts.glob("*.json"))):
            drop_eval(out, name)  # scored on an older adapter
        # a task scored before with these settings is read back (evaluate prints "read from ...")
        print(f"[demo] eval {name} ({i}/{len(names)}): {', '.join(task_list)}"
              + ("" if adapter is None else f" with the {name} adapter"), flush=True)
        timer.start()
        try:
            # zero-shot: the recipes train on the harness's GSM8K prompt without exemplars
            results = evaluate(str(checkpoint), task_list, adapter=adapter, precision="bf16",
                               data_dir=data_dir, limit=limit, num_fewshot=0, batch_size=batch_size,
                               max_gen_toks=max_gen_toks, method=name, output=out / "eval" / f"{name}.json",
                               compute_dtype=eval_dtype, resume_dir=parts)
        except EvalError as e:
            raise DemoError(f"evaluating {name}: {e}") from None
        kept = results["summary"].get("read_back") or []
        phase = timer.stop(f"eval {name}", note=f"read back: {', '.join(kept)}" if kept else "")
        print(f"[demo] eval {name}: {phase['wall_s']:.0f} s", flush=True)
        evals[name] = eval_figures(results)
    return evals
