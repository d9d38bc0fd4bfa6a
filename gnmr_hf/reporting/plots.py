"""Plots of recipe runs: training-loss curves, and a units x steps heat map of GNMR with the active set.

Inputs are the files a run of ``recipes/finetune.py`` leaves in its output folder: the Trainer's
``trainer_state.json`` (its ``log_history`` holds the logged losses) and the callback's
``gnmr_trace.jsonl`` (one JSON line per optimizer step; ``active`` there is the set chosen *for the
next step*).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gnmr_hf._import_utils import require
from gnmr_hf.reporting.stored import open_text


def read_loss_history(run_dir: str | os.PathLike) -> tuple[list[int], list[float]]:
    """``(steps, losses)`` logged by the Trainer, from ``run_dir/trainer_state.json``.

    Raises:
        FileNotFoundError: no trainer_state.json in ``run_dir``.
        ValueError: the file holds no logged loss.
    """
    path = Path(run_dir) / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (the recipe writes it at the end of training)")
    history = json.loads(path.read_text()).get("log_history", [])
    points = [(int(e["step"]), float(e["loss"])) for e in history if "loss" in e and "step" in e]
    if not points:
        raise ValueError(f"{path} has no logged training loss")
    steps, losses = zip(*points)
    return list(steps), list(losses)


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``gnmr_trace.jsonl`` in file order (``NaN``/``Infinity`` read as floats); a trace
    kept compressed (only ``gnmr_trace.jsonl.gz`` on disk) is read the same. A trace is written whole (a fresh
    run empties it, a resumed one keeps the raw file's head), so a raw copy beside a compressed one is the newer
    trace and is read alone."""
    rows = []
    with open_text(path, appended=False) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))  # json accepts NaN/Infinity, which the trace writes
    if not rows:
        raise ValueError(f"{path} holds no trace records")
    return rows


def trace_matrices(rows: list[dict[str, Any]]) -> tuple[list[int], list[list[float]], list[list[bool]]]:
    """Per-step GNMR values and the units on the recovery path *during* each step.

    Returns:
        ``(steps, gnmr, active)``: ``gnmr[u][i]`` is unit u's GNMR at ``steps[i]``, and
        ``active[u][i]`` whether unit u ran on the recovery path in that step, i.e. whether the
        previous record chose it (the first step runs with the set chosen before training, which the
        trace does not record: taken as empty unless the record says ``active_now``).
    """
    steps = [int(r["step"]) for r in rows]
    num_units = len(rows[0]["gnmr"])
    gnmr = [[float(r["gnmr"][u]) for r in rows] for u in range(num_units)]
    active = [[False] * len(rows) for _ in range(num_units)]
    for i in range(len(rows)):
        if i == 0:
            chosen = rows[0].get("active_now", [])
        else:
            chosen = rows[i - 1]["active"]
        for u in chosen:
            active[int(u)][i] = True
    return steps, gnmr, active


def plot_loss_curves(runs: Mapping[str, str | os.PathLike], out: str | os.PathLike, title: str | None = None) -> Path:
    """Draw the training loss of several runs against the optimizer step into one PNG.

    Args:
        runs: legend label -> run folder (holding ``trainer_state.json``).
        out: the PNG to write (its folder is created).
        title: figure title.
    """
    require("matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")  # servers and CI have no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = ["-", "--", ":", "-."]  # curves of matched runs lie on top of each other: tell them apart
    for i, (label, run_dir) in enumerate(runs.items()):
        steps, losses = read_loss_history(run_dir)
        style = styles[i % len(styles)]
        if len(steps) <= 20:
            ax.plot(steps, losses, style, marker="o", markersize=3, linewidth=1.5, label=label)
            continue
        # per-step losses of small batches are noisy: faint raw curve, bold moving average over 5 logs
        (raw,) = ax.plot(steps, losses, linewidth=0.8, alpha=0.3)
        k = 5
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, style, linewidth=1.8, color=raw.get_color(), label=f"{label} (mean of last {k})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (answer tokens)")
    ax.set_title(title or "LoRA fine-tuning loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, out)


def plot_gnmr_heatmap(trace: str | os.PathLike, out: str | os.PathLike, title: str | None = None) -> Path:
    """Draw a units x steps heat map of GNMR (log colour scale) with the active set marked.

    Each cell is one unit's GNMR at one step (non-finite values drawn at the top of the scale); a
    black dot marks a unit that ran that step on the recovery path (BF16).

    Args:
        trace: a ``gnmr_trace.jsonl``.
        out: the PNG to write (its folder is created).
        title: figure title.
    """
    require("matplotlib", "Plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    steps, gnmr, active = trace_matrices(read_trace(trace))
    values = np.array(gnmr, dtype=float)  # [units, steps]
    finite = values[np.isfinite(values) & (values > 0)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.5, 2.0)
    # symmetric around GNMR = 1 on a log scale, so "above its own history" reads as one colour
    span = max(abs(math.log10(lo)), abs(math.log10(hi)), math.log10(1.5))
    norm = LogNorm(vmin=10 ** -span, vmax=10 ** span)
    shown = np.where(np.isfinite(values) & (values > 0), values, 10 ** span)

    num_units, num_steps = values.shape
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.12 * num_steps + 3), min(10, 2 + 0.18 * num_units)), dpi=120)
    extent = (steps[0] - 0.5, steps[-1] + 0.5, num_units - 0.5, -0.5)
    image = ax.imshow(shown, aspect="auto", cmap="coolwarm", norm=norm, interpolation="nearest", extent=extent)
    ys, xs = np.nonzero(np.array(active))
    if ys.size:
        ax.scatter(np.array(steps)[xs], ys, s=10, c="black", marker="o")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("unit (decoder layer)")
    # the key to the dots goes in the title: a legend box would hide cells
    ax.set_title((title or "GNMR per unit and step")
                 + f"\nblack dot: unit on the BF16 recovery path in that step ({ys.size} unit-steps)", fontsize=10)
    bar = fig.colorbar(image, ax=ax, label="GNMR (gradient norm / mean of its history)")
    ticks = [t for t in (0.1, 0.2, 0.5, 0.67, 1.0, 1.5, 2.0, 5.0, 10.0) if 10 ** -span <= t <= 10 ** span]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    return save_figure(fig, out)


def _wrap_to(text, width_px: float, renderer) -> None:
    """Re-wrap a title ``Text`` (each of its lines) so that it is no wider than ``width_px``."""
    import textwrap

    box = text.get_window_extent(renderer)
    if not text.get_text() or box.width <= width_px:
        return
    lines = text.get_text().split("\n")
    chars = max(12, int(max(len(line) for line in lines) * width_px / box.width * 0.95))
    text.set_text("\n".join(textwrap.fill(line, chars) if len(line) > chars else line for line in lines))


def fit_text(fig) -> None:
    """Wrap every axes title to its axes' width and the figure title to the figure's, then lay out, so
    that titles, labels and legends lie inside the figure at its saved size."""
    renderer = fig.canvas.get_renderer()
    fig_w = fig.get_window_extent(renderer).width
    for ax in fig.axes:
        width = ax.get_window_extent(renderer).width
        for text in (ax.title, ax._left_title, ax._right_title):
            _wrap_to(text, width if ax.get_label() != "<colorbar>" else fig_w, renderer)
    if fig._suptitle is not None:
        _wrap_to(fig._suptitle, 0.98 * fig_w, renderer)
    fig.tight_layout()


def texts_outside(fig) -> list[str]:
    """The visible texts (titles, labels, tick labels, legend entries) that reach outside the figure, as
    drawn: what a reader of the PNG would see cut off. Empty when everything fits."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.get_window_extent(renderer)
    undrawn = set()  # labels of ticks outside an axis' view limits: kept by matplotlib, never drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            drawn = {id(t) for t in axis._update_ticks()}
            undrawn |= {id(lab) for t in axis.get_major_ticks() + axis.get_minor_ticks() if id(t) not in drawn
                        for lab in (t.label1, t.label2)}
    bad = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < frame.x0 - 1 or box.y0 < frame.y0 - 1 or box.x1 > frame.x1 + 1 or box.y1 > frame.y1 + 1:
            bad.append(text.get_text())
    return bad


def save_figure(fig, out: str | os.PathLike, dpi: float | None = None) -> Path:
    """Fit the texts (:func:`fit_text`), write and close a figure (the folder is created); the path."""
    import matplotlib.pyplot as plt

    fit_text(fig)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, **({} if dpi is None else {"dpi": dpi}))
    plt.close(fig)
    return out
