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

Every form a user ends with is scored the same way (:func:`load_model`; the summary's ``scored`` says which
form, the decoder linears per precision and the bytes):

- a BF16 checkpoint, quantised at load (``--precision int8|nf4``, ``--skip-modules``) or not;
- an exported bitsandbytes folder (``gnmr-hf export``: its ``quantization_config`` says it all) and a
  compressed-tensors folder (``gnmr-hf export --format compressed-tensors``), loaded as stock
  ``from_pretrained(folder)`` loads them;
- a ladder plan on its training base (``--plan profile.json``): the BF16 checkpoint through
  :func:`gnmr_hf.planning.ladder.load_planned` (the low linears NF4, or INT8 with ``--precision int8``);
- the merged BF16 model (``gnmr-hf export --merge``), a plain BF16 folder.

The tasks run one at a time (one ``simple_evaluate`` each, on the one loaded model), so each shows its
own progress bar with an ETA; with ``resume_dir`` (``--resume-dir``) each task's results are written
there as soon as it finishes and a rerun with the same settings reads them instead of scoring the task
again, so an interrupted evaluation resumes at the task it was in. The settings hold what the model, adapter,
plan and data paths hold (:func:`contents_fingerprint`), not only their names: a folder re-exported in place is
scored again.

A compressed-tensors folder is scored de-compressed: transformers unpacks its quantised weights to BF16 on the
first forward. The summary's ``precision`` names the folder's format (:func:`folder_format`), and ``scored``
records the bytes held when scoring ended (:func:`held_after_scoring`), saying so.
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

from gnmr_hf._import_utils import quiet_lm_eval_git, require
from gnmr_hf.reporting.report import (
    GSM8K_FILTERS,
    OneLineErrorParser,
    format_row,
    format_table,
    summary_from_results,
)
from gnmr_hf.strict_json import read_json

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
# the dtype the model computes in (the weights are upcast to it); auto: gnmr_hf.hardware.auto_compute_dtype
COMPUTE_DTYPES = ("bfloat16", "float32", "float16", "auto")
# the per-task entries of a harness results dict: merged across the one-task runs
_PER_TASK_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
                  "n-samples", "samples", "task_hashes")
_SETTINGS_KEY = "gnmr_hf_task_settings"
_SCORED_KEY = "gnmr_hf_scored"  # what a task was scored on (describe_scored), kept in its resume file
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


def check_adapter_matches(model: Any, adapter: str | os.PathLike, base: str = "the base model") -> None:
    """Raise :class:`EvalError` if the LoRA adapter cannot apply to ``model``.

    Checks, before PEFT touches the model, that the adapter's ``target_modules`` name modules of the
    base (PEFT's own matcher) and that every saved LoRA matrix fits its base layer
    (``lora_A``: [r, in_features], ``lora_B``: [out_features, r]). ``model`` may be on the meta device (the
    exports check with it: :func:`gnmr_hf.export_folder.check_sources`); ``base`` names it in the message.
    """
    from peft import PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    adapter = Path(adapter)
    config = PeftConfig.from_pretrained(str(adapter))
    modules = dict(model.named_modules())
    if getattr(config, "target_modules", None) is not None:
        if not any(check_target_module_exists(config, name) for name in modules):
            raise EvalError(
                f"--adapter {adapter} does not match {base}: its target modules "
                f"{sorted(config.target_modules) if not isinstance(config.target_modules, str) else config.target_modules!r}"
                f" name no module of {base}"
            )
    for key, tensor in _adapter_weights(adapter).items():
        for part, dim in ((".lora_A.", 1), (".lora_B.", 0)):
            if part not in key:
                continue
            name = key.split(part)[0]
            name = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
            layer = modules.get(name)
            if layer is None:
                raise EvalError(f"--adapter {adapter} does not match {base}: it has weights for "
                                f"{name}, which {base} does not have")
            want = getattr(layer, "in_features" if dim == 1 else "out_features", None)
            if want is not None and tensor.shape[dim] != want:
                side = "in_features" if dim == 1 else "out_features"
                raise EvalError(
                    f"--adapter {adapter} does not match {base}: {key} has shape "
                    f"{list(tensor.shape)}, but {name} of {base} has {side}={want}"
                )


def read_skip_modules(spec: str | os.PathLike | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """``--skip-modules``: a comma-separated list, a ``profile.json`` (``gnmr-hf profile``'s
    ``skip_modules``), or the folder holding it (``DIR`` means ``DIR/profile.json``).

    Returns the list, or None for ``None`` / an empty string. A profile whose list is empty is refused:
    it keeps nothing unquantised, not even ``lm_head``.
    """
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        return [str(m) for m in spec]
    text = str(spec).strip()
    if not text:
        return None
    if Path(text).is_dir():
        if not (Path(text) / "profile.json").is_file():
            raise EvalError(f"--skip-modules {text}: a folder without profile.json (give gnmr-hf profile's "
                            "--output folder, its profile.json, or a comma-separated list of module names)")
        text = str(Path(text) / "profile.json")
    if text.endswith(".json") or Path(text).is_file():
        path = Path(text)
        if not path.is_file():
            raise EvalError(f"--skip-modules {text}: no such file (a profile.json from gnmr-hf profile, or a "
                            "comma-separated list of module names)")
        try:
            data = read_json(path)  # gnmr_hf.strict_json: a key named twice is refused
        except ValueError as e:
            raise EvalError(f"--skip-modules {text}: not JSON ({e})") from None
        from gnmr_hf.backends.recovery import int8_rungs

        int8 = int8_rungs(data)
        if int8:
            raise EvalError(f"--skip-modules {text}: a precision-ladder plan with {len(int8)} INT8 linears (e.g. "
                            f"{int8[0]}), not a skip list: score it with --plan {text} (gnmr_hf.load_planned loads "
                            "it as trained)")
        modules = data.get("skip_modules") if isinstance(data, dict) else None
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise EvalError(f"--skip-modules {text}: no 'skip_modules' list of names in it (write one with "
                            "gnmr-hf profile --output DIR)")
        if not modules:
            raise EvalError(f"--skip-modules {text}: its 'skip_modules' list is empty, which keeps nothing "
                            "unquantised, not even lm_head (leave --skip-modules out for the stock list)")
        return modules
    return [m.strip() for m in text.split(",") if m.strip()]


def _kept_linears(model, skip_modules: list[str]) -> tuple[list[str], list[str]]:
    """``(kept, unmatched)``: the loaded model's linears each entry keeps unquantised, by transformers'
    own matching rule, and the entries that keep none."""
    import torch
    from transformers.quantizers.quantizers_utils import should_convert_module

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept, unmatched = set(), []
    for entry in skip_modules:
        hits = [n for n in linears if not should_convert_module(n, [entry])]
        kept.update(hits)
        if not hits:
            unmatched.append(entry)
    return sorted(kept), unmatched


def _check_skip_modules(precision: str, skip_modules: list[str] | None) -> None:
    if skip_modules is not None and precision == "bf16":
        raise EvalError("--skip-modules names modules to keep unquantised; it needs --precision int8 or nf4")


#: the quantisation methods of a pre-quantised folder the evaluation loads as stock from_pretrained does
PREQUANTISED = ("bitsandbytes", "compressed-tensors")


def folder_quantisation(model: str | os.PathLike) -> str | None:
    """The ``quant_method`` of a local folder's ``config.json`` ``quantization_config`` (an exported bitsandbytes
    or compressed-tensors folder), None for a BF16 checkpoint, a hub id or an unreadable config."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    return str(q.get("quant_method") or "unknown") if isinstance(q, dict) and q else None


def _dtype_label(config: dict[str, Any]) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return {"bfloat16": "BF16", "float32": "FP32", "float16": "FP16"}.get(name, name.upper())


def folder_format(model: str | os.PathLike) -> str | None:
    """What a pre-quantised folder stores, from its ``config.json`` ``quantization_config``: the quantisation
    method and the linears' formats, e.g. ``"compressed-tensors W4A16+W8A16+BF16"`` (one ``W<bits>A<bits>`` per
    scheme of ``config_groups``, ascending; then the dtype of the ``ignore`` list's linears) or
    ``"bitsandbytes NF4+BF16"``; None for a folder without one (a BF16 checkpoint), a hub id or an unreadable
    config. The summary's ``precision`` of such a folder (the folder is loaded as stock ``from_pretrained`` loads
    it, nothing quantised at load)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict) or not q:
        return None
    method = str(q.get("quant_method") or "unknown")
    kept = _dtype_label(config)
    kinds: list[tuple[int, int, str]] = []
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict) or weights.get("num_bits") is None:
                continue
            acts = group.get("input_activations")
            a_bits = acts.get("num_bits", 16) if isinstance(acts, dict) else 16
            kinds.append((int(weights["num_bits"]), int(a_bits), f"W{weights['num_bits']}A{a_bits}"))
        labels = [k for *_, k in sorted(set(kinds))]
        if q.get("ignore"):
            labels.append(kept)
    elif method == "bitsandbytes":
        labels = [str(q.get("bnb_4bit_quant_type") or "fp4").upper() if q.get("load_in_4bit") else
                  "INT8" if q.get("load_in_8bit") else "unknown"]
        # transformers keeps the output head unquantised when the skip list is left out
        if q.get("llm_int8_skip_modules") is None or q.get("llm_int8_skip_modules"):
            labels.append(kept)
    else:
        labels = []
    return " ".join([method, "+".join(labels)]) if labels else method


def check_form(model: str, precision: str | None, skip_modules: list[str] | None, plan) -> str:
    """The precision to load ``model`` at, the options checked against the form (one-line :class:`EvalError`):
    a pre-quantised folder takes no ``--precision int8|nf4``, ``--skip-modules`` or ``--plan`` (its config says
    how it is quantised); ``--plan`` loads the low linears at ``precision`` (``nf4`` unless ``int8``), without
    ``--skip-modules``. ``precision`` None: ``bf16`` (``nf4`` with a plan)."""
    method = folder_quantisation(model)
    if method is not None:
        if method not in PREQUANTISED:
            raise EvalError(f"--model {model} is quantised with {method!r}; the evaluation loads bitsandbytes and "
                            "compressed-tensors folders")
        given = ("--plan" if plan is not None else "--skip-modules" if skip_modules is not None else
                 f"--precision {precision}" if precision not in (None, "bf16") else None)
        if given:
            raise EvalError(f"--model {model} is a pre-quantised {method} folder (its config.json's quantization_config "
                            f"says how each linear is stored): leave {given} out, or give the BF16 checkpoint it was "
                            "exported from")
        return "bf16"
    if plan is not None:
        if precision == "bf16":
            raise EvalError("--plan keeps the planned linears on their rungs and loads the others low: --precision nf4 "
                            "(the default with --plan) or int8, not bf16")
        if skip_modules is not None:
            raise EvalError("--plan and --skip-modules both say which linears stay unquantised: give one (a ladder "
                            "plan: --plan)")
        return precision or "nf4"
    return precision or "bf16"


def linear_precision(module) -> str:
    """How one loaded linear stores its weight: ``NF4`` / ``FP4`` (bitsandbytes 4-bit), ``INT8`` (LLM.int8),
    ``W4A16`` / ``W8A16`` (a compressed-tensors scheme), else its weight's dtype (``BF16``, ``FP32``, ...)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    if bnb is not None and isinstance(module, bnb.nn.Linear4bit):
        return str(getattr(module.weight, "quant_type", "4bit")).upper()
    if bnb is not None and isinstance(module, bnb.nn.Linear8bitLt):
        return "INT8"
    scheme = getattr(module, "quantization_scheme", None)
    weights = getattr(scheme, "weights", None) if scheme is not None else None
    if weights is not None:
        return f"W{weights.num_bits}A16" if scheme.input_activations is None else f"W{weights.num_bits}A{scheme.input_activations.num_bits}"
    import torch

    names = {torch.bfloat16: "BF16", torch.float32: "FP32", torch.float16: "FP16"}
    return names.get(module.weight.dtype, str(module.weight.dtype).removeprefix("torch."))


def describe_scored(model, form: str, checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """What a loaded model scores with: ``form``, its linears per precision (every linear but the output head,
    which is given apart; a PEFT adapter's own LoRA matrices are not counted), the bytes it holds now, as loaded
    (:func:`gnmr_hf.memory.model_bytes`: parameters, buffers, quantisation states; ``held_when`` ``"loaded"``:
    :func:`held_after_scoring` re-counts them once it has scored) and the bytes of the checkpoint files it was
    read from (``checkpoint``'s ``*.safetensors``; None for a hub id)."""
    import torch

    from gnmr_hf.memory import model_bytes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    counts: dict[str, int] = {}
    head_precision = None
    for name, module in base.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in name:
            continue
        kind = linear_precision(module)
        if module is head:
            head_precision = kind
            continue
        counts[kind] = counts.get(kind, 0) + 1
    files = sorted(Path(checkpoint).glob("*.safetensors")) if checkpoint is not None and Path(checkpoint).is_dir() else []
    held = model_bytes(model)["total"]
    return {"form": form, "linears": dict(sorted(counts.items())), "lm_head": head_precision,
            "weights_held_bytes": held, "weights_held_at_load_bytes": held, "held_when": "loaded",
            "held_decompressed": None,
            "checkpoint_bytes": sum(f.stat().st_size for f in files) if files else None,
            "checkpoint": None if checkpoint is None else str(checkpoint)}


#: what ``scored["held_decompressed"]`` says of a compressed-tensors folder once transformers has scored it
CT_DECOMPRESSED = ("transformers scores a compressed-tensors folder de-compressed: on the first forward it unpacks "
                   "the quantised linears' weights to {dtype} (their scales kept), so the model scored holds them "
                   "at {dtype} size; the scores are the quantised weights', the memory is not the quantised model's")


def _decompressed_linears(model) -> tuple[int, str]:
    """How many of ``model``'s compressed-tensors linears hold their weights de-compressed (``quantization_status``
    ``decompressed``: transformers de-compresses them on the first forward), and the dtype they hold them in."""
    names = {"torch.bfloat16": "BF16", "torch.float32": "FP32", "torch.float16": "FP16"}
    n, dtype = 0, "BF16"
    for module in model.modules():
        status = getattr(module, "quantization_status", None)
        if status is None or str(getattr(status, "value", status)).lower() != "decompressed":
            continue
        n += 1
        weight = getattr(module, "weight", None)
        if weight is not None and hasattr(weight, "dtype"):
            dtype = names.get(str(weight.dtype), str(weight.dtype).removeprefix("torch."))
    return n, dtype


def held_after_scoring(model, scored: dict[str, Any]) -> dict[str, Any]:
    """``scored`` (:func:`describe_scored`) with ``weights_held_bytes`` re-counted on ``model`` as it is now, after
    scoring (``held_when`` ``"after scoring"``; the count at load stays in ``weights_held_at_load_bytes``), and
    ``held_decompressed`` saying so when the model holds de-compressed compressed-tensors linears
    (:data:`CT_DECOMPRESSED`)."""
    from gnmr_hf.memory import model_bytes

    out = dict(scored)
    out.setdefault("weights_held_at_load_bytes", scored.get("weights_held_bytes"))
    out["weights_held_bytes"] = model_bytes(model)["total"]  # INT8 row scales moved by a forward included
    out["held_when"] = "after scoring"
    n, dtype = _decompressed_linears(model)
    if n:
        out["held_decompressed"] = f"{n} linears de-compressed; " + CT_DECOMPRESSED.format(dtype=dtype)
    return out


def format_scored(scored: dict[str, Any]) -> str:
    """The summary's one line on what was scored."""
    mib = 2**20
    linears = ", ".join(f"{n} {k}" for k, n in scored["linears"].items())
    disk = ("" if scored.get("checkpoint_bytes") is None else
            f"; checkpoint read {scored['checkpoint_bytes'] / mib:.1f} MiB on disk")
    when = " after scoring" if scored.get("held_when") == "after scoring" else ""
    at_load = scored.get("weights_held_at_load_bytes")
    if at_load is not None and at_load != scored["weights_held_bytes"]:
        when += f" ({at_load / mib:.1f} MiB at load)"
    note = f"; {scored['held_decompressed']}" if scored.get("held_decompressed") else ""
    return (f"scored: {scored['form']}: {sum(scored['linears'].values())} linears ({linears}), lm_head "
            f"{scored['lm_head']}; weights held {scored['weights_held_bytes'] / mib:.1f} MiB{when}{disk}{note}")


def resolve_model(model: str | os.PathLike) -> str:
    """``--model`` through the one resolver (:func:`gnmr_hf.offline.gguf_models.resolve_model`): an offline
    alias becomes its checkpoint folder, a folder or hub id stays; anything else is an :class:`EvalError`."""
    from gnmr_hf.offline.gguf_models import resolve_model as resolve

    try:
        return resolve(model)
    except FileNotFoundError as e:
        raise EvalError(str(e)) from None


def load_model(model: str, precision: str | None = None, adapter: str | os.PathLike | None = None,
               device: str = "cpu", compute_dtype: str = "bfloat16",
               skip_modules: list[str] | None = None, plan: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """Load the base (BF16, bitsandbytes INT8 or NF4, a pre-quantised folder, or a ladder plan) and apply an
    optional LoRA adapter with plain PEFT.

    Args:
        model: a local checkpoint folder, a hub id or an offline alias (:func:`resolve_model`). A folder whose
            ``config.json`` has a ``quantization_config`` (``gnmr-hf export``'s bitsandbytes or compressed-tensors
            folders) is loaded as stock ``from_pretrained`` loads it, on ``device``; ``precision`` must be
            ``"bf16"`` then (nothing is quantised at load).
        precision: ``"bf16"`` (None: the default; ``"nf4"`` with ``plan``), ``"int8"``
            (``BitsAndBytesConfig(load_in_8bit=True)``, BF16 compute) or
            ``"nf4"`` (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, BF16 compute:
            the base a QLoRA adapter was trained on). Its layers compute with bitsandbytes' reference
            de-quantise + matmul on every device (:func:`gnmr_hf.backends.bnb_4bit.keep_reference_layout`),
            as the recipes train. With ``plan``: the low path of the linears the plan leaves low.
        adapter: a PEFT adapter folder (``adapter_config.json`` + weights), or None.
        device: ``"cpu"`` or ``"cuda"``.
        compute_dtype: the dtype the model computes in: ``"bfloat16"`` (default), ``"float32"`` (the
            BF16 weights upcast exactly; the INT8/NF4 layers' inputs and the 4-bit compute dtype too),
            ``"float16"``, or ``"auto"`` (:func:`gnmr_hf.hardware.auto_compute_dtype`).
        skip_modules: for ``int8`` / ``nf4``, bitsandbytes' ``llm_int8_skip_modules``: the modules kept
            unquantised (their checkpoint weights in ``compute_dtype``), e.g. a plan's
            :func:`gnmr_hf.skip_modules` list: the mixed base a planned adapter trained on. The list
            replaces transformers' default one (which keeps ``lm_head``), as in ``BitsAndBytesConfig``.
        plan: a plan file (a ladder's ``rungs`` or a BF16-only plan's ``profile.json``, or its folder) loaded
            on ``model`` (its BF16 checkpoint) through :func:`gnmr_hf.planning.ladder.load_planned`: each planned
            linear on its rung (INT8 ``Linear8bitLt``, BF16), the others ``precision`` (``nf4`` or ``int8``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode (:func:`load_scored` also says what was loaded).
    """
    model, tokenizer, _ = load_scored(model, precision, adapter, device, compute_dtype, skip_modules, plan)
    return model, tokenizer


def load_scored(model: str, precision: str | None = None, adapter: str | os.PathLike | None = None,
                device: str = "cpu", compute_dtype: str = "bfloat16", skip_modules: list[str] | None = None,
                plan: str | os.PathLike | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """:func:`load_model`, and what it loaded (:func:`describe_scored`)."""
    require("transformers", "Evaluating a model")
    if precision is not None and precision not in PRECISIONS:
        raise EvalError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype_name = _compute_dtype(compute_dtype)
    if adapter is not None:
        require("peft", "Loading a LoRA adapter")
        _read_adapter_config(adapter)
    model = resolve_model(model)
    method = folder_quantisation(model)
    precision = check_form(model, precision, skip_modules, plan)
    _check_skip_modules(precision, skip_modules)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError("--device cuda was asked for, but torch sees no CUDA device")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load a tokenizer from --model {model}: {e}") from None
    device_map = {"": device if device != "cuda" else torch.cuda.current_device()}
    local = Path(model).is_dir()
    if plan is not None:
        from gnmr_hf.planning.ladder import load_planned

        require("bitsandbytes", "Loading a plan's low linears")
        try:
            base = load_planned(model, plan, low=precision, dtype=dtype, compute_dtype=dtype, device_map=device_map)
        except (ValueError, OSError) as e:
            raise EvalError(f"--plan {plan}: {e}") from None
        low = {"nf4": "NF4", "int8": "INT8"}[precision]
        form = f"a plan on its training base ({Path(plan).name}, gnmr_hf.load_planned; the other linears {low})"
        scored = _finish(base, tokenizer, adapter, form, model if local else None)
        return scored
    kwargs: dict[str, Any] = {"dtype": dtype}
    if method is not None:
        require("bitsandbytes" if method == "bitsandbytes" else "compressed_tensors",
                f"Loading a pre-quantised {method} folder")
        kwargs["device_map"] = device_map
    elif precision in ("int8", "nf4"):
        require("bitsandbytes", f"Loading the base model in {precision.upper()}")
        from transformers import BitsAndBytesConfig

        skip = {} if skip_modules is None else {"llm_int8_skip_modules": list(skip_modules)}
        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_8bit=True, **skip) if precision == "int8" else
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, **skip))
        kwargs["device_map"] = device_map
    try:
        base = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except OSError as e:
        raise EvalError(f"cannot load --model {model}: {e}") from None
    if skip_modules is not None and precision in ("int8", "nf4"):
        kept, unmatched = _kept_linears(base, list(skip_modules))
        if unmatched:
            raise EvalError(f"--skip-modules: {len(unmatched)} name(s) keep no linear of {model} unquantised, "
                            f"e.g. {unmatched[0]!r} (full dotted names such as model.layers.0.self_attn.v_proj, "
                            "or a profile.json)")
        total = sum(isinstance(m, torch.nn.Linear) for m in base.modules())
        note = ("" if "lm_head" in kept or not isinstance(getattr(base, "lm_head", None), torch.nn.Module) else
                "; lm_head is not among them, so it is quantised too (add lm_head to keep the stock behaviour)")
        print(f"gnmr-hf eval: --skip-modules keeps {len(kept)} of {total} linears unquantised{note}",
              file=sys.stderr, flush=True)
    if precision == "bf16" and method is None:
        base = base.to(device)
    if precision == "nf4" or method == "bitsandbytes":
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        # the reference de-quantise + matmul, as in training (the recipes, the dual path): without it
        # bitsandbytes repacks on CPUs with AVX512-BF16 (BF16 block scales) and the scores differ by CPU
        keep_reference_layout(base)
    if method is not None:
        marker = _export_marker(model)
        form = f"an exported {method} folder" + (f" ({marker['kind']})" if marker.get("kind") else "")
    elif _export_marker(model).get("kind") == "merged-bf16":
        form = "the merged BF16 model (gnmr-hf export --merge)"
    else:
        form = ("a BF16 checkpoint" if precision == "bf16" else
                f"a BF16 checkpoint quantised at load to {precision.upper()}"
                + ("" if skip_modules is None else f", {len(skip_modules)} --skip-modules entries kept"))
    return _finish(base, tokenizer, adapter, form, model if local else None)


def _export_marker(model: str) -> dict[str, Any]:
    """The marker ``gnmr-hf export`` leaves in its folders (:data:`gnmr_hf.export_folder.MARKER`), or ``{}``."""
    try:
        data = json.loads((Path(model) / ".gnmr_export.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _finish(base, tokenizer, adapter, form: str, checkpoint) -> tuple[Any, Any, dict[str, Any]]:
    """The adapter applied, eval mode, and what was loaded."""
    if adapter is not None:
        from peft import PeftModel

        check_adapter_matches(base, adapter)
        base = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
        form += f" + the LoRA adapter {Path(str(adapter).rstrip('/')).name}"
    base.eval()
    return base, tokenizer, describe_scored(base, form, checkpoint)


def _compute_dtype(name: str) -> str:
    """``name`` checked, ``"auto"`` resolved (its reason printed to stderr)."""
    if name not in COMPUTE_DTYPES:
        raise EvalError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    from gnmr_hf.hardware import auto_compute_dtype

    resolved, reason = auto_compute_dtype()
    print(f"gnmr-hf eval: compute dtype auto -> {resolved}: {reason}", file=sys.stderr, flush=True)
    return resolved


# ---------------------------------------------------------------------------------- resume: contents
#: the files of a model folder whose contents the resume settings fingerprint (weights, configs, tokenizer)
_MODEL_FILES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".py", ".gguf")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_SAMPLE = 1 << 16  # bytes hashed from each end of a large file (its header: whole)


def _file_digest(path: Path) -> list[Any]:
    """``[size, mtime_ns, sha256]`` of one file, cheap for any size: small files (<= 1 MiB) hashed whole; a large one
    by its ``.safetensors`` header (whole: every tensor's name, dtype, shape and offsets), its first and its last
    64 KiB."""
    import hashlib

    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= 1 << 20:
            h.update(f.read())
        else:
            head = f.read(_SAMPLE)
            h.update(head)
            if path.suffix == ".safetensors" and len(head) >= 8:
                n = int.from_bytes(head[:8], "little")
                if 8 + n > len(head) and n < 1 << 28:
                    f.seek(8)
                    h.update(f.read(n))
            f.seek(max(st.st_size - _SAMPLE, 0))
            h.update(f.read(_SAMPLE))
    return [st.st_size, st.st_mtime_ns, h.hexdigest()]


def contents_fingerprint(path: str | os.PathLike | None, kind: str = "model") -> dict[str, Any] | None:
    """What a folder (or file) the evaluation reads holds, as the resume settings compare it: ``{name: [size,
    mtime_ns, sha256]}`` (:func:`_file_digest`: configs whole, large weights by header and both ends, nothing
    read in full) of its files that say what is scored:

    - ``kind="model"``: the folder's top-level weight, config and tokenizer files (``config.json``,
      ``*.safetensors``, ``.gnmr_export.json``, ...); a hub id (no such folder): None;
    - ``kind="adapter"``: ``adapter_config.json`` and ``adapter_model.*``;
    - ``kind="plan"``: the plan file (a folder: its ``profile.json``);
    - ``kind="data"``: every ``*.jsonl`` under the data folder.

    A folder re-exported in place (``gnmr-hf export --force``) or re-trained into the same path changes it, so a
    resume scores the task again instead of reading back the old folder's score."""
    if path is None:
        return None
    root = Path(path)
    if kind == "plan" and root.is_dir():
        root = root / "profile.json"
    if root.is_file():
        return {root.name: _file_digest(root)}
    if not root.is_dir():
        return None
    if kind == "data":
        files = sorted(f for f in root.rglob("*.jsonl") if f.is_file())
    elif kind == "adapter":
        files = [root / n for n in _ADAPTER_FILES if (root / n).is_file()]
    else:
        files = sorted(f for f in root.iterdir() if f.is_file() and f.name.endswith(_MODEL_FILES))
    return {f.relative_to(root).as_posix(): _file_digest(f) for f in files}


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
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = {
        "model": str(model), "adapter": None if adapter is None else str(Path(adapter).resolve()),
        "precision": precision, "compute_dtype": dtype_name,
        "data_dir": None if data_dir is None else str(Path(data_dir).resolve()), "limit": limit,
        "num_fewshot": num_fewshot, "max_gen_toks": max_gen_toks, "batch_size": batch_size,
        "log_samples": log_samples, "device": device, "skip_modules": skip_modules,
        "plan": None if plan is None else str(Path(plan).resolve()),
    }
    parts: dict[str, dict[str, Any]] = {}
    if resume_dir is not None:
        # what the folders hold, not only their names: a folder re-exported or re-trained in place scores again
        settings["contents"] = {"model": contents_fingerprint(model, "model"),
                                "adapter": contents_fingerprint(adapter, "adapter"),
                                "plan": contents_fingerprint(plan, "plan"),
                                "data_dir": contents_fingerprint(data_dir, "data")}
        for task in task_names:
            path = Path(resume_dir) / f"{task}.json"
            done = read_task_result(path, settings)
            if done is not None:
                parts[task] = done
            elif path.is_file():
                print(f"gnmr-hf eval: {task}: {path} was scored under other settings"
                      f"{_stale_reason(path, settings)}; scoring it again", file=sys.stderr, flush=True)
    todo = [t for t in task_names if t not in parts]
    with tempfile.TemporaryDirectory(prefix="gnmr_hf_eval_") as work:
        # data first: a bad data folder should fail before the slow model load
        include = write_local_tasks(data_dir, todo, work, num_fewshot) if data_dir is not None and todo else None
        lm = manager = scored = None
        for i, task in enumerate(task_names, 1):
            if task in parts:
                print(f"gnmr-hf eval: {task} ({i}/{len(task_names)}): read from {Path(resume_dir) / f'{task}.json'}",
                      file=sys.stderr, flush=True)
                continue
            if lm is None:
                lm, manager, scored = _harness_model(model, precision, adapter, device, dtype_name, batch_size,
                                                     include, skip_modules, plan)
            print(f"gnmr-hf eval: {task} ({i}/{len(task_names)})", file=sys.stderr, flush=True)
            from lm_eval import simple_evaluate

            quiet_lm_eval_git()  # lm_eval's "git describe" prints "fatal: not a git repository" outside one
            # one task per run: its own progress bar (with total and ETA) and its own results file
            part = simple_evaluate(
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
            # held when this task's scoring ended: transformers de-compresses a compressed-tensors folder on the
            # first forward, so what the model holds while it scores is not what it held at load
            scored = held_after_scoring(lm.model, scored)
            part[_SCORED_KEY] = scored
            parts[task] = part
            if resume_dir is not None:
                write_task_result(Path(resume_dir) / f"{task}.json", part, settings)
    # the record of the last task this call scored (what the model held when scoring ended), else a read-back one
    scored = scored or next((parts[t][_SCORED_KEY] for t in task_names if parts[t].get(_SCORED_KEY)), None)
    results = merge_task_results([{k: v for k, v in parts[t].items() if k != _SCORED_KEY} for t in task_names])
    precision = folder_format(model) or precision  # a pre-quantised folder: what it stores, not "bf16"
    method = method or default_method_name(model, precision, adapter)
    summary = summary_from_results(results, method, gsm8k_filter)
    summary.update(
        row=format_row(summary), model=str(model), adapter=None if adapter is None else str(adapter),
        precision=precision, compute_dtype=dtype_name, batch_size=batch_size, max_gen_toks=max_gen_toks,
        skip_modules=skip_modules, plan=settings["plan"], scored=scored,
        data_dir=None if data_dir is None else str(Path(data_dir).resolve()),
        limit=limit, num_fewshot=num_fewshot, tasks=task_names,
        read_back=[t for t in task_names if t not in todo],  # from resume_dir, not scored by this call
    )
    results["summary"] = summary
    if output is not None:
        _write_json(Path(output), results)
    return results


def _harness_model(model: str, precision: str, adapter: str | os.PathLike | None, device: str, dtype_name: str,
                   batch_size: int | str, include: Path | None, skip_modules: list[str] | None = None,
                   plan: str | os.PathLike | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """The loaded model wrapped in the harness's ``HFLM``, the ``TaskManager`` for the tasks, what was loaded."""
    import torch
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


def _write_json(path: Path, results: dict[str, Any]) -> None:
    """The results JSON (the harness's serialisation), written whole or not at all."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    os.replace(tmp, path)


def write_task_result(path: Path, results: dict[str, Any], settings: dict[str, Any]) -> None:
    """One task's results with the settings they were scored under (see :func:`read_task_result`)."""
    _write_json(path, {**results, _SETTINGS_KEY: settings})


def _stale_reason(path: Path, settings: dict[str, Any]) -> str:
    """`` (the model folder's files changed)``-like words on why ``path``'s stored settings differ, or ``""``."""
    try:
        stored = json.loads(path.read_text()).get(_SETTINGS_KEY)
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(stored, dict):
        return ""
    now = json.loads(json.dumps(settings))
    keys = [k for k in now if k != "contents" and stored.get(k) != now[k]]
    if "contents" not in stored:
        return " (written before the resume files recorded what the folders hold)"
    changed = [k for k, v in (now.get("contents") or {}).items()
               if (stored.get("contents") or {}).get(k) != v and stored.get(k) == now.get(k)]
    words = keys + [f"the {k.replace('_', ' ')}'s files changed" for k in changed]
    return f" ({', '.join(words)})" if words else ""


def read_task_result(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The results in ``path`` if it was written by :func:`write_task_result` under ``settings``; else None
    (no file, a truncated one, or other settings: the task is scored again)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(results, dict) or results.pop(_SETTINGS_KEY, None) != json.loads(json.dumps(settings)):
        return None
    return results


def merge_task_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One harness results dict from several one-task runs: the per-task entries (results, configs,
    n-shot, samples, ...) joined, the run metadata (config, versions of the environment, date) of the
    first, the evaluation times added."""
    if len(parts) == 1:
        return dict(parts[0])
    merged = dict(parts[0])
    for key in _PER_TASK_KEYS:
        joined: dict[str, Any] = {}
        for part in parts:
            joined.update(part.get(key) or {})
        if joined or key in merged:
            merged[key] = joined
    times = [p.get("total_evaluation_time_seconds") for p in parts]
    try:
        merged["total_evaluation_time_seconds"] = str(sum(float(t) for t in times))
    except (TypeError, ValueError):
        pass
    return merged


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


EPILOG = """examples:
  gnmr-hf eval --model ~/.cache/gnmr_hf/smollm2-135m-instruct --data-dir eval_data --limit 20
  gnmr-hf eval --model PATH --adapter runs/gnmr --precision int8 --tasks gsm8k,wikitext --output gnmr.json
  gnmr-hf eval --model PATH --compute-dtype float32 --batch-size 8 --resume-dir runs/eval_parts
  gnmr-hf eval --model PATH --precision nf4 --skip-modules prof/profile.json --adapter runs/planned-nf4
                                                    # the mixed base a planned adapter trained on
  gnmr-hf eval --model PATH --plan runs/ladder/profile.json --adapter runs/ladder
                                                    # a ladder plan on its training base (load_planned)
  gnmr-hf eval --model exported/                    # an exported folder (bitsandbytes, compressed-tensors, --merge)
  python -m gnmr_hf.offline.eval_data eval_data     # writes the offline evaluation set used above

Errors (a bad task, data folder, adapter or option) are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="gnmr-hf eval",
        description="Score a base model (+ LoRA adapter) on GSM8K, MMLU, HellaSwag and WikiText-2 with "
                    "lm-evaluation-harness, and print the paper's Table 7 row.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="base checkpoint folder, hub id or offline alias "
                                                  "(smollm2-135m-instruct, gemma3-270m)")
    p.add_argument("--adapter", help="PEFT LoRA adapter folder to apply on the base")
    p.add_argument("--precision", default=None, choices=PRECISIONS, help="base weights: bf16 (default), bitsandbytes "
                   "int8 or nf4; with --plan the low linears' (nf4 default); left out for an exported folder")
    p.add_argument("--plan", help="a plan file (profile.json, or its folder) loaded on --model, the BF16 checkpoint it "
                   "was made on, through gnmr_hf.load_planned: a ladder's INT8/BF16 rungs, the others --precision")
    p.add_argument("--compute-dtype", default="bfloat16", choices=COMPUTE_DTYPES,
                   help="dtype the model computes in (default bfloat16; float32 makes --batch-size > 1 give the "
                        "batch-1 scores; auto: BF16 where the hardware has BF16 units, else FP32)")
    p.add_argument("--skip-modules", help="int8/nf4: modules kept unquantised (llm_int8_skip_modules): a "
                                          "comma-separated list, or a profile.json from gnmr-hf profile")
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
    p.add_argument("--resume-dir", help="keep each task's results here as it finishes; a rerun with the same "
                                        "settings and the same folder contents reads them instead of scoring "
                                        "the task again")
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
        print(f"gnmr-hf eval: error: --batch-size must be an integer or 'auto', got {batch_size!r} "
              "(see gnmr-hf eval --help)", file=sys.stderr)
        return 2
    try:
        skip_modules = read_skip_modules(args.skip_modules)
        results = evaluate(
            args.model, args.tasks, adapter=args.adapter, precision=args.precision, data_dir=args.data_dir,
            limit=args.limit, batch_size=batch_size, num_fewshot=args.num_fewshot, device=args.device,
            method=args.name, gsm8k_filter=args.gsm8k_filter, max_gen_toks=args.max_gen_toks,
            log_samples=args.log_samples, output=args.output, compute_dtype=args.compute_dtype,
            resume_dir=args.resume_dir, skip_modules=skip_modules, plan=args.plan,
        )
    except (EvalError, ImportError) as e:  # ImportError: require()'s "install it with" message
        print(f"gnmr-hf eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngnmr-hf eval: interrupted" + (f"; rerun the same command to continue (finished tasks are in "
                                               f"{args.resume_dir})" if args.resume_dir else ""), file=sys.stderr)
        return 130
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(format_table([results["summary"]]))
    if results["summary"].get("scored"):
        print(format_scored(results["summary"]["scored"]))
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    bad = [k for k in ("gsm8k_em", "mmlu_acc", "hellaswag_acc", "wikitext_word_ppl")
           if results["summary"][k] is not None and not math.isfinite(results["summary"][k])]
    if bad:
        print(f"gnmr-hf eval: warning: non-finite {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
