"""The offline evaluation set: hub schemas, answers that are actually right, disjoint splits."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from gnmr_hf.evaluation.evaluate import DATA_FILES, check_data_dir
from gnmr_hf.offline.eval_data import MMLU_SUBJECTS, write_eval_data
from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_eval_data(tmp_path_factory.mktemp("eval_data"))


def test_layout_and_schema_pass_the_eval_checks(root):
    rows = check_data_dir(root, list(DATA_FILES))
    assert {t: set(s) for t, s in rows.items()} == {t: set(s) for t, s in DATA_FILES.items()}
    assert len(rows["mmlu"]["test"]) == 20 * len(MMLU_SUBJECTS)
    assert len(rows["hellaswag"]["validation"]) == 40 and len(rows["wikitext"]["test"]) == 8


def test_gsm8k_is_the_default_generator_output(root, tmp_path):
    reference = write_gsm8k_jsonl(tmp_path)
    for split in ("train", "test"):
        assert (root / "gsm8k" / f"{split}.jsonl").read_text() == (reference / f"{split}.jsonl").read_text()


def test_mmlu_answers_are_correct(root):
    test = _rows(root / "mmlu" / "test.jsonl")
    dev = _rows(root / "mmlu" / "dev.jsonl")
    assert not {r["question"] for r in test} & {r["question"] for r in dev}
    checked = 0
    for r in test + dev:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4
        gold = int(r["choices"][r["answer"]])
        q = r["question"]
        # recompute each answer independently from the question text
        if m := re.fullmatch(r"What value does the Python expression (.+) evaluate to\?", q):
            assert gold == eval(m.group(1), {"__builtins__": {}}, {"sum": sum, "range": range})
        elif m := re.fullmatch(r"What is the value of (\d+) × (\d+)\?", q):
            assert gold == int(m.group(1)) * int(m.group(2))
        elif m := re.fullmatch(r"What is (\d+) \+ (\d+) − (\d+)\?", q):
            assert gold == int(m.group(1)) + int(m.group(2)) - int(m.group(3))
        elif m := re.fullmatch(r"What is (\d+)% of (\d+)\?", q):
            assert gold * 100 == int(m.group(1)) * int(m.group(2))
        elif m := re.fullmatch(r"A rectangle is (\d+) cm wide and (\d+) cm long\..*", q):
            assert gold == int(m.group(1)) * int(m.group(2))
        elif m := re.fullmatch(r"Find the sum of (\d+) and (\d+) in Z_(\d+)\.", q):
            assert gold == (int(m.group(1)) + int(m.group(2))) % int(m.group(3))
        elif m := re.fullmatch(r"Find the product of (\d+) and (\d+) in Z_(\d+)\.", q):
            assert gold == (int(m.group(1)) * int(m.group(2))) % int(m.group(3))
        elif m := re.fullmatch(r"Find the order of the element (\d+) in the additive group Z_(\d+)\.", q):
            a, n = int(m.group(1)), int(m.group(2))
            assert gold == n // math.gcd(a, n)
        elif m := re.fullmatch(r"Find the multiplicative inverse of (\d+) modulo (\d+)\.", q):
            assert gold * int(m.group(1)) % int(m.group(2)) == 1
        else:
            pytest.fail(f"unrecognised question {q!r}")
        checked += 1
    assert checked == len(test) + len(dev)
    # the gold position is spread over A-D, so "always A" cannot score well
    assert len({r["answer"] for r in test}) == 4


def test_hellaswag_gold_ending_is_the_real_continuation(root):
    from pydoc_data.topics import topics

    prose = re.sub(r"\s+", " ", " ".join(topics.values()).replace("**", ""))
    rows = _rows(root / "hellaswag" / "validation.jsonl")
    for r in rows:
        assert r["ctx"] == f"{r['ctx_a']} {r['ctx_b']}"
        gold = r["endings"][int(r["label"])]
        # ctx_b (re-capitalised, as the harness does) followed by the gold ending is a sentence of the source
        sentence = r["ctx_b"][:1].upper() + r["ctx_b"][1:] + " " + gold
        assert sentence in prose, sentence
        assert r["ctx_a"] in prose
        assert len(set(r["endings"])) == 4
    assert len({r["label"] for r in rows}) == 4
    train = _rows(root / "hellaswag" / "train.jsonl")
    assert not {r["ctx"] for r in train} & {r["ctx"] for r in rows}


def test_wikitext_pages_are_split_by_topic(root):
    splits = {s: _rows(root / "wikitext" / f"{s}.jsonl") for s in ("train", "validation", "test")}
    titles = {s: {r["page"].split(" = ")[1] for r in rows} for s, rows in splits.items()}
    assert not titles["test"] & titles["train"] and not titles["test"] & titles["validation"]
    for r in splits["test"]:
        assert r["page"].startswith(" = ") and len(r["page"].split()) <= 420


def test_deterministic(root, tmp_path):
    again = write_eval_data(tmp_path)
    for task, splits in DATA_FILES.items():
        for s in splits:
            assert (again / task / f"{s}.jsonl").read_bytes() == (root / task / f"{s}.jsonl").read_bytes()
