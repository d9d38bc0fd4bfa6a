"""``profile.png`` in the user's currency: gap closed against memory over the all-low (NF4) model, the
figure the price tables print (issue 51, item 7), not a share of the quantised weights' BF16 bytes.

The x values are checked against the price table's own "memory over NF4" column and the ladder table's
"served over NF4 (MiB)" column as ``gnmr-hf profile`` prints them, on a hand-built profile and end to end
on a tiny random LLaMA.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from gnmr_hf import planning  # noqa: E402
from gnmr_hf.reporting import plots  # noqa: E402
from gnmr_hf.reporting.profile_plot import plot_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OLD_LABEL = "extra BF16 bytes, % of the quantised weights' BF16 bytes"


def _price_axis(fig):
    return fig.axes[0]


def _line(ax, prefix: str):
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(prefix)]
    assert len(lines) == 1, [ln.get_label() for ln in ax.get_lines()]
    return lines[0]


def _table_column(table: str, header: str) -> list[str]:
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table.splitlines() if ln.startswith("|")]
    col = rows[0].index(header)
    return [r[col] for r in rows[2:]]


def test_the_price_axis_is_memory_over_nf4_as_the_price_table_prints_it(tmp_path, kept_figures):
    prof = planning.SensitivityProfile.from_json(ROOT / "tests" / "data" / "profile_format1.json")
    price = [planning.plan(prof, budget_fraction=f) for f in (0.05, 0.10, 0.25)]
    # a model whose all-NF4 form is 3x its linears' BF16 bytes (a large embedding, as Gemma's), each linear
    # costing 1.4375 / 2 of its BF16 bytes over NF4 (bitsandbytes' 4.5 bits a weight against 16)
    over_low = {"low": "nf4", "low_model_bytes": 3 * prof.total_bytes, "bf16_per_over_byte": 2 / 1.4375}
    plot_profile(prof, price, tmp_path / "profile.png", over_low=over_low, title="tiny, nf4")
    (fig,) = kept_figures()
    ax = _price_axis(fig)
    assert ax.get_xlabel().startswith("memory over the NF4 model, %") and ax.get_xlabel() != OLD_LABEL
    xs = list(_line(ax, "predicted").get_xdata())
    # worked by hand: a plan of B BF16 bytes adds B * 1.4375 / 2 bytes to a model of 3 * total bytes
    by_hand = [100 * p.bytes * 1.4375 / 2 / (3 * prof.total_bytes) for p in price]
    assert xs[1:-1] == pytest.approx(by_hand, rel=1e-9)
    # ... which is what the price table prints in its memory column (one decimal)
    printed = _table_column(planning.format_price_table(price, over_low), "memory over NF4")
    assert [f"+{x:.1f} %" for x in xs[1:-1]] == printed
    # every linear on BF16 is the proportional line's end: 1.4375 / 2 / 3 = +24 % over NF4
    assert xs[-1] == pytest.approx(100 * 1.4375 / 2 / 3)
    assert _line(ax, "proportional to memory").get_xdata()[-1] == pytest.approx(xs[-1])
    # not the old axis: the same plans there sat at 5 / 10 / 25 % of the BF16 bytes
    assert xs[1:-1] != pytest.approx([100 * p.fraction for p in price], rel=0.01)
    assert plots.texts_outside(fig) == []


def test_without_the_conversion_the_axis_says_it_is_bf16_bytes(tmp_path, kept_figures):
    prof = planning.SensitivityProfile.from_json(ROOT / "tests" / "data" / "profile_format1.json")
    price = [planning.plan(prof, budget_fraction=f) for f in (0.05, 0.25)]
    plot_profile(prof, price, tmp_path / "profile.png")
    (fig,) = kept_figures()
    ax = _price_axis(fig)
    assert ax.get_xlabel() == OLD_LABEL
    assert list(_line(ax, "predicted").get_xdata())[1:-1] == pytest.approx([100 * p.fraction for p in price])


@pytest.mark.slow  # ~40 s on a loaded 2-core CPU: a profile and nine ladder loads of a tiny model
def test_gnmr_hf_profile_draws_plans_and_ladder_at_the_printed_memory_over_nf4(tmp_path, capsys, kept_figures):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.cli import main
    from tests.conftest import make_tiny_llama
    from tests.test_profile_faults_r3 import tiny_tokenizer

    model = make_tiny_llama(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(model)
    out = tmp_path / "prof"
    code = main(["--model", str(model), "--output", str(out), "--batch-size", "2", "--budget", "+25%nf4", "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert (out / "profile.png").stat().st_size > 10_000
    (fig,) = kept_figures()
    ax = _price_axis(fig)
    assert ax.get_xlabel().startswith("memory over the NF4 model, %")
    saved = json.loads((out / "profile.json").read_text())

    # the BF16-only plans: where the price table puts them
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| budget | plan |"))
    table = "\n".join(lines[head:head + 2] + [ln for ln in lines[head + 2:] if re.match(r"\| \S+ %? ?\| free \|", ln)])
    printed = _table_column(table, "memory over NF4 (plan)")
    xs = list(_line(ax, "measured (profile)").get_xdata())[1:-1]
    assert len(printed) == len(saved["price"]) == len(xs) >= 2
    assert [f"+{x:.2f} %" for x in xs] == printed
    # the budget +25%nf4: its plan is drawn at most 25 % over the NF4 model (the other points are 5/10/25 % of
    # the BF16 bytes: the last one costs more)
    budget_plan = sorted(saved["price"], key=lambda p: p["bytes"]).index(
        next(p for p in saved["price"] if p["bytes"] == saved["plan"]["bytes"]))
    assert 20.0 < xs[budget_plan] <= 25.0 < max(xs)

    # the ladder's rows: each rung set at the bytes it adds to the served NF4 model, within its budget
    ladder = saved["ladder"]
    assert ladder["low_model_bytes"] == pytest.approx(float(re.search(
        r"over the ([\d.]+) MiB nf4 model", stdout).group(1)) * 2**20, abs=0.05 * 2**20)
    for rungs in ("bf16", "int8", "int8+bf16"):
        line = _line(ax, f"ladder rungs {rungs} ")
        rows = sorted((r for r in ladder["rows"] if r["rungs"] == rungs), key=lambda r: r["price_bytes"])
        assert len(rows) == 3
        xs = list(line.get_xdata())[1:]
        assert xs == pytest.approx([100 * r["price_bytes"] / ladder["low_model_bytes"] for r in rows])
        assert all(0 < x <= 100 * r["memory_over_low"] + 1e-9 for x, r in zip(xs, rows))
        assert list(line.get_ydata())[1:] == pytest.approx([r["gap_closed"] for r in rows])
    assert plots.texts_outside(fig) == []
