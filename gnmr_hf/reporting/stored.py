"""Run files kept compressed: ``X`` or its gzip copy ``X.gz``, read and written as one.

A bench keeps the summary its report reads (``result.json``, ``run.json``, the curve) as plain files and
its per-step trace and long logs gzip-compressed, so the results folders stay light. Every reader of a
trace or log opens it through :func:`open_text`: given ``X`` it reads ``X``, or ``X.gz`` when only that
exists, so a caller names the file as the run wrote it and never cares which copy is on disk.
:func:`compress` is what a run does with its trace once it has landed.

Standard library only (the bench runner and the report import it without torch).
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import IO

GZ = ".gz"


def stored(path: str | os.PathLike) -> Path:
    """The copy of ``path`` on disk: ``path`` itself, else ``path.gz`` when only that exists, else ``path``
    (so a missing file's error names the file asked for)."""
    p = Path(path)
    if p.exists() or p.suffix == GZ:
        return p
    gz = p.with_name(p.name + GZ)
    return gz if gz.is_file() else p


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` or its compressed copy ``path.gz`` is a file."""
    return stored(path).is_file()


def open_text(path: str | os.PathLike, encoding: str = "utf-8") -> IO[str]:
    """Open ``path`` for reading as text, through gzip when the copy on disk (see :func:`stored`) ends in
    ``.gz``.

    Raises:
        FileNotFoundError: neither ``path`` nor ``path.gz`` exists.
    """
    p = stored(path)
    if p.suffix == GZ:
        return gzip.open(p, "rt", encoding=encoding)
    return open(p, encoding=encoding)


def compress(path: str | os.PathLike, append: bool = False, level: int = 9) -> Path | None:
    """Replace ``path`` by ``path.gz`` (gzip at ``level``, no name or time in the header, so the same text
    gives the same bytes); None when ``path`` does not exist.

    An existing ``path.gz`` is replaced, or with ``append`` kept and the text added to it as a further gzip
    member (a log a retried run appends to); readers see the members as one text. The new copy is written
    beside and renamed into place, and ``path`` removed only after, so a crash leaves the text readable.
    """
    src = Path(path)
    if not src.is_file():
        return None
    dst = src.with_name(src.name + GZ)
    tmp = src.with_name(f".{src.name}{GZ}.tmp")
    with open(tmp, "wb") as out:
        if append and dst.is_file():
            with open(dst, "rb") as old:
                shutil.copyfileobj(old, out)
        with open(src, "rb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=level,
                                                 mtime=0) as z:
            shutil.copyfileobj(f, z)
    os.replace(tmp, dst)
    src.unlink()
    return dst
