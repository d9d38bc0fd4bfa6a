"""Plan and profile JSON files read strictly: a key given twice in one object is refused.

``json.load`` keeps the last of two equal keys without a word, so a hand-edited ``profile.json`` with two
``"rungs"`` (or one linear named twice in a ``rungs`` mapping) would load a plan nobody wrote. Every reader of a
plan or profile file (``SensitivityProfile.from_json``, ``load_planned``'s plan file, the exports' plan
readers, ``--skip-modules``, ``require_groups``) reads it through :func:`read_json`.

Standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object naming a key twice. A ``ValueError`` (and not a ``json.JSONDecodeError``: the text is JSON)."""


def loads(text: str, source: str | os.PathLike = "<json>") -> Any:
    """``json.loads(text)``, refusing (:class:`DuplicateKeyError` naming the key and ``source``) an object that
    names a key twice."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise DuplicateKeyError(
                    f"{source}: key {key!r} appears twice in one JSON object (a JSON reader would keep the last "
                    "silently); remove the one not meant")
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=pairs)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value of the file ``path`` (UTF-8), read by :func:`loads`.

    Raises:
        OSError: the file cannot be read.
        json.JSONDecodeError: not JSON.
        DuplicateKeyError: an object names a key twice (the message names the key and the file).
    """
    return loads(Path(path).read_text(encoding="utf-8"), path)
