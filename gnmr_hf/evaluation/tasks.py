"""The bundled tasks and their local data: ``--tasks`` parsed, a ``--data-dir`` checked against the hub datasets'
schemas, and the per-run task YAMLs (the harness's YAML + the local data source) written for a ``TaskManager``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from gnmr_hf._import_utils import require
from gnmr_hf.evaluation.errors import EvalError

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
_TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


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

