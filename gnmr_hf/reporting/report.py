"""``gnmr-hf report``: the paper's Table 7 layout for several ``gnmr-hf eval`` result files.

Table 7 of the paper reports, per fine-tuning method, GSM8K exact match, MMLU accuracy and HellaSwag
accuracy in percent (two decimals) and WikiText-2 word perplexity (four decimals). This module reads
those numbers out of the harness's own results (``results[task][metric,filter]``), so it works on
any lm-eval results JSON that holds these tasks, not only on files written by ``gnmr-hf eval``.

It imports neither lm_eval nor torch; matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from gnmr_hf._import_utils import require
from gnmr_hf.reporting.plots import save_figure

HEADER = ("Method", "GSM8K EM", "MMLU Acc.", "HellaSwag Acc.", "WikiText-2 PPL")
# (summary key, harness task, harness metric key without the filter); GSM8K's filter is a parameter
_COLUMNS = (
    ("gsm8k_em", "gsm8k", "exact_match"),
    ("mmlu_acc", "mmlu", "acc"),
    ("hellaswag_acc", "hellaswag", "acc"),
    ("wikitext_word_ppl", "wikitext", "word_perplexity"),
)
GSM8K_FILTERS = ("strict-match", "flexible-extract")
MISSING = "n/a"


class ReportError(Exception):
    """A user mistake (unreadable or foreign result file); the CLI prints it and exits with 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """``argparse`` whose usage errors are one line (what is wrong, and where the help is), exit code 2;
    the gnmr-hf commands (demo, eval, report) parse with it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def summary_from_results(results: dict[str, Any], method: str, gsm8k_filter: str = "strict-match") -> dict[str, Any]:
    """The Table 7 numbers of one harness results dict (fractions and perplexity as the harness gives them).

    Args:
        results: what ``lm_eval.simple_evaluate`` returned (or its JSON), with a ``"results"`` mapping.
        method: the row's name (the paper's "Method" column).
        gsm8k_filter: which of the harness's GSM8K filters gives the EM column: ``"strict-match"``
            (the ``#### N`` answer line) or ``"flexible-extract"`` (the last number in the output).

    Returns:
        ``{"method", "gsm8k_em", "mmlu_acc", "hellaswag_acc", "wikitext_word_ppl", "gsm8k_filter"}``;
        a task that was not evaluated gives ``None``.
    """
    if gsm8k_filter not in GSM8K_FILTERS:
        raise ReportError(f"gsm8k filter must be one of {', '.join(GSM8K_FILTERS)}, got {gsm8k_filter!r}")
    per_task = results.get("results")
    if not isinstance(per_task, dict):
        raise ReportError("not an lm-eval results file: it has no 'results' mapping")
    row: dict[str, Any] = {"method": method}
    for key, task, metric in _COLUMNS:
        flt = gsm8k_filter if task == "gsm8k" else "none"
        value = per_task.get(task, {}).get(f"{metric},{flt}")
        row[key] = None if value is None else float(value)
    row["gsm8k_filter"] = gsm8k_filter
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    def pct(x: float | None) -> str:
        return MISSING if x is None or not math.isfinite(x) else f"{100.0 * x:.2f}"

    ppl = row["wikitext_word_ppl"]
    return [
        str(row["method"]),
        pct(row["gsm8k_em"]),
        pct(row["mmlu_acc"]),
        pct(row["hellaswag_acc"]),
        MISSING if ppl is None else f"{ppl:.4f}",
    ]


def format_row(row: dict[str, Any]) -> str:
    """One Markdown table row in the paper's Table 7 layout (percentages, PPL with four decimals)."""
    return "| " + " | ".join(_cells(row)) + " |"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: header, separator and one row per summary (see :func:`summary_from_results`)."""
    lines = ["| " + " | ".join(HEADER) + " |", "| " + " | ".join("---" for _ in HEADER) + " |"]
    lines += [format_row(r) for r in rows]
    return "\n".join(lines)


def load_result_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read one results JSON, with a clear :class:`ReportError` for a missing or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise ReportError(f"{p}: no such result file")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ReportError(f"{p}: not an lm-eval results file (no 'results' mapping)")
    return data


def default_name(data: dict[str, Any], path: str | os.PathLike) -> str:
    """The method name stored by ``gnmr-hf eval`` (``summary.method``), else the file's stem."""
    summary = data.get("summary")
    if isinstance(summary, dict) and summary.get("method"):
        return str(summary["method"])
    return Path(path).stem


def plot_table(rows: list[dict[str, Any]], out: str | os.PathLike) -> Path:
    """Draw the table as a grouped bar chart (one panel per column, one bar per method) into a PNG."""
    require("matplotlib", "Plotting the report")
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    panels = [
        ("gsm8k_em", "GSM8K EM (%)", 100.0, "higher is better"),
        ("mmlu_acc", "MMLU Acc. (%)", 100.0, "higher is better"),
        ("hellaswag_acc", "HellaSwag Acc. (%)", 100.0, "higher is better"),
        ("wikitext_word_ppl", "WikiText-2 PPL", 1.0, "lower is better"),
    ]
    names = [str(r["method"]) for r in rows]
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.8))
    for ax, (key, title, scale, note) in zip(axes, panels):
        values = [r[key] * scale if r[key] is not None and math.isfinite(r[key]) else 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), values, color=[colors[i % len(colors)] for i in range(len(rows))])
        for bar, r, v in zip(bars, rows, values):
            label = MISSING if r[key] is None else (f"{v:.2f}" if scale != 1.0 else f"{v:.4f}")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{title}\n({note})", fontsize=10)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.margins(y=0.15)
    return save_figure(fig, out, dpi=120)


EPILOG = """examples:
  gnmr-hf report bf16.json int8.json gnmr.json
  gnmr-hf report bf16.json int8.json gnmr.json --names BF16 "Fixed INT8" "GNMR INT8/BF16" --plot table7.png
  gnmr-hf report gnmr-demo/eval/*.json --gsm8k-filter flexible-extract

The files are gnmr-hf eval --output files or any lm-eval results JSON. Errors are one line on stderr
and exit code 2.
"""


def main(argv: list[str] | None = None) -> int:
    """``gnmr-hf report a.json b.json [--names A B] [--gsm8k-filter F] [--plot out.png]``."""
    parser = OneLineErrorParser(
        prog="gnmr-hf report",
        description="Print the paper's Table 7 layout (Markdown) for several gnmr-hf eval / lm-eval result files.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", help="results JSON files, one table row each")
    parser.add_argument("--names", nargs="+", help="row names (default: the method stored in each file)")
    parser.add_argument("--gsm8k-filter", default="strict-match", choices=GSM8K_FILTERS,
                        help="harness filter for the GSM8K EM column (default: strict-match, the '#### N' line)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the table as a grouped bar chart")
    args = parser.parse_args(argv)
    try:
        if args.names is not None and len(args.names) != len(args.files):
            raise ReportError(f"--names gives {len(args.names)} names for {len(args.files)} files")
        rows = []
        for i, path in enumerate(args.files):
            data = load_result_file(path)
            name = args.names[i] if args.names else default_name(data, path)
            rows.append(summary_from_results(data, name, args.gsm8k_filter))
        print(format_table(rows))
        if args.plot:
            print(f"wrote {plot_table(rows, args.plot)}", file=sys.stderr)
    except ReportError as e:
        print(f"gnmr-hf report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
