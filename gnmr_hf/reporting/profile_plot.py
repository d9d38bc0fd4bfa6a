"""The profile's plot: gap closed against extra BF16 bytes, and a layer x operator heat map."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gnmr_hf.reporting.plots import save_figure

# ------------------------------------------------------------------------------------------ plot

_OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def memory_over_low_pct(bf16_bytes: float, over_low: dict[str, Any]) -> float:
    """``bf16_bytes`` of kept linears as memory over the all-low model, in %: the price table's column
    (:func:`gnmr_hf.planning.budget.format_price_table`), ``over_low`` being
    :func:`~gnmr_hf.planning.budget.over_low_prices`' (or :func:`~gnmr_hf.planning.budget.memory_budget`'s) record."""
    return 100 * bf16_bytes / over_low["bf16_per_over_byte"] / over_low["low_model_bytes"]


def plot_profile(profile: Any, plans: Sequence[Any], path: str | os.PathLike,
                 criterion: str | None = None, title: str | None = None,
                 over_low: dict[str, Any] | None = None, ladder: dict[str, Any] | None = None) -> Path:
    """``profile`` a :class:`gnmr_hf.SensitivityProfile`, ``plans`` its :class:`gnmr_hf.PrecisionPlan` s. Two panels:
    gap closed (predicted and measured) against the plan's price; a layer x operator heat map of the scores.
    Needs matplotlib.

    The price is in the user's currency, memory over the all-low (e.g. NF4) model as a stock load stores it,
    when ``over_low`` is given (:func:`gnmr_hf.planning.budget.over_low_prices`' record, what ``gnmr-hf profile``
    passes; the same conversion as the price table's "memory over NF4" column); without it, extra BF16 bytes as
    a share of the quantised weights' BF16 bytes. ``ladder``: :func:`gnmr_hf.planning.ladder.ladder_table`'s
    record, drawn beside the plans (each rung set's rows at their served price over the low model; needs
    ``over_low``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = profile._score_name(criterion)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.1]})
    ordered = sorted(plans, key=lambda p: p.bytes)
    if over_low is not None:
        xs = [0.0] + [p.over_low_pct if getattr(p, "over_low_pct", None) is not None  # the plan's exact price
                      else memory_over_low_pct(p.bytes, over_low) for p in ordered] + [
            memory_over_low_pct(profile.total_bytes, over_low)]
        low = str(over_low.get("low", "low")).upper()
        xlabel = f"memory over the {low} model, % (what the plan adds to the served model)"
        prop = f"proportional to memory (every linear on BF16: +{xs[-1]:.0f} %)"
    else:
        xs = [0.0] + [100 * p.fraction for p in ordered] + [100.0]
        xlabel = "extra BF16 bytes, % of the quantised weights' BF16 bytes"
        prop = "proportional to bytes"
    if any(p.predicted_gap_closed is not None for p in ordered):
        ys = [0.0] + [math.nan if p.predicted_gap_closed is None else p.predicted_gap_closed for p in ordered] + [math.nan]
        ax1.plot(xs, ys, "o--", label=f"predicted (sum of single {ordered[0].gain_score} gains)")
    for where in sorted({w for p in ordered for w in p.measured}):
        ys = [0.0] + [p.measured.get(where, {}).get("gap_closed", math.nan) for p in ordered] + [1.0]
        ax1.plot(xs, ys, "o-", label=f"measured ({where})")
    shown = list(xs[1:-1])
    if ladder is not None and over_low is not None:
        for rungs in dict.fromkeys(r["rungs"] for r in ladder["rows"]):
            rows = sorted((r for r in ladder["rows"] if r["rungs"] == rungs), key=lambda r: r["price_bytes"])
            lx = [0.0] + [100 * r["price_bytes"] / ladder["low_model_bytes"] for r in rows]
            ly = [0.0] + [math.nan if r["gap_closed"] is None else r["gap_closed"] for r in rows]
            ax1.plot(lx, ly, "s-", alpha=0.8, label=f"ladder rungs {rungs} (profile, stock-loaded)")
            shown += lx[1:]
    ax1.plot([0, xs[-1]], [0, 1], ":", color="grey", label=prop)
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("gap closed  (L_low - L_plan) / (L_low - L_high)")
    ax1.set_xlim(0, max(30.0, 1.1 * max(shown, default=0.0)))
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax1.set_title(f"plans by {name}")

    layers = sorted({u.layer for u in profile.units if u.layer is not None})
    ops = [o for o in _OPS if any(u.op == o for u in profile.units)] + sorted(
        {u.op for u in profile.units} - set(_OPS))
    grid = [[math.nan] * len(ops) for _ in layers]
    for u in profile.units:
        if u.layer is not None and u.op in ops:
            grid[layers.index(u.layer)][ops.index(u.op)] = u.scores.get(name, math.nan)
    vals = [v for row in grid for v in row if math.isfinite(v)]
    vmax = max((abs(v) for v in vals), default=1.0) or 1.0
    signed = any(v < 0 for v in vals)
    im = ax2.imshow(grid, aspect="auto", cmap="RdBu_r" if signed else "viridis",
                    vmin=-vmax if signed else 0, vmax=vmax, interpolation="nearest")
    ax2.set_xticks(range(len(ops)), ops, rotation=45, ha="right", fontsize=8)
    ax2.set_yticks(range(len(layers)), [str(v) for v in layers], fontsize=6 if len(layers) > 20 else 8)
    ax2.set_ylabel("decoder layer")
    ax2.set_title(f"{name} score per unit")
    fig.colorbar(im, ax=ax2, label=name + (" (loss gain)" if any(p.gain_score == name for p in plans) else ""))
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


