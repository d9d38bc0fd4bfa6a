"""The JSONL trace of a GNMR run: one line per optimizer step, flushed as it is written.

A resumed run keeps the lines up to the step it resumes from and drops the rest (they belong to the
lost part of the interrupted run), so a run killed and resumed holds every step exactly once. The
line format is in docs/design.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

TRACE_NAME = "gnmr_trace.jsonl"
SUMMARY_NAME = "gnmr_summary.json"


def jsonable(x: Any) -> Any:
    """``x`` with tensors, tuples and numpy scalars turned into JSON types (dict keys become strings)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    return x


class TraceWriter:
    """Appends one JSON line per step to ``path``; on resume keeps only the lines up to ``resume_step``.

    Args:
        path: the trace file (its folder is created).
        resume_step: the step the run starts after (0 for a fresh run: the file is emptied).
    """

    def __init__(self, path: str, resume_step: int = 0) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept: list[str] = []
        if resume_step > 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        break  # a line cut short by a crash ends the usable trace
                    if step <= resume_step:
                        kept.append(line)
        # replace, not truncate in place: a crash now leaves either the old or the new file
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(tmp, path)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, line: dict[str, Any]) -> None:
        """Append ``line`` (made JSON-safe; non-finite floats as ``NaN``/``Infinity``) and flush."""
        self._file.write(json.dumps(jsonable(line)) + "\n")
        self._file.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the trace; with ``summary``, write it as ``gnmr_summary.json`` next to the trace."""
        self._file.close()
        if summary is not None:
            with open(os.path.join(os.path.dirname(self.path), SUMMARY_NAME), "w", encoding="utf-8") as f:
                json.dump(jsonable(summary), f, indent=2)


class LogWindow:
    """The per-step counts logged as ``gnmr/<key>``: means over the steps since the last log, the
    maximum for ``recovery_bytes``.

    Args:
        keys: record keys that are counts, lists (their length) or bools (0/1).
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self._rows: list[dict[str, float]] = []

    def add(self, record: dict[str, Any], recovery_bytes: int) -> None:
        """Add one step's record (a missing ``skipped`` counts as 0)."""
        row = {}
        for k in self.keys:
            v = _as_number(record.get(k, False if k == "skipped" else None))
            if v is not None:
                row[k] = v
        row["recovery_bytes"] = float(recovery_bytes)
        self._rows.append(row)

    def drain(self) -> dict[str, float]:
        """``{"gnmr/<key>": value}`` over the steps added since the last drain (empty if none)."""
        out = {}
        for k in sorted({k for row in self._rows for k in row}):
            vals = [row[k] for row in self._rows if k in row]
            out[f"gnmr/{k}"] = max(vals) if k == "recovery_bytes" else sum(vals) / len(vals)
        self._rows = []
        return out


def _as_number(v: Any) -> float | None:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (list, tuple, set)):
        return float(len(v))
    return float(v) if isinstance(v, (int, float)) else None
