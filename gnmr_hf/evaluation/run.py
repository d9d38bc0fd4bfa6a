"""The lm-evaluation-harness run: :func:`evaluate` loads the model once, scores the tasks one at a time (one
``simple_evaluate`` each, with its own progress bar), keeps each task's results in ``resume_dir`` as it finishes,
and returns the harness's results with the paper's Table 7 summary."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gnmr_hf._import_utils import quiet_lm_eval_git, require
from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.evaluation.forms import check_form, folder_format, held_after_scoring
from gnmr_hf.evaluation.loading import _compute_dtype, _read_adapter_config, load_scored, resolve_model
from gnmr_hf.evaluation.resume import (
    _SCORED_KEY,
    _stale_reason,
    _write_json,
    contents_fingerprint,
    merge_task_results,
    read_task_result,
    write_task_result,
)
from gnmr_hf.evaluation.skip_list import _check_skip_modules
from gnmr_hf.evaluation.tasks import TASKS, check_data_dir, parse_tasks, write_local_tasks
from gnmr_hf.reporting.report import GSM8K_FILTERS, format_row, summary_from_results


# ------------------------------------------------------------------------------------------ running
def default_method_name(model: str, precision: str, adapter: str | os.PathLike | None) -> str:
    """``"BF16 <model>"`` or ``"INT8 <model> + <adapter>"`` from the folder names; a pre-quantised folder's
    ``precision`` is its :func:`folder_format` (``"compressed-tensors W4A16+BF16 <model>"``), kept as it is."""
    label = precision if " " in precision or "-" in precision else precision.upper()
    name = f"{label} {Path(str(model).rstrip('/')).name}"
    return name if adapter is None else f"{name} + {Path(str(adapter).rstrip('/')).name}"


def evaluate(
    model: str,
    tasks: str | list[str] = TASKS,
    *,
    adapter: str | os.PathLike | None = None,
    precision: str | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    num_fewshot: int | None = None,
    device: str | None = None,
    method: str | None = None,
    gsm8k_filter: str = "strict-match",
    max_gen_toks: int | None = None,
    log_samples: bool = False,
    output: str | os.PathLike | None = None,
    compute_dtype: str = "bfloat16",
    resume_dir: str | os.PathLike | None = None,
    bootstrap_iters: int = 100000,
    skip_modules: list[str] | None = None,
    plan: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Score ``model`` (+ ``adapter``) on the bundled tasks with lm-evaluation-harness.

    Args:
        model: base checkpoint folder, hub id or offline alias (:func:`resolve_model`).
        tasks: any of ``gsm8k, mmlu, hellaswag, wikitext`` (list or comma-separated string).
        adapter: PEFT LoRA adapter folder applied on the base, or None.
        precision: ``"bf16"``, ``"int8"`` or ``"nf4"`` (bitsandbytes) for the base weights; None: ``bf16``
            (``nf4`` with ``plan``). A pre-quantised folder (an export) is loaded as its config says.
        data_dir: local data in the hub schemas (``DIR/<task>/<split>.jsonl``); None = hub datasets.
        limit: at most this many documents per task (per MMLU subject), as the harness's ``--limit``.
        batch_size: the harness's batch size (int or ``"auto"``). In BF16 a batch of several documents
            moves the scores (padding and batch shape change the rounding: SmolLM2's log-likelihoods by
            0.1-0.5 nats, some greedy GSM8K answers); in FP32 (``compute_dtype="float32"``) it does not.
        num_fewshot: override the harness's few-shot counts (GSM8K 5, the others 0); None keeps them.
        device: ``"cpu"`` or ``"cuda"``; None picks CUDA when available.
        method: the summary row's name; default from precision, model and adapter folder names.
        gsm8k_filter: harness filter for the summary's GSM8K EM (``"strict-match"``: the
            ``#### N`` line; ``"flexible-extract"``: the last number). Both are in the results.
        max_gen_toks: cap on generated tokens for GSM8K (the harness's default is 256); generation
            also stops at the task's ``until`` sequences (``Question:``, ``</s>``, ``<|im_end|>``) and EOS.
        log_samples: keep the harness's per-document samples under ``"samples"``.
        output: write the results JSON here (the harness's serialisation).
        compute_dtype: the dtype the model computes in (see :func:`load_model`); ``"auto"`` resolves
            through :func:`gnmr_hf.hardware.auto_compute_dtype`.
        resume_dir: a folder for one results file per task (``<task>.json``): a task whose file holds
            the same settings is read instead of scored again, and each task's file is written as soon
            as the task finishes, so an interrupted evaluation resumes at the task it was in. The settings
            include what the model folder, adapter folder, plan file and data folder hold
            (:func:`contents_fingerprint`), so one re-exported or re-trained in place is scored again.
        bootstrap_iters: the harness's bootstrap resamples for the stderr of non-mean metrics (the
            perplexities); 0 skips those stderrs (the metrics are the same).
        skip_modules: for ``int8`` / ``nf4``, the modules kept unquantised (see :func:`load_model`).
        plan: a plan file loaded through ``gnmr_hf.load_planned`` on ``model`` (see :func:`load_model`).

    Returns:
        the harness's results dict (the tasks' runs merged), plus ``"summary"``: the Table 7 numbers (see
        :func:`gnmr_hf.reporting.report.summary_from_results`), ``"row"`` (its Markdown row), the run's settings,
        ``"read_back"`` (the tasks read from ``resume_dir`` instead of scored) and ``"scored"`` (what was scored:
        the form, the linears per precision, the bytes held when scoring ended and at load, and on disk;
        :func:`describe_scored`, :func:`held_after_scoring`). ``"precision"`` is a pre-quantised folder's format
        (:func:`folder_format`, e.g. ``"compressed-tensors W4A16+W8A16+BF16"``), else the load precision.
    """
    require("lm_eval", "The lm-evaluation-harness evaluation")
    task_names = parse_tasks(tasks)
    model, precision, dtype_name = _checked(model, task_names, adapter, precision, data_dir, num_fewshot,
                                            gsm8k_filter, compute_dtype, skip_modules, plan)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = {
        "model": str(model), "adapter": None if adapter is None else str(Path(adapter).resolve()),
        "precision": precision, "compute_dtype": dtype_name,
        "data_dir": None if data_dir is None else str(Path(data_dir).resolve()), "limit": limit,
        "num_fewshot": num_fewshot, "max_gen_toks": max_gen_toks, "batch_size": batch_size,
        "log_samples": log_samples, "device": device, "skip_modules": skip_modules,
        "plan": None if plan is None else str(Path(plan).resolve()),
    }
    parts = {} if resume_dir is None else _read_back(task_names, resume_dir, settings, model, adapter, plan, data_dir)
    todo = [t for t in task_names if t not in parts]
    harness = {"num_fewshot": num_fewshot, "batch_size": batch_size, "limit": limit, "log_samples": log_samples,
               "max_gen_toks": max_gen_toks, "bootstrap_iters": bootstrap_iters}
    with tempfile.TemporaryDirectory(prefix="gnmr_hf_eval_") as work:
        # data first: a bad data folder should fail before the slow model load
        include = write_local_tasks(data_dir, todo, work, num_fewshot) if data_dir is not None and todo else None
        load = (model, precision, adapter, device, dtype_name, batch_size, include, skip_modules, plan)
        scored = _score_tasks(task_names, parts, load, harness, settings, resume_dir)
    # the record of the last task this call scored (what the model held when scoring ended), else a read-back one
    scored = scored or next((parts[t][_SCORED_KEY] for t in task_names if parts[t].get(_SCORED_KEY)), None)
    results = merge_task_results([{k: v for k, v in parts[t].items() if k != _SCORED_KEY} for t in task_names])
    precision = folder_format(model) or precision  # a pre-quantised folder: what it stores, not "bf16"
    method = method or default_method_name(model, precision, adapter)
    read_back = [t for t in task_names if t not in todo]  # from resume_dir, not scored by this call
    results["summary"] = _summary(results, method, gsm8k_filter, settings, adapter, precision, scored, task_names,
                                  read_back)
    if output is not None:
        _write_json(Path(output), results)
    return results


def _checked(model: str, task_names: list[str], adapter: str | os.PathLike | None, precision: str | None,
             data_dir: str | os.PathLike | None, num_fewshot: int | None, gsm8k_filter: str, compute_dtype: str,
             skip_modules: list[str] | None, plan: str | os.PathLike | None) -> tuple[str, str, str]:
    """:func:`evaluate`'s options checked before anything slow (one :class:`EvalError` line each): the model
    resolved, the precision it loads at and the compute dtype."""
    if gsm8k_filter not in GSM8K_FILTERS:
        raise EvalError(f"gsm8k_filter must be one of {', '.join(GSM8K_FILTERS)}, got {gsm8k_filter!r}")
    if adapter is not None:
        _read_adapter_config(adapter)
    dtype_name = _compute_dtype(compute_dtype)
    if data_dir is not None:  # a bad data folder fails before the model is resolved (an alias may convert a GGUF)
        check_data_dir(data_dir, task_names, num_fewshot)
    model = resolve_model(model)  # an offline alias -> its checkpoint folder (the settings record the folder)
    precision = check_form(model, precision, skip_modules, plan)
    _check_skip_modules(precision, skip_modules)
    if plan is not None and not Path(plan).exists():
        raise EvalError(f"--plan {plan}: no such file or folder (a profile.json from a recipe or gnmr-hf profile)")
    return model, precision, dtype_name


def _summary(results: dict[str, Any], method: str, gsm8k_filter: str, settings: dict[str, Any],
             adapter: str | os.PathLike | None, precision: str, scored: dict[str, Any] | None,
             task_names: list[str], read_back: list[str]) -> dict[str, Any]:
    """The Table 7 numbers (:func:`gnmr_hf.reporting.report.summary_from_results`), their Markdown row, the run's
    settings, what was scored and the tasks ``read_back`` from ``resume_dir`` (not scored by this call)."""
    summary = summary_from_results(results, method, gsm8k_filter)
    summary.update(
        row=format_row(summary), model=settings["model"], adapter=None if adapter is None else str(adapter),
        precision=precision, compute_dtype=settings["compute_dtype"], batch_size=settings["batch_size"],
        max_gen_toks=settings["max_gen_toks"], skip_modules=settings["skip_modules"], plan=settings["plan"],
        scored=scored, data_dir=settings["data_dir"], limit=settings["limit"], num_fewshot=settings["num_fewshot"],
        tasks=task_names, read_back=read_back,
    )
    return summary


def _read_back(task_names: list[str], resume_dir: str | os.PathLike, settings: dict[str, Any], model: str,
               adapter: str | os.PathLike | None, plan: str | os.PathLike | None,
               data_dir: str | os.PathLike | None) -> dict[str, dict[str, Any]]:
    """The tasks whose ``resume_dir`` file was written under ``settings`` (which gain ``contents``: what the
    folders hold, not only their names, so a folder re-exported or re-trained in place scores again)."""
    settings["contents"] = {"model": contents_fingerprint(model, "model"),
                            "adapter": contents_fingerprint(adapter, "adapter"),
                            "plan": contents_fingerprint(plan, "plan"),
                            "data_dir": contents_fingerprint(data_dir, "data")}
    parts: dict[str, dict[str, Any]] = {}
    for task in task_names:
        path = Path(resume_dir) / f"{task}.json"
        done = read_task_result(path, settings)
        if done is not None:
            parts[task] = done
        elif path.is_file():
            print(f"gnmr-hf eval: {task}: {path} was scored under other settings"
                  f"{_stale_reason(path, settings)}; scoring it again", file=sys.stderr, flush=True)
    return parts


def _score_tasks(task_names: list[str], parts: dict[str, dict[str, Any]], load: tuple[Any, ...],
                 harness: dict[str, Any], settings: dict[str, Any],
                 resume_dir: str | os.PathLike | None) -> dict[str, Any] | None:
    """Score each task not in ``parts`` into it, one ``simple_evaluate`` each, the model loaded (``load``:
    :func:`_harness_model`'s arguments) before the first; each task's file written to ``resume_dir`` as it
    finishes. Returns what the model held when the last task's scoring ended (None: nothing scored)."""
    lm = manager = scored = None
    for i, task in enumerate(task_names, 1):
        if task in parts:
            print(f"gnmr-hf eval: {task} ({i}/{len(task_names)}): read from {Path(resume_dir) / f'{task}.json'}",
                  file=sys.stderr, flush=True)
            continue
        if lm is None:
            lm, manager, scored = _harness_model(*load)
        print(f"gnmr-hf eval: {task} ({i}/{len(task_names)})", file=sys.stderr, flush=True)
        part = _run_task(lm, manager, task, **harness)
        # held when this task's scoring ended: transformers de-compresses a compressed-tensors folder on the
        # first forward, so what the model holds while it scores is not what it held at load
        scored = held_after_scoring(lm.model, scored)
        part[_SCORED_KEY] = scored
        parts[task] = part
        if resume_dir is not None:
            write_task_result(Path(resume_dir) / f"{task}.json", part, settings)
    return scored


def _run_task(lm: Any, manager: Any, task: str, num_fewshot: int | None, batch_size: int | str,
              limit: int | float | None, log_samples: bool, max_gen_toks: int | None,
              bootstrap_iters: int) -> dict[str, Any]:
    """One task scored by ``lm_eval.simple_evaluate``: its own progress bar (with total and ETA)."""
    from lm_eval import simple_evaluate

    quiet_lm_eval_git()  # lm_eval's "git describe" prints "fatal: not a git repository" outside one
    return simple_evaluate(
        model=lm,
        tasks=[task],
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        limit=limit,
        log_samples=log_samples,
        gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks is not None and task == "gsm8k" else None,
        task_manager=manager,
        bootstrap_iters=bootstrap_iters,
    )


def _harness_model(model: str, precision: str, adapter: str | os.PathLike | None, device: str, dtype_name: str,
                   batch_size: int | str, include: Path | None, skip_modules: list[str] | None = None,
                   plan: str | os.PathLike | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """The loaded model wrapped in the harness's ``HFLM``, the ``TaskManager`` for the tasks, what was loaded."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm_model, tokenizer, scored = load_scored(model, precision, adapter, device, dtype_name, skip_modules, plan)
    if include is not None:
        # our folder only: the local tasks keep the harness's names and indexing stays fast
        manager = TaskManager(include_path=str(include), include_defaults=False)
    else:
        manager = TaskManager()
    # softmax_dtype: with a BF16 model the harness would take log-softmax and sum log-likelihoods in
    # BF16 (8 mantissa bits: a 2-page WikiText sum of -4608 moves in steps of 32), which hides
    # perplexity differences of the size Table 7 reports; FP32 keeps them.
    lm = HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32)
    return lm, manager, scored

