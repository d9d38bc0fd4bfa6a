"""Run files kept compressed: ``X`` or its gzip copy ``X.gz``, read and written as one.

A bench keeps the summary its report reads (``result.json``, ``run.json``, the curve) as plain files and
its per-step trace and long logs gzip-compressed, so the results folders stay light. Every reader of a
trace or log opens it through :func:`open_text`: given ``X`` it reads ``X``, or ``X.gz`` when only that
exists, so a caller names the file as the run wrote it and never cares which copy is on disk.
:func:`compress` is what a run does with its trace once it has landed.

Both copies on disk. ``X.gz`` may hold text that ``X`` continues (a log: ``compress(X, append=True)`` adds
``X`` to it as a further gzip member) or text that ``X`` replaces (a trace written anew: ``compress(X)``
replaces ``X.gz``); the files alone do not say which, so :func:`open_text` refuses to guess
(:class:`StoredFileError`) unless the caller says (``appended=True``: ``X.gz`` then ``X``;
``appended=False``: ``X`` alone), or unless an interrupted :func:`compress` left its journal saying how much
of ``X`` is already in ``X.gz`` (then the text is read once, whatever ``appended`` says).

Crash safety of ``compress(append=True)``: the new ``X.gz`` is written beside, a journal
(``.X.gz.journal``: the bytes of ``X`` it holds, and the size and hash of the new ``X.gz``) lands before it
is renamed into place, ``X`` is removed, then the journal. A crash at any point leaves every byte readable
once, and running :func:`compress` again finishes the job: a journal whose ``X.gz`` did land tells it which
leading bytes of ``X`` are in already (they are not appended twice); one whose ``X.gz`` did not is stale and
ignored. ``compress(X)`` (no append) needs no journal: running it again gives the same ``X.gz``.

Standard library only (the bench runner and the report import it without torch).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import IO

GZ = ".gz"
_CHUNK = 1 << 20


class StoredFileError(ValueError):
    """A stored run file that cannot be read as one text: a damaged (truncated) ``.gz``, or ``X`` and ``X.gz``
    both on disk with nothing saying how they join. The message names the files and what to do."""


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


def open_text(path: str | os.PathLike, encoding: str = "utf-8", appended: bool | None = None) -> IO[str]:
    """Open ``path`` for reading as text, through gzip when the copy on disk (see :func:`stored`) ends in
    ``.gz``.

    When ``path`` and ``path.gz`` both exist: an interrupted :func:`compress` that left its journal is read as
    its text, once; otherwise ``appended`` says how the two join: True reads ``path.gz`` then ``path`` (a log
    whose earlier attempts are compressed), False reads ``path`` alone (a file written anew beside its stale
    compressed copy), None (the default) refuses.

    Raises:
        FileNotFoundError: neither ``path`` nor ``path.gz`` exists.
        StoredFileError: both exist, no journal and ``appended`` None; or the ``.gz`` is damaged (when read).
    """
    p = Path(path)
    if p.suffix == GZ:
        return _GzipText(p, encoding)
    gz = p.with_name(p.name + GZ)
    if not gz.is_file():
        return open(p, encoding=encoding)
    if not p.exists():
        return _GzipText(gz, encoding)
    done = _settled(p, gz)
    if done is None and appended is None:
        raise StoredFileError(
            f"both {p} and {gz} exist: {p.name} was written again after it was compressed, and which text is "
            f"meant is ambiguous. Say how they join: open_text(..., appended=True) reads {gz.name} then {p.name} "
            f"(a log, {gz.name} holding the earlier attempts), appended=False reads {p.name} alone (written anew, "
            f"{gz.name} stale); or settle it on disk with gnmr_hf.reporting.stored.compress({str(p)!r}, "
            "append=True) (joins them) or compress(...) without append (keeps the new text only)")
    if done is None and not appended:
        return open(p, encoding=encoding)
    with open(p, "rb") as f:
        f.seek(done or 0)
        rest = f.read()
    return io.StringIO((_decompress(gz) + rest).decode(encoding), newline=None)


def compress(path: str | os.PathLike, append: bool = False, level: int = 9) -> Path | None:
    """Replace ``path`` by ``path.gz`` (gzip at ``level``, no name or time in the header, so the same text
    gives the same bytes); None when ``path`` does not exist.

    An existing ``path.gz`` is replaced, or with ``append`` kept and the text added to it as a further gzip
    member (a log a retried run appends to); readers see the members as one text. The new copy is written
    beside and renamed into place, and ``path`` removed only after, so a crash leaves the text readable; with
    ``append`` a journal makes a second run after a crash finish the first without adding its text twice
    (see the module's docstring).
    """
    src = Path(path)
    dst = src.with_name(src.name + GZ)
    tmp = src.with_name(f".{src.name}{GZ}.tmp")
    journal = _journal(dst)
    done = _settled(src, dst) if append else None  # bytes of src an interrupted append already put in dst
    if not src.is_file():
        journal.unlink(missing_ok=True)
        return None
    if done is not None and src.stat().st_size == done:  # that append landed; only its clean-up was left
        src.unlink()
        journal.unlink(missing_ok=True)
        return dst
    src_hash, n = hashlib.sha256(), 0
    with open(tmp, "wb") as out:
        if append and dst.is_file():
            with open(dst, "rb") as old:
                shutil.copyfileobj(old, out)
        with open(src, "rb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=level,
                                                 mtime=0) as z:
            while chunk := f.read(_CHUNK):
                src_hash.update(chunk)
                keep = max(0, (done or 0) - n)  # the leading bytes already in dst
                n += len(chunk)
                if keep < len(chunk):
                    z.write(chunk[keep:])
        out.flush()
        os.fsync(out.fileno())
    if append:
        record = {"src_bytes": n, "src_sha256": src_hash.hexdigest(), "gz_bytes": tmp.stat().st_size,
                  "gz_sha256": _file_sha(tmp)}
        jtmp = journal.with_name(journal.name + ".tmp")
        with open(jtmp, "w") as jf:
            json.dump(record, jf)
            jf.flush()
            os.fsync(jf.fileno())
        os.replace(jtmp, journal)
    os.replace(tmp, dst)
    src.unlink()
    journal.unlink(missing_ok=True)
    return dst


# ------------------------------------------------------------------------------------------------ helpers


def _journal(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.journal")


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _settled(src: Path, dst: Path) -> int | None:
    """How many leading bytes of ``src`` an interrupted ``compress(append=True)`` put into ``dst`` already:
    its journal's count when ``dst`` is the copy it renamed into place and ``src`` still starts with the text it
    compressed; None otherwise (no journal, or a stale one: the crash came before the rename)."""
    try:
        record = json.loads(_journal(dst).read_text())
        n, src_sha, gz_bytes, gz_sha = (record[k] for k in ("src_bytes", "src_sha256", "gz_bytes", "gz_sha256"))
        if dst.stat().st_size != gz_bytes or _file_sha(dst) != gz_sha:
            return None
        with open(src, "rb") as f:
            head = f.read(n)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return n if len(head) == n and hashlib.sha256(head).hexdigest() == src_sha else None


def _damaged(path: Path, e: BaseException) -> StoredFileError:
    what = "cut short" if isinstance(e, EOFError) else "not valid gzip data"
    return StoredFileError(
        f"{path} is damaged ({what}: {e}): an interrupted copy, download or write left it incomplete. Restore it "
        f"from a complete copy, or run again the run that wrote it; `gzip -dc {path}` prints the text before the "
        "damage")


_BAD_GZIP = (EOFError, gzip.BadGzipFile, zlib.error)


def _decompress(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except _BAD_GZIP as e:
        raise _damaged(path, e) from None


class _GzipText(io.TextIOWrapper):
    """``gzip.open(path, "rt")`` whose reads raise :class:`StoredFileError` naming the file, not a bare
    ``EOFError``, on a truncated or corrupt copy."""

    def __init__(self, path: Path, encoding: str) -> None:
        self._path = path
        super().__init__(gzip.open(path, "rb"), encoding=encoding)

    def read(self, size: int | None = -1) -> str:
        try:
            return super().read(size)
        except _BAD_GZIP as e:
            raise _damaged(self._path, e) from None

    def readline(self, size: int = -1) -> str:
        try:
            return super().readline(size)
        except _BAD_GZIP as e:
            raise _damaged(self._path, e) from None

    def readlines(self, hint: int = -1) -> list[str]:
        try:
            return super().readlines(hint)
        except _BAD_GZIP as e:
            raise _damaged(self._path, e) from None

    def __next__(self) -> str:
        try:
            return super().__next__()
        except _BAD_GZIP as e:
            raise _damaged(self._path, e) from None
