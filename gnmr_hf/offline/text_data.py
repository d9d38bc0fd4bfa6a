"""A text (domain-adaptation) task: plain text files, causal-LM loss on every token, fixed-length blocks.

The files are a folder (every ``.txt`` / ``.rst`` / ``.md`` file under it, recursively) or a glob, in
sorted path order. Every ``heldout_every``-th file is held out (whole documents, no overlap with
training, the rule the stress bench uses). Each split is tokenised file by file, each file followed by
the tokenizer's EOS token, concatenated, and cut into blocks of ``block_size`` tokens; the remainder
shorter than a block is dropped. Labels equal the input ids (the model shifts them), so every token
but a block's first is predicted.

What is not text is kept out, never read silently wrong: hidden paths (a name starting with ``.`` below
the folder or the glob's fixed part: ``.ipynb_checkpoints``, ``.git``) and binary files (a NUL byte in
the first KiB) are skipped and counted (the summary's ``skipped_hidden`` / ``skipped_binary``, which the
recipes write to ``run.json``); a file that is not UTF-8 is refused in one line naming the file and the
byte offset (no replacement characters); a held-out split whose files hold less than one block is
refused before training.

The real corpus is the Python 3.11 documentation (Debian's ``python3.11-doc``:
``/usr/share/doc/python3.11/html/_sources``); a small PSF-licensed sample ships in
``recipes/stress/corpus_sample`` for tests.
"""

from __future__ import annotations

import glob
import os
import sys
import warnings
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".rst", ".md")
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")


BINARY_PROBE = 1024  # a NUL byte in a file's first KiB marks it binary (as git and grep decide)


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


def _literal_prefix(pattern: str) -> Path:
    """The glob's fixed part: its path components before the first one with a wildcard."""
    parts = []
    for part in Path(pattern).parts:
        if any(ch in part for ch in "*?["):
            break
        parts.append(part)
    return Path(*parts) if parts else Path()


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.parts[len(root.parts):])


def scan_text_files(source: str | os.PathLike) -> tuple[list[Path], dict[str, int]]:
    """The text files of ``source`` (a folder, searched recursively, or a glob), sorted by path, and what was
    skipped: ``{"skipped_hidden": n, "skipped_binary": m}``.

    A folder gives its ``.txt`` / ``.rst`` / ``.md`` files; a glob whatever files it matches. Either way a path
    with a hidden component below the folder (or the glob's fixed part) is skipped, and so is a binary file
    (a NUL byte in its first KiB). A single file is taken as given (still refused if binary).

    Raises:
        FileNotFoundError: nothing to read (the message counts what was skipped).
    """
    source = str(source)
    skipped = {"skipped_hidden": 0, "skipped_binary": 0}

    def keep(paths, root: Path) -> list[Path]:
        out = []
        for p in sorted(paths):
            if _hidden(p, root):
                skipped["skipped_hidden"] += 1
            elif _is_binary(p):
                skipped["skipped_binary"] += 1
            else:
                out.append(p)
        return out

    def none_left(what: str) -> FileNotFoundError:
        n_hidden, n_binary = skipped["skipped_hidden"], skipped["skipped_binary"]
        extra = f" ({n_hidden} hidden and {n_binary} binary file(s) skipped)" if n_hidden or n_binary else ""
        return FileNotFoundError(what + extra)

    if os.path.isdir(source):
        root = Path(source)
        files = keep((p for p in root.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES)), root)
        if not files:
            raise none_left(f"no {'/'.join(TEXT_SUFFIXES)} files under {source}")
        return files, skipped
    if any(ch in source for ch in "*?["):
        # glob's own rule drops hidden names from its wildcards; ask for them (3.11+) so they are counted too
        kwargs = {"include_hidden": True} if sys.version_info >= (3, 11) else {}
        matches = (Path(p) for p in glob.glob(source, recursive=True, **kwargs) if os.path.isfile(p))
        files = keep(matches, _literal_prefix(source))
        if not files:
            raise none_left(f"the glob {source} matches no file")
        return files, skipped
    if os.path.isfile(source):
        if _is_binary(Path(source)):
            raise FileNotFoundError(f"{source} is a binary file (a NUL byte in its first {BINARY_PROBE} bytes), "
                                    "not text")
        return [Path(source)], skipped
    hint = " (the Python docs: apt-get install -y python3.11-doc)" if str(PYTHON_DOCS) in source else ""
    raise FileNotFoundError(f"{source} is neither a folder, a file nor a glob that matches files{hint}")


def text_files(source: str | os.PathLike) -> list[Path]:
    """The text files of ``source`` (a folder, searched recursively, or a glob), sorted by path; hidden paths
    and binary files skipped (:func:`scan_text_files`, which also counts them)."""
    return scan_text_files(source)[0]


def read_text_file(path: str | os.PathLike) -> str:
    """``path`` decoded as UTF-8, strictly.

    Raises:
        ValueError: the file is not UTF-8, in one line naming it, the offending byte and its offset.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason}); "
                         "convert it (e.g. iconv -f latin1 -t utf-8) or remove it") from None


def read_text_source(source: str | os.PathLike) -> str:
    """The text of ``source``: one text file, or every text file of a folder (:func:`text_files`, sorted by path)
    joined by blank lines. ``ValueError`` in one line for a JSON dataset (not plain text), a folder without text
    files, or a file that is not UTF-8; ``OSError`` for a path that cannot be read."""
    path = Path(source)
    if path.suffix.lower() in (".json", ".jsonl"):
        raise ValueError(f"{source}: a JSON dataset, not plain text: give the text the run trained on (a .txt / .md "
                         "/ .rst file, or a folder of them)")
    files = text_files(path) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{source}: no text file (.txt, .rst, .md) in this folder")
    return "\n\n".join(read_text_file(f) for f in files)


def split_by_file(files: list[Path], heldout_every: int = 20) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every ``heldout_every``-th file (1-based) is held out; 0 holds none out."""
    if heldout_every < 0 or heldout_every == 1:
        raise ValueError(f"heldout_every must be 0 (none) or >= 2, got {heldout_every}")
    if heldout_every == 0:
        return list(files), []
    held = files[heldout_every - 1 :: heldout_every]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def token_stream(files: list[Path], tokenizer) -> list[int]:
    """The files' tokens in order, each file followed by EOS (no BOS: blocks start mid-text).

    Raises:
        ValueError: a file is not UTF-8 (:func:`read_text_file`), or the tokenizer has no EOS.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id to separate the files with")
    ids: list[int] = []
    for f in files:
        text = read_text_file(f)  # strict: a file that is not UTF-8 is refused, never decoded with U+FFFD
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return ids


def blocks(ids: list[int], block_size: int) -> list[dict[str, list[int]]]:
    """``ids`` cut into consecutive blocks of ``block_size`` (the short remainder is dropped), each a
    training row whose labels are its input ids (loss on every token)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    out = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        chunk = ids[start : start + block_size]
        out.append({"input_ids": chunk, "attention_mask": [1] * block_size, "labels": list(chunk)})
    return out


def text_task(source: str | os.PathLike, tokenizer, block_size: int, heldout_every: int = 20,
              max_files: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """(train blocks, held-out blocks, summary) for the text files of ``source``.

    ``max_files`` keeps the first files (by sorted path) before the split, for small runs. The summary
    records the file and token counts of both splits, and the hidden and binary files skipped.

    Raises:
        FileNotFoundError: ``source`` holds no text file.
        ValueError: a file is not UTF-8 (named, with the byte offset); the training files hold less than one
            block; or files are held out but hold less than one block between them (nothing to measure on).
    """
    files, skipped = scan_text_files(source)
    if max_files is not None:
        files = files[:max_files]
    train_files, held_files = split_by_file(files, heldout_every)
    if heldout_every and not held_files:
        warnings.warn(f"{source}: {len(files)} file(s), fewer than heldout_every={heldout_every}, so no file is held "
                      "out (every file trains); point the task at a larger folder for a held-out split",
                      stacklevel=2)
    train_ids, held_ids = token_stream(train_files, tokenizer), token_stream(held_files, tokenizer)
    train, held = blocks(train_ids, block_size), blocks(held_ids, block_size)
    if not train:
        raise ValueError(f"the training files of {source} hold {len(train_ids)} tokens, less than one block "
                         f"of {block_size}")
    if held_files and not held:
        raise ValueError(f"the {len(held_files)} held-out file(s) of {source} (every {heldout_every}-th file: "
                         f"{', '.join(f.name for f in held_files[:3])}{', ...' if len(held_files) > 3 else ''}) hold "
                         f"{len(held_ids)} tokens with their EOS, less than one block of {block_size}: no held-out "
                         "block to measure on; use longer files or a smaller block (max_seq_len)")
    summary = {"source": str(source), "files": len(files), "train_files": len(train_files),
               "heldout_files": len(held_files), "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
               "block_size": block_size, "train_blocks": len(train), "heldout_blocks": len(held), **skipped}
    return train, held, summary
