"""A text (domain-adaptation) task: plain text files, causal-LM loss on every token, fixed-length blocks.

The files are a folder (every ``.txt`` / ``.rst`` / ``.md`` file under it, recursively) or a glob, in
sorted path order. Every ``heldout_every``-th file is held out (whole documents, no overlap with
training, the rule the stress bench uses). Each split is tokenised file by file, each file followed by
the tokenizer's EOS token, concatenated, and cut into blocks of ``block_size`` tokens; the remainder
shorter than a block is dropped. Labels equal the input ids (the model shifts them), so every token
but a block's first is predicted.

The real corpus is the Python 3.11 documentation (Debian's ``python3.11-doc``:
``/usr/share/doc/python3.11/html/_sources``); a small PSF-licensed sample ships in
``recipes/stress/corpus_sample`` for tests.
"""

from __future__ import annotations

import glob
import os
import warnings
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".rst", ".md")
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")


def text_files(source: str | os.PathLike) -> list[Path]:
    """The text files of ``source`` (a folder, searched recursively, or a glob), sorted by path."""
    source = str(source)
    if os.path.isdir(source):
        files = sorted(p for p in Path(source).rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"no {'/'.join(TEXT_SUFFIXES)} files under {source}")
        return files
    if any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"the glob {source} matches no file")
        return files
    if os.path.isfile(source):
        return [Path(source)]
    hint = " (the Python docs: apt-get install -y python3.11-doc)" if str(PYTHON_DOCS) in source else ""
    raise FileNotFoundError(f"{source} is neither a folder, a file nor a glob that matches files{hint}")


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
    """The files' tokens in order, each file followed by EOS (no BOS: blocks start mid-text)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id to separate the files with")
    ids: list[int] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
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
    records the file and token counts of both splits.
    """
    files = text_files(source)
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
    summary = {"source": str(source), "files": len(files), "train_files": len(train_files),
               "heldout_files": len(held_files), "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
               "block_size": block_size, "train_blocks": len(train), "heldout_blocks": len(held)}
    return train, held, summary
