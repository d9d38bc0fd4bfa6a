"""Resuming an evaluation: each task's results written with the settings they were scored under (what the model,
adapter, plan and data folders hold, not only their names), read back by a rerun with the same settings, and the
one-task runs merged into one harness results dict."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

# the per-task entries of a harness results dict: merged across the one-task runs
_PER_TASK_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
                  "n-samples", "samples", "task_hashes")
_SETTINGS_KEY = "gnmr_hf_task_settings"
_SCORED_KEY = "gnmr_hf_scored"  # what a task was scored on (describe_scored), kept in its resume file

# ---------------------------------------------------------------------------------- resume: contents
#: the files of a model folder whose contents the resume settings fingerprint (weights, configs, tokenizer)
_MODEL_FILES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".py", ".gguf")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_SAMPLE = 1 << 16  # bytes hashed from each end of a large file (its header: whole)


def _file_digest(path: Path) -> list[Any]:
    """``[size, mtime_ns, sha256]`` of one file, cheap for any size: small files (<= 1 MiB) hashed whole; a large one
    by its ``.safetensors`` header (whole: every tensor's name, dtype, shape and offsets), its first and its last
    64 KiB."""
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

