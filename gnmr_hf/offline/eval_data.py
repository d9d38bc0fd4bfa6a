"""A small offline evaluation set in the four hub schemas, for runs without dataset hub access.

``write_eval_data(root)`` writes ``root/<task>/<split>.jsonl`` in the layout ``gnmr-hf eval --data-dir``
reads. None of it is the real benchmark; it is honest stand-in material that exercises the same
harness tasks:

- **gsm8k**: the project's own generated arithmetic word problems (:mod:`gnmr_hf.offline.gsm8k`), with GSM8K's
  ``<<a*b=c>>`` annotations and ``#### N`` answers. The files are exactly those of
  ``write_gsm8k_jsonl(root)`` with its defaults, so a model fine-tuned on that call's train split
  is evaluated on its disjoint test split.
- **mmlu**: generated four-way multiple-choice questions whose answers are computed, under three real
  MMLU subject names (so the harness's per-subject prompt applies): ``elementary_mathematics``
  (arithmetic), ``high_school_computer_science`` (the value of a Python expression, computed by
  Python) and ``abstract_algebra`` (modular arithmetic in Z_n). Distractors are nearby wrong values.
- **hellaswag**: sentence-completion items built from English prose that ships with every CPython,
  the language reference in ``pydoc_data.topics``: the context is one sentence plus the first words
  of the next, the gold ending is the real rest of that sentence, the three distractors are the
  endings of random other sentences.
- **wikitext**: WikiText-style documents (``" = Title = "`` heading, then prose paragraphs) made from
  the same language-reference topics, split by topic into train/validation/test; pages are capped
  in length so CPU runs stay short.

Everything is deterministic in ``seed`` (the prose depends on the Python version's stdlib text).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any

from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl

MMLU_SUBJECTS = ("elementary_mathematics", "high_school_computer_science", "abstract_algebra")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------- MMLU
def _choices(r: random.Random, correct: int, wrong: list[int]) -> tuple[list[str], int]:
    """Four distinct choices (correct + three of ``wrong``), shuffled; returns (choices, answer index)."""
    pool = list(dict.fromkeys(w for w in wrong if w != correct))
    step = 1
    while len(pool) < 3:  # not enough distinct mistakes: pad with nearby values
        for cand in (correct + step, correct - step):
            if cand not in pool and cand != correct and len(pool) < 3:
                pool.append(cand)
        step += 1
    values = [correct] + r.sample(pool, 3)
    r.shuffle(values)
    return [str(v) for v in values], values.index(correct)


def _elementary_mathematics(r: random.Random) -> tuple[str, int, list[int]]:
    kind = r.randrange(4)
    if kind == 0:
        a, b = r.randint(12, 99), r.randint(3, 19)
        return f"What is the value of {a} × {b}?", a * b, [a * b + 10, a * b - 10, a * (b - 1), a * b + a]
    if kind == 1:
        a, b, c = r.randint(100, 999), r.randint(100, 999), r.randint(10, 99)
        s = a + b - c
        return f"What is {a} + {b} − {c}?", s, [a + b + c, s + 10, s - 100, s + 1]
    if kind == 2:
        pct, base = r.choice([10, 20, 25, 50, 75]), r.choice([40, 60, 80, 120, 160, 200, 240])
        v = pct * base // 100
        return f"What is {pct}% of {base}?", v, [v + pct, base - v if base - v != v else v * 2, v // 2, v + 10]
    a, b = r.randint(2, 12), r.randint(2, 12)
    n = a * b
    return f"A rectangle is {a} cm wide and {b} cm long. What is its area in square centimetres?", n, [
        2 * (a + b), n + a, n - b, a + b]


def _high_school_computer_science(r: random.Random) -> tuple[str, int, list[int]]:
    kind = r.randrange(6)
    if kind == 0:
        a, b = r.randint(10, 99), r.randint(3, 9)
        expr, mistakes = f"{a} // {b}", [round(a / b) + 1, a % b, a // b + 1, a // b - 1]
    elif kind == 1:
        a, b = r.randint(10, 99), r.randint(3, 9)
        expr, mistakes = f"{a} % {b}", [a // b, a % b + 1, b - a % b, a % b + b]
    elif kind == 2:
        a, b = r.randint(2, 4), r.randint(2, 5)
        expr, mistakes = f"{a} ** {b}", [a * b, b**a, a ** (b - 1), a ** (b + 1)]
    elif kind == 3:
        n = r.randint(3, 12)
        expr, mistakes = f"sum(range({n}))", [n * (n + 1) // 2, n, n * (n - 1), n * (n - 1) // 2 - 1]
    elif kind == 4:
        xs = r.sample(range(1, 50), 5)
        i = r.choice([-1, -2, 1, 2])
        expr, mistakes = f"{xs}[{i}]", [xs[i - 1] if i > 0 else xs[i + 1], xs[0], xs[-1], xs[2]]
    else:
        a, b = r.randint(1, 15), r.randint(1, 3)
        expr, mistakes = f"{a} << {b}", [a >> b, a * b, a + b, a << (b + 1)]
    value = eval(expr, {"__builtins__": {}}, {"sum": sum, "range": range})  # our own generated expression
    return f"What value does the Python expression {expr} evaluate to?", int(value), mistakes


def _abstract_algebra(r: random.Random) -> tuple[str, int, list[int]]:
    kind = r.randrange(4)
    if kind == 0:
        n = r.randint(5, 20)
        a, b = r.randint(1, n - 1), r.randint(1, n - 1)
        v = (a + b) % n
        return f"Find the sum of {a} and {b} in Z_{n}.", v, [a + b, (v + 1) % n, (v - 1) % n, abs(a - b) % n]
    if kind == 1:
        n = r.randint(5, 20)
        a, b = r.randint(2, n - 1), r.randint(2, n - 1)
        v = (a * b) % n
        return f"Find the product of {a} and {b} in Z_{n}.", v, [a * b, (v + 1) % n, (a + b) % n, (v + 2) % n]
    if kind == 2:
        n = r.choice([6, 8, 9, 10, 12, 14, 15, 16, 18, 20, 24])
        a = r.randint(1, n - 1)
        v = n // math.gcd(a, n)
        return f"Find the order of the element {a} in the additive group Z_{n}.", v, [a, n, math.gcd(a, n), v * 2]
    p = r.choice([5, 7, 11, 13, 17, 19])
    a = r.randint(2, p - 1)
    v = pow(a, -1, p)
    return f"Find the multiplicative inverse of {a} modulo {p}.", v, [p - a, (v + 1) % p, (a * a) % p, (v - 1) % p]


_MMLU_MAKERS = {
    "elementary_mathematics": _elementary_mathematics,
    "high_school_computer_science": _high_school_computer_science,
    "abstract_algebra": _abstract_algebra,
}


def mmlu_rows(n_per_subject: int, seed: int = 0, split: str = "test",
              exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """Generated MMLU-schema rows (question, subject, choices, answer) for :data:`MMLU_SUBJECTS`.

    Args:
        n_per_subject: rows per subject.
        seed: random seed.
        split: name mixed into the seed, so splits differ.
        exclude: questions that must not appear (keeps test disjoint from dev).
    """
    r = random.Random(f"mmlu-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    for subject in MMLU_SUBJECTS:
        seen: set[str] = set(exclude or ())
        while sum(1 for x in rows if x["subject"] == subject) < n_per_subject:
            question, correct, wrong = _MMLU_MAKERS[subject](r)
            if question in seen:
                continue
            seen.add(question)
            choices, answer = _choices(r, correct, wrong)
            rows.append({"question": question, "subject": subject, "choices": choices, "answer": answer})
    return rows


# ------------------------------------------------------------------------------ stdlib prose source
def prose_topics() -> list[tuple[str, list[str]]]:
    """(title, prose paragraphs) of each topic of the Python language reference in ``pydoc_data``.

    Indented blocks (code, grammar, "See also" lists) are dropped; footnote marks and ``**`` markup
    are removed; wrapped lines are joined.
    """
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        lines = topics[key].splitlines()
        title = key
        if len(lines) > 1 and lines[1] and set(lines[1]) <= {"*", "="}:
            title, lines = lines[0].strip(), lines[2:]
        paragraphs, current = [], []
        for line in lines + [""]:
            if line.strip() and not line.startswith(" "):
                current.append(line.strip())
                continue
            if current:
                text = " ".join(current)
                text = re.sub(r"\s*\[\d+\]", "", text).replace("**", "")
                text = re.sub(r"\s+", " ", text).strip()
                # headings and list labels are short or end without a full stop
                if len(text.split()) >= 8 and text.endswith(".") and "::=" not in text:
                    paragraphs.append(text)
                current = []
        if paragraphs:
            out.append((title.replace("“", '"').replace("”", '"'), paragraphs))
    return out


_SENTENCE_END = re.compile(r"(?<=[a-z0-9\)\"][.!?])\s+(?=[A-Z])")


def _sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def hellaswag_rows(n: int, seed: int = 0, split: str = "validation") -> list[dict[str, Any]]:
    """HellaSwag-schema rows built from consecutive sentences of the stdlib language reference."""
    r = random.Random(f"hellaswag-{split}-{seed}")
    pairs: list[tuple[str, str, str]] = []  # (topic title, sentence, next sentence)
    for title, paragraphs in prose_topics():
        for p in paragraphs:
            s = _sentences(p)
            for a, b in zip(s, s[1:]):
                # the harness's preprocess() deletes [...] spans; keep items it would leave intact
                if "[" in a + b or not 6 <= len(b.split()) <= 30 or len(a.split()) > 40:
                    continue
                pairs.append((title, a, b))
    r.shuffle(pairs)
    if len(pairs) < n + 3:
        raise ValueError(f"only {len(pairs)} sentence pairs available, asked for {n}")

    def split_sentence(sentence: str, k: int) -> tuple[str, str]:
        words = sentence.split()
        return " ".join(words[:k]), " ".join(words[k:])

    rows = []
    offset = 0 if split == "train" else len(pairs) // 2  # train and validation come from disjoint halves
    for i in range(n):
        title, ctx_a, nxt = pairs[offset + i]
        k = r.randint(2, 4)
        head, gold = split_sentence(nxt, k)
        ctx_b = head[:1].lower() + head[1:]  # HellaSwag's ctx_b starts lower case; process_docs capitalises
        endings: list[str] = []
        while len(endings) < 3:  # three distinct wrong endings, none equal to the gold one
            other = pairs[r.randrange(len(pairs))][2]
            ending = split_sentence(other, min(k, len(other.split()) - 2))[1]
            if ending != gold and ending not in endings:
                endings.append(ending)
        label = r.randrange(4)
        endings.insert(label, gold)
        rows.append({
            "ind": i, "activity_label": title, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
            "endings": endings, "source_id": f"pydoc_data.topics:{title}", "split": "train" if split == "train" else "val",
            "split_type": "indomain", "label": str(label),
        })
    return rows


def wikitext_pages(max_words: int = 400) -> list[dict[str, str]]:
    """One WikiText-style document per language-reference topic (heading, then paragraphs)."""
    pages = []
    for title, paragraphs in prose_topics():
        body, words = [], 0
        for p in paragraphs:
            if body and words + len(p.split()) > max_words:
                break
            body.append(p)
            words += len(p.split())
        pages.append({"page": f" = {title} = \n\n" + "\n\n".join(body) + "\n"})
    return pages


def write_eval_data(
    root: str | os.PathLike,
    mmlu_per_subject: int = 20,
    hellaswag_n: int = 40,
    wikitext_test_pages: int = 8,
    wikitext_max_words: int = 400,
    seed: int = 0,
) -> Path:
    """Write the offline evaluation set ``root/{gsm8k,mmlu,hellaswag,wikitext}/<split>.jsonl``.

    Args:
        root: output folder (created).
        mmlu_per_subject: test questions per MMLU subject (each subject also gets 5 dev questions,
            the harness's few-shot source).
        hellaswag_n: validation items (plus 8 train items).
        wikitext_test_pages: documents in the test split (validation gets 4, train the rest).
        wikitext_max_words: cap on a document's length.
        seed: random seed.

    Returns:
        ``Path(root)``, ready for ``gnmr-hf eval --data-dir``.
    """
    root = Path(root)
    write_gsm8k_jsonl(root)  # the defaults: test disjoint from the default training split
    dev = mmlu_rows(5, seed, "dev")
    test = mmlu_rows(mmlu_per_subject, seed, "test", exclude={x["question"] for x in dev})
    _write_jsonl(root / "mmlu" / "dev.jsonl", dev)
    _write_jsonl(root / "mmlu" / "test.jsonl", test)
    _write_jsonl(root / "hellaswag" / "train.jsonl", hellaswag_rows(8, seed, "train"))
    _write_jsonl(root / "hellaswag" / "validation.jsonl", hellaswag_rows(hellaswag_n, seed, "validation"))
    pages = wikitext_pages(wikitext_max_words)
    random.Random(f"wikitext-{seed}").shuffle(pages)
    n_test, n_val = wikitext_test_pages, 4
    if len(pages) < n_test + n_val + 1:
        raise ValueError(f"only {len(pages)} pages available")
    _write_jsonl(root / "wikitext" / "test.jsonl", pages[:n_test])
    _write_jsonl(root / "wikitext" / "validation.jsonl", pages[n_test:n_test + n_val])
    _write_jsonl(root / "wikitext" / "train.jsonl", pages[n_test + n_val:])
    return root


def main(argv: list[str] | None = None) -> int:
    """``python -m gnmr_hf.offline.eval_data OUT_DIR``: write the offline evaluation set."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m gnmr_hf.offline.eval_data", description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_eval_data(args.root, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
