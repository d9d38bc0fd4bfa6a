"""A small GSM8K-style data set the project generates itself, so fine-tuning and evaluation run offline.

Each record has the GSM8K schema: ``question`` (a short arithmetic word problem) and ``answer``
(worked steps with ``<<a*b=c>>`` calculator annotations, then a final ``#### N`` line), so the
harness's own GSM8K task (strict ``#### N`` match and flexible last-number match) scores a model
fine-tuned on it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam",
          "Maya", "Nico", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "stamps", "eggs"]


def _buy_groups(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    have, groups, each = r.randint(2, 40), r.randint(2, 9), r.randint(2, 12)
    bought = groups * each
    total = have + bought
    q = (f"{name} has {have} {item}. {name} buys {groups} boxes with {each} {item} in each box. "
         f"How many {item} does {name} have now?")
    a = (f"{name} buys {groups} * {each} = <<{groups}*{each}={bought}>>{bought} {item}.\n"
         f"{name} now has {have} + {bought} = <<{have}+{bought}={total}>>{total} {item}.\n#### {total}")
    return q, a, total


def _share(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    friends, each, left = r.randint(2, 8), r.randint(2, 15), r.randint(0, 9)
    start = friends * each + left
    given = friends * each
    q = (f"{name} had {start} {item} and gave {each} {item} to each of {friends} friends. "
         f"How many {item} does {name} have left?")
    a = (f"{name} gave away {friends} * {each} = <<{friends}*{each}={given}>>{given} {item}.\n"
         f"{name} has {start} - {given} = <<{start}-{given}={left}>>{left} {item} left.\n#### {left}")
    return q, a, left


def _earn(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(_NAMES)
    rate, hours, days, spent = r.randint(5, 20), r.randint(2, 8), r.randint(2, 6), r.randint(1, 30)
    per_day = rate * hours
    earned = per_day * days
    left = earned - spent
    q = (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days, "
         f"then spends ${spent} on lunch. How many dollars does {name} have left?")
    a = (f"{name} earns {rate} * {hours} = <<{rate}*{hours}={per_day}>>{per_day} dollars a day.\n"
         f"Over {days} days that is {per_day} * {days} = <<{per_day}*{days}={earned}>>{earned} dollars.\n"
         f"After lunch {name} has {earned} - {spent} = <<{earned}-{spent}={left}>>{left} dollars.\n#### {left}")
    return q, a, left


def _split_evenly(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    bags, per_bag, extra = r.randint(2, 9), r.randint(3, 12), r.randint(1, 20)
    total = bags * per_bag
    q = (f"{name} puts {total} {item} into {bags} bags with the same number in each bag, "
         f"then adds {extra} more {item} to one bag. How many {item} are in that bag?")
    a = (f"Each bag holds {total} / {bags} = <<{total}/{bags}={per_bag}>>{per_bag} {item}.\n"
         f"That bag has {per_bag} + {extra} = <<{per_bag}+{extra}={per_bag + extra}>>{per_bag + extra} {item}.\n"
         f"#### {per_bag + extra}")
    return q, a, per_bag + extra


_TEMPLATES: list[Callable[[random.Random], tuple[str, str, int]]] = [_buy_groups, _share, _earn, _split_evenly]


def arithmetic_problems(n: int, seed: int = 0, exclude: set[str] | None = None) -> list[dict[str, str]]:
    """``n`` distinct GSM8K-schema records (``question``, ``answer``), deterministic in ``seed``.

    Args:
        n: number of records.
        seed: random seed; the same seed always gives the same records.
        exclude: questions that must not appear (to keep a test split disjoint from a train split).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    r = random.Random(seed)
    seen = set(exclude or ())
    out: list[dict[str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct problems (templates exhausted)")
        q, a, _ = r.choice(_TEMPLATES)(r)
        if q in seen:
            continue
        seen.add(q)
        out.append({"question": q, "answer": a})
    return out


def write_gsm8k_jsonl(root: str | os.PathLike, n_train: int = 512, n_test: int = 128, seed: int = 0) -> Path:
    """Write ``root/gsm8k/{train,test}.jsonl`` (disjoint splits) and return ``root/gsm8k``."""
    folder = Path(root) / "gsm8k"
    folder.mkdir(parents=True, exist_ok=True)
    train = arithmetic_problems(n_train, seed=seed)
    test = arithmetic_problems(n_test, seed=seed + 1, exclude={x["question"] for x in train})
    for split, rows in (("train", train), ("test", test)):
        tmp = folder / f".{split}.jsonl.tmp"
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, folder / f"{split}.jsonl")
    return folder
