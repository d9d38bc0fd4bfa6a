"""``gnmr-hf report``: the paper's Table 7 layout from lm-eval result files (no lm-eval run needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gnmr_hf.reporting.report import format_table, main, summary_from_results


def _results(em_strict: float, em_flex: float, mmlu: float, hs: float, hs_norm: float, ppl: float,
             method: str | None = None) -> dict:
    """A results dict shaped like lm_eval.simple_evaluate's (keys "metric,filter")."""
    data = {
        "results": {
            "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": em_strict, "exact_match_stderr,strict-match": 0.01,
                      "exact_match,flexible-extract": em_flex, "exact_match_stderr,flexible-extract": 0.01},
            "mmlu": {"alias": "mmlu", "acc,none": mmlu, "acc_stderr,none": 0.004},
            "mmlu_anatomy": {"alias": " - anatomy", "acc,none": 0.9},
            "hellaswag": {"alias": "hellaswag", "acc,none": hs, "acc_norm,none": hs_norm},
            "wikitext": {"alias": "wikitext", "word_perplexity,none": ppl, "byte_perplexity,none": 1.5,
                         "bits_per_byte,none": 0.58},
        }
    }
    if method:
        data["summary"] = {"method": method}
    return data


# the paper's Table 7 numbers, as fractions / perplexities the harness would report
BF16 = _results(0.1509, 0.16, 0.2992, 0.6462, 0.70, 5.4503, method="BF16")
INT8 = _results(0.1471, 0.15, 0.2988, 0.6455, 0.70, 5.4519, method="Fixed INT8")
GNMR = _results(0.1501, 0.15, 0.2992, 0.6467, 0.70, 5.4511, method="GNMR+Δ INT8/BF16")

TABLE_7 = """\
| Method | GSM8K EM | MMLU Acc. | HellaSwag Acc. | WikiText-2 PPL |
| --- | --- | --- | --- | --- |
| BF16 | 15.09 | 29.92 | 64.62 | 5.4503 |
| Fixed INT8 | 14.71 | 29.88 | 64.55 | 5.4519 |
| GNMR+Δ INT8/BF16 | 15.01 | 29.92 | 64.67 | 5.4511 |"""


@pytest.fixture
def result_files(tmp_path) -> list[Path]:
    paths = []
    for name, data in (("bf16", BF16), ("int8", INT8), ("gnmr", GNMR)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(data))
        paths.append(p)
    return paths


def test_three_files_give_the_papers_table(result_files, capsys):
    assert main([str(p) for p in result_files]) == 0
    assert capsys.readouterr().out.strip() == TABLE_7


def test_names_override_and_two_files(result_files, capsys):
    assert main([str(result_files[0]), str(result_files[2]), "--names", "A", "B"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[2:] == ["| A | 15.09 | 29.92 | 64.62 | 5.4503 |", "| B | 15.01 | 29.92 | 64.67 | 5.4511 |"]


def test_flexible_extract_column_and_file_stem_default(tmp_path, capsys):
    data = _results(0.25, 0.5, 0.3, 0.4, 0.45, 12.345678)  # no stored method name
    p = tmp_path / "my_run.json"
    p.write_text(json.dumps(data))
    assert main([str(p), "--gsm8k-filter", "flexible-extract"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[2] == "| my_run | 50.00 | 30.00 | 40.00 | 12.3457 |"


def test_missing_tasks_show_na():
    partial = {"results": {"wikitext": {"word_perplexity,none": 7.0}}}
    row = summary_from_results(partial, "ppl only")
    assert row["gsm8k_em"] is None and row["wikitext_word_ppl"] == 7.0
    assert format_table([row]).splitlines()[2] == "| ppl only | n/a | n/a | n/a | 7.0000 |"


def test_plot_writes_a_png(result_files, tmp_path, capsys):
    out = tmp_path / "table7.png"
    assert main([str(p) for p in result_files] + ["--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # four panels with bars and labels, not an empty canvas


def test_errors_are_clear(tmp_path, capsys, result_files):
    assert main([str(tmp_path / "nope.json")]) == 2
    assert "no such result file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"accuracy": 0.5}))
    assert main([str(foreign)]) == 2
    assert "not an lm-eval results file" in capsys.readouterr().err
    assert main([str(result_files[0]), "--names", "a", "b"]) == 2
    err = capsys.readouterr().err
    assert "--names gives 2 names for 1 files" in err and "Traceback" not in err
