"""``gnmr-hf eval``: score a base model plus an optional LoRA adapter with lm-evaluation-harness.

The paper's downstream evaluation (Table 7) is GSM8K (generation, exact match on the ``#### N``
answer), MMLU (multiple-choice log-likelihood accuracy), HellaSwag (continuation log-likelihood
accuracy) and WikiText-2 (perplexity). Everything here goes through the harness itself: the base is
loaded in BF16, bitsandbytes INT8 or NF4, the adapter applied with plain PEFT, the model wrapped in the
harness's ``HFLM`` and scored by ``lm_eval.simple_evaluate`` with the harness's own task definitions.

``data_dir`` points the tasks at local JSONL files in the hub datasets' own schemas. The task YAMLs
in ``gnmr_hf/evaluation/lm_eval_tasks/`` ``include`` the installed harness's YAMLs and override only the data
source (``dataset_path: json`` plus ``dataset_kwargs.data_files``, which the harness passes to
``datasets.load_dataset``); since those keys need absolute paths, each run fills them in and writes
the YAMLs into a temporary include folder that a ``TaskManager`` indexes on its own (without the
harness's ~thousands of default YAMLs, so the local tasks keep the harness's names).

MMLU is, in the harness, a group of 57 subject tasks (one hub config each, with a per-subject
description). Locally the group is rebuilt from the subjects present in ``DIR/mmlu/test.jsonl``:
one harness subject task per subject, reading that subject's rows, aggregated like the harness's
own group (accuracy weighted by subject size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from gnmr_hf._import_utils import require
from gnmr_hf.reporting.report import GSM8K_FILTERS, format_row, format_table, summary_from_results

TASKS = ("gsm8k", "mmlu", "hellaswag", "wikitext")
# files each task needs under DATA_DIR/<task>/, and the hub schema's fields every row must have
DATA_FILES: dict[str, tuple[str, ...]] = {
    "gsm8k": ("train", "test"),
    "mmlu": ("dev", "test"),
    "hellaswag": ("train", "validation"),
    "wikitext": ("train", "validation", "test"),
}
FIELDS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "mmlu": ("question", "subject", "choices", "answer"),
    "hellaswag": ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split",
                  "split_type", "label"),
    "wikitext": ("page",),
}
# the split each task draws few-shot examples from, and the harness's default shot count
FEWSHOT: dict[str, tuple[str, int]] = {"gsm8k": ("train", 5), "mmlu": ("dev", 0), "hellaswag": ("train", 0),
                                       "wikitext": ("train", 0)}
PRECISIONS = ("bf16", "int8", "nf4")
_TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


class EvalError(Exception):
    """A user mistake (bad task name, adapter, data folder); the CLI prints it and exits with 2."""


def parse_tasks(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"gsm8k,mmlu"`` or a list -> validated task names in the given order, without duplicates."""
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [t for t in names if t]
    if not names:
        raise EvalError(f"no task given; choose from {', '.join(TASKS)}")
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise EvalError(f"unknown task {unknown[0]!r}; the bundled tasks are {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------------------- data dir
def _read_rows(path: Path, task: str) -> list[dict[str, Any]]:
    fields = FIELDS[task]
    if not path.is_file():
        raise EvalError(
            f"{path} is missing: --data-dir needs {task}/{{{','.join(DATA_FILES[task])}}}.jsonl, "
            f"JSON lines with the fields {', '.join(fields)}"
        )
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(row, dict):
                raise EvalError(f"{path}:{lineno}: expected a JSON object with the fields {', '.join(fields)}")
            missing = [k for k in fields if k not in row]
            if missing:
                raise EvalError(
                    f"{path}:{lineno}: missing field(s) {', '.join(missing)}; "
                    f"each {task} row needs {', '.join(fields)}"
                )
            rows.append(row)
    if not rows:
        raise EvalError(f"{path} holds no rows (each {task} row needs {', '.join(fields)})")
    return rows


def _harness_tasks_dir() -> Path:
    # find_spec, not import: validating a data folder should not pay for importing the harness
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        require("lm_eval", "The lm-evaluation-harness evaluation")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


def _mmlu_subjects(harness: Path) -> set[str]:
    return {p.stem[len("mmlu_"):] for p in (harness / "mmlu" / "default").glob("mmlu_*.yaml")}


def check_data_dir(data_dir: str | os.PathLike, tasks: list[str],
                   num_fewshot: int | None = None) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Check that ``data_dir`` holds every file the tasks need, each row with the hub schema's fields.

    Args:
        data_dir: the folder given to ``--data-dir``.
        tasks: validated task names.
        num_fewshot: the run's few-shot override (None: the harness's defaults); the few-shot split
            must hold at least that many rows (per subject for MMLU).

    Returns:
        ``{task: {split: rows}}``.

    Raises:
        EvalError: naming the missing or malformed file and the fields expected.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise EvalError(f"--data-dir {root} is not a folder")
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task in tasks:
        out[task] = {split: _read_rows(root / task / f"{split}.jsonl", task) for split in DATA_FILES[task]}
        split, default_k = FEWSHOT[task]
        k = default_k if num_fewshot is None else num_fewshot
        n = len(out[task][split])
        if task != "mmlu" and n < k:  # the harness samples k distinct examples from this split
            raise EvalError(f"{root / task / f'{split}.jsonl'} has {n} rows, but {k}-shot {task} draws "
                            f"{k} examples from it")
    if "mmlu" in out:
        known = _mmlu_subjects(_harness_tasks_dir())
        for split, rows in out["mmlu"].items():
            for i, row in enumerate(rows, 1):
                choices, answer = row["choices"], row["answer"]
                # the harness's template prints exactly choices[0..3] as A-D and scores answer as an index
                if not (isinstance(choices, list) and len(choices) == 4):
                    raise EvalError(f"{root / 'mmlu' / f'{split}.jsonl'} row {i}: 'choices' must be a list of 4 strings")
                if not (isinstance(answer, int) and 0 <= answer < 4):
                    raise EvalError(f"{root / 'mmlu' / f'{split}.jsonl'} row {i}: 'answer' must be an index 0-3")
                if row["subject"] not in known:
                    raise EvalError(
                        f"{root / 'mmlu' / f'{split}.jsonl'} row {i}: unknown MMLU subject {row['subject']!r} "
                        f"(the harness has 57, e.g. {', '.join(sorted(known)[:3])})"
                    )
    return out


def _fill(template: Path, **values: str) -> str:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace("${" + key + "}", value)
    return text


def _quoted(path: Path) -> str:
    # the templates put paths inside YAML double quotes; a JSON string body is a valid one
    return json.dumps(str(path))[1:-1]


def write_local_tasks(data_dir: str | os.PathLike, tasks: list[str], workdir: str | os.PathLike,
                      num_fewshot: int | None = None) -> Path:
    """Write the per-run task YAMLs (harness YAML + local data source) for ``tasks`` into ``workdir``.

    Args:
        data_dir: folder laid out as ``DIR/<task>/<split>.jsonl`` (checked here first).
        tasks: validated task names.
        workdir: an empty folder; it becomes the ``TaskManager`` include path.
        num_fewshot: the run's few-shot override, for the size checks (see :func:`check_data_dir`).

    Returns:
        the include folder (``workdir/tasks``).
    """
    rows = check_data_dir(data_dir, tasks, num_fewshot)
    harness = _harness_tasks_dir()
    root = Path(data_dir).resolve()
    out = Path(workdir) / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task == "mmlu":
            continue
        (out / f"{task}.yaml").write_text(
            _fill(_TASKS_DIR / f"{task}.yaml", LM_EVAL_TASKS=_quoted(harness), DATA_DIR=_quoted(root))
        )
    if "mmlu" in tasks:
        by_subject: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: {"dev": [], "test": []})
        for split in ("dev", "test"):
            for row in rows["mmlu"][split]:
                by_subject[row["subject"]][split].append(row)
        subjects = sorted(s for s, r in by_subject.items() if r["test"])
        for subject in subjects:
            n_dev = len(by_subject[subject]["dev"])
            if n_dev < max(1, num_fewshot or 0):  # only subjects under test need dev rows
                raise EvalError(
                    f"{root / 'mmlu' / 'dev.jsonl'} has {n_dev} row(s) for subject {subject!r}, which the test "
                    f"split has; MMLU's few-shot examples come from the same subject's dev rows "
                    f"(need >= {max(1, num_fewshot or 0)})"
                )
            sub_dir = Path(workdir) / "data" / "mmlu" / subject
            sub_dir.mkdir(parents=True, exist_ok=True)
            for split in ("dev", "test"):
                with open(sub_dir / f"{split}.jsonl", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in by_subject[subject][split])
            (out / "mmlu").mkdir(exist_ok=True)
            (out / "mmlu" / f"mmlu_{subject}.yaml").write_text(
                _fill(_TASKS_DIR / "mmlu" / "mmlu_subject.yaml", LM_EVAL_TASKS=_quoted(harness),
                      SUBJECT=subject, SUBJECT_DIR=_quoted(sub_dir.resolve()))
            )
        (out / "mmlu" / "_mmlu.yaml").write_text(
            _fill(_TASKS_DIR / "mmlu" / "mmlu_group.yaml",
                  SUBJECT_TASKS=json.dumps([f"mmlu_{s}" for s in subjects]))
        )
    return out


# ------------------------------------------------------------------------------------ model/adapter
def _read_adapter_config(adapter: str | os.PathLike) -> dict[str, Any]:
    path = Path(adapter)
    if not path.is_dir():
        raise EvalError(f"--adapter {path} is not a folder")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise EvalError(f"--adapter {path} is not a PEFT adapter: it has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise EvalError(f"{cfg_file} is not valid JSON ({e})") from None
    if not any((path / n).is_file() for n in ("adapter_model.safetensors", "adapter_model.bin")):
        raise EvalError(f"--adapter {path} is not a PEFT adapter: it has no adapter_model.safetensors")
    return cfg


def _adapter_weights(adapter: Path) -> dict[str, Any]:
    import torch

    if (adapter / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(adapter / "adapter_model.safetensors"))
    return torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True)


def check_adapter_matches(model: Any, adapter: str | os.PathLike) -> None:
    """Raise :class:`EvalError` if the LoRA adapter cannot apply to ``model``.

    Checks, before PEFT touches the model, that the adapter's ``target_modules`` name modules of the
    base (PEFT's own matcher) and that every saved LoRA matrix fits its base layer
    (``lora_A``: [r, in_features], ``lora_B``: [out_features, r]).
    """
    from peft import PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    adapter = Path(adapter)
    config = PeftConfig.from_pretrained(str(adapter))
    modules = dict(model.named_modules())
    if getattr(config, "target_modules", None) is not None:
        if not any(check_target_module_exists(config, name) for name in modules):
            raise EvalError(
                f"--adapter {adapter} does not match the base model: its target modules "
                f"{sorted(config.target_modules) if not isinstance(config.target_modules, str) else config.target_modules!r}"
                " name no module of the base"
            )
    for key, tensor in _adapter_weights(adapter).items():
        for part, dim in ((".lora_A.", 1), (".lora_B.", 0)):
            if part not in key:
                continue
            name = key.split(part)[0]
            name = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
            layer = modules.get(name)
            if layer is None:
                raise EvalError(f"--adapter {adapter} does not match the base model: it has weights for "
                                f"{name}, which the base does not have")
            want = getattr(layer, "in_features" if dim == 1 else "out_features", None)
            if want is not None and tensor.shape[dim] != want:
                side = "in_features" if dim == 1 else "out_features"
                raise EvalError(
                    f"--adapter {adapter} does not match the base model: {key} has shape "
                    f"{list(tensor.shape)}, but the base's {name} has {side}={want}"
                )


def load_model(model: str, precision: str = "bf16", adapter: str | os.PathLike | None = None,
               device: str = "cpu") -> tuple[Any, Any]:
    """Load the base (BF16, bitsandbytes INT8 or NF4) and apply an optional LoRA adapter with plain PEFT.

    Args:
        model: a local checkpoint folder or a hub id.
        precision: ``"bf16"``, ``"int8"`` (``BitsAndBytesConfig(load_in_8bit=True)``, BF16 compute) or
            ``"nf4"`` (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, BF16 compute:
            the base a QLoRA adapter was trained on).
        adapter: a PEFT adapter folder (``adapter_config.json`` + weights), or None.
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    require("transformers", "Evaluating a model")
    if precision not in PRECISIONS:
        raise EvalError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if adapter is not None:
        require("peft", "Loading a LoRA adapter")
        _read_adapter_config(adapter)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError("--device cuda was asked for, but torch sees no CUDA device")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load a tokenizer from --model {model}: {e}") from None
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if precision in ("int8", "nf4"):
        require("bitsandbytes", f"Loading the base model in {precision.upper()}")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_8bit=True) if precision == "int8" else
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
        kwargs["device_map"] = {"": device if device != "cuda" else torch.cuda.current_device()}
    try:
        base = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except OSError as e:
        raise EvalError(f"cannot load --model {model}: {e}") from None
    if precision == "bf16":
        base = base.to(device)
    if adapter is not None:
        from peft import PeftModel

        check_adapter_matches(base, adapter)
        base = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
    base.eval()
    return base, tokenizer


# ------------------------------------------------------------------------------------------ running
def default_method_name(model: str, precision: str, adapter: str | os.PathLike | None) -> str:
    """``"BF16 <model>"`` or ``"INT8 <model> + <adapter>"`` from the folder names."""
    name = f"{precision.upper()} {Path(str(model).rstrip('/')).name}"
    return name if adapter is None else f"{name} + {Path(str(adapter).rstrip('/')).name}"


def evaluate(
    model: str,
    tasks: str | list[str] = TASKS,
    *,
    adapter: str | os.PathLike | None = None,
    precision: str = "bf16",
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
) -> dict[str, Any]:
    """Score ``model`` (+ ``adapter``) on the bundled tasks with lm-evaluation-harness.

    Args:
        model: base checkpoint folder or hub id.
        tasks: any of ``gsm8k, mmlu, hellaswag, wikitext`` (list or comma-separated string).
        adapter: PEFT LoRA adapter folder applied on the base, or None.
        precision: ``"bf16"``, ``"int8"`` or ``"nf4"`` (bitsandbytes) for the base weights.
        data_dir: local data in the hub schemas (``DIR/<task>/<split>.jsonl``); None = hub datasets.
        limit: at most this many documents per task (per MMLU subject), as the harness's ``--limit``.
        batch_size: the harness's batch size (int or ``"auto"``).
        num_fewshot: override the harness's few-shot counts (GSM8K 5, the others 0); None keeps them.
        device: ``"cpu"`` or ``"cuda"``; None picks CUDA when available.
        method: the summary row's name; default from precision, model and adapter folder names.
        gsm8k_filter: harness filter for the summary's GSM8K EM (``"strict-match"``: the
            ``#### N`` line; ``"flexible-extract"``: the last number). Both are in the results.
        max_gen_toks: cap on generated tokens for GSM8K (the harness's default is 256).
        log_samples: keep the harness's per-document samples under ``"samples"``.
        output: write the results JSON here (the harness's serialisation).

    Returns:
        the harness's results dict, plus ``"summary"``: the Table 7 numbers (see
        :func:`gnmr_hf.reporting.report.summary_from_results`), ``"row"`` (its Markdown row) and the run's settings.
    """
    require("lm_eval", "The lm-evaluation-harness evaluation")
    task_names = parse_tasks(tasks)
    if gsm8k_filter not in GSM8K_FILTERS:
        raise EvalError(f"gsm8k_filter must be one of {', '.join(GSM8K_FILTERS)}, got {gsm8k_filter!r}")
    if adapter is not None:
        _read_adapter_config(adapter)
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen_kwargs = {"max_gen_toks": max_gen_toks} if max_gen_toks is not None else None
    with tempfile.TemporaryDirectory(prefix="gnmr_hf_eval_") as work:
        # data first: a bad data folder should fail before the slow model load
        include = write_local_tasks(data_dir, task_names, work, num_fewshot) if data_dir is not None else None
        lm_model, tokenizer = load_model(model, precision, adapter, device)

        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        if include is not None:
            # our folder only: the local tasks keep the harness's names and indexing stays fast
            manager = TaskManager(include_path=str(include), include_defaults=False)
        else:
            manager = TaskManager()
        # softmax_dtype: with a BF16 model the harness would take log-softmax and sum log-likelihoods in
        # BF16 (8 mantissa bits: a 2-page WikiText sum of -4608 moves in steps of 32), which hides
        # perplexity differences of the size Table 7 reports; FP32 keeps them.
        lm = HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32)
        results = simple_evaluate(
            model=lm,
            tasks=task_names,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            limit=limit,
            log_samples=log_samples,
            gen_kwargs=gen_kwargs,
            task_manager=manager,
        )
    method = method or default_method_name(model, precision, adapter)
    summary = summary_from_results(results, method, gsm8k_filter)
    summary.update(
        row=format_row(summary), model=str(model), adapter=None if adapter is None else str(adapter),
        precision=precision, data_dir=None if data_dir is None else str(Path(data_dir).resolve()),
        limit=limit, num_fewshot=num_fewshot, tasks=task_names,
    )
    results["summary"] = summary
    if output is not None:
        from lm_eval.utils import handle_non_serializable

        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return results


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(value) if value >= 1 and value.is_integer() else value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gnmr-hf eval",
        description="Score a base model (+ LoRA adapter) on GSM8K, MMLU, HellaSwag and WikiText-2 with "
                    "lm-evaluation-harness, and print the paper's Table 7 row.",
    )
    p.add_argument("--model", required=True, help="base checkpoint folder or hub id")
    p.add_argument("--adapter", help="PEFT LoRA adapter folder to apply on the base")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS, help="base weights: bf16, bitsandbytes int8 or nf4")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--data-dir", help="local data in the hub schemas, DIR/<task>/<split>.jsonl (default: hub datasets)")
    p.add_argument("--limit", type=_limit, help="documents per task (per MMLU subject); <1 = a fraction")
    p.add_argument("--batch-size", default="1", help="batch size (an int or 'auto')")
    p.add_argument("--num-fewshot", type=int, help="override the harness's few-shot counts")
    p.add_argument("--max-gen-toks", type=_positive_int, help="cap GSM8K generation (harness default 256)")
    p.add_argument("--gsm8k-filter", default="strict-match", choices=GSM8K_FILTERS,
                   help="filter for the summary's GSM8K EM (both are in the results)")
    p.add_argument("--name", help="method name for the summary row")
    p.add_argument("--output", help="write the results JSON here")
    p.add_argument("--log-samples", action="store_true", help="keep per-document samples in the results JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    return p


def main(argv: list[str] | None = None) -> int:
    """``gnmr-hf eval --model PATH [--adapter DIR] [--precision bf16|int8|nf4] --tasks ...``; 2 on user errors."""
    args = build_parser().parse_args(argv)
    batch_size: int | str = args.batch_size
    if str(batch_size).isdigit():
        batch_size = int(batch_size)
    elif not str(batch_size).startswith("auto"):
        print(f"gnmr-hf eval: error: --batch-size must be an integer or 'auto', got {batch_size!r}", file=sys.stderr)
        return 2
    try:
        results = evaluate(
            args.model, args.tasks, adapter=args.adapter, precision=args.precision, data_dir=args.data_dir,
            limit=args.limit, batch_size=batch_size, num_fewshot=args.num_fewshot, device=args.device,
            method=args.name, gsm8k_filter=args.gsm8k_filter, max_gen_toks=args.max_gen_toks,
            log_samples=args.log_samples, output=args.output,
        )
    except EvalError as e:
        print(f"gnmr-hf eval: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(format_table([results["summary"]]))
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    bad = [k for k in ("gsm8k_em", "mmlu_acc", "hellaswag_acc", "wikitext_word_ppl")
           if results["summary"][k] is not None and not math.isfinite(results["summary"][k])]
    if bad:
        print(f"gnmr-hf eval: warning: non-finite {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
