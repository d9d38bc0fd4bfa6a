"""What the demo prints and writes at the end: one row per run, the comparison table and the notes under it
(``summary.md`` / ``summary.json``), the plots, and each phase's wall and CPU time (``timings.json``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from gnmr_hf.demo.config import GNMR_PRECISIONS, LOW_NAME, SUFFIX
from gnmr_hf.reporting.plots import plot_gnmr_heatmap, plot_loss_curves, save_figure


def add_gap_closed(rows: list[dict[str, Any]]) -> None:
    """Each row's ``gap_closed``: ``(L_nf4 - L) / (L_nf4 - L_bf16)`` of the held-out losses, against the rows
    named ``nf4`` and ``bf16`` (0: as NF4 QLoRA, 1: as BF16 LoRA), and ``over_nf4``: its served weights' bytes
    over the nf4 row's, minus 1. None where a reference or the row's own figure is missing (or the references
    tie)."""
    by = {r["run"]: r for r in rows}
    lo, hi = by.get("nf4", {}), by.get("bf16", {})
    l_lo, l_hi, w_lo = lo.get("heldout_loss"), hi.get("heldout_loss"), lo.get("weights_bytes")
    for r in rows:
        loss, w = r.get("heldout_loss"), r.get("weights_bytes")
        r["gap_closed"] = (None if None in (loss, l_lo, l_hi) or l_lo == l_hi or r["run"].startswith("base")
                           else (l_lo - loss) / (l_lo - l_hi))
        r["over_nf4"] = None if w is None or not w_lo else w / w_lo - 1


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def comparison_rows(out: Path, precisions: list[str], evals: dict[str, dict[str, Any]],
                    heldout: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per run (plus the untuned base when it was evaluated or scored): training and eval figures, the
    dtype each run computed in (``compute_dtype``: training, from its run.json; ``eval_compute_dtype``), and where
    ``heldout`` holds it (:func:`score_heldout`) the held-out loss, the served weights' bytes, the gap closed and
    the memory over NF4 (:func:`add_gap_closed`)."""
    heldout = heldout or {}

    def held(name: str) -> dict[str, Any]:
        h = heldout.get(name)
        return {} if h is None else {"heldout_loss": h["loss"], "heldout_tokens": h["tokens"],
                                     "weights_bytes": h["weights_bytes"], "served_on": h["served_on"]}

    rows = []
    if "base" in evals or "base" in heldout:
        rows.append({"run": "base (no fine-tune)", **evals.get("base", {}), **held("base")})
    for p in precisions:
        record = json.loads((out / p / "run.json").read_text())
        summary = (record.get("gnmr_summary") or {}).get("summary") or {}
        steps = record["global_step"]
        loop = record.get("train_runtime_s")  # the Trainer's loop: no load, profile or init
        plan = (record.get("profile") or {}).get("plan") or {}
        setup = [plan.get("profile_seconds"), (record.get("calibrated_init") or {}).get("seconds")]
        rows.append({
            "run": p,
            "steps": steps,
            "first_loss": record["first_loss"],
            "final_loss": record["final_loss"],
            "wall_time_s": record["wall_time_s"],
            "step_time_s": loop / steps if steps and loop is not None else None,
            "setup_s": sum(x for x in setup if x) if any(x is not None for x in setup) else None,
            "peak_memory_mib": record["peak_memory_bytes"] / 2**20,
            "promotion_ratio": summary.get("promotion_ratio"),
            "compute_dtype": (record.get("config") or {}).get("script", {}).get("compute_dtype"),
            "plan": (record.get("profile") or {}).get("plan"),
            **evals.get(p, {}),
            **held(p),
        })
    if heldout:
        add_gap_closed(rows)
    return rows


def format_comparison(rows: list[dict[str, Any]], memory_kind: str) -> str:
    """The comparison as a Markdown table; the held-out columns (loss, gap closed, served weights, over NF4)
    where any row has a held-out loss."""
    with_heldout = any(r.get("heldout_loss") is not None for r in rows)
    header = ["run", "steps", "loss first -> last", "wall time (s)", "step time (s)", "profile + init (s)",
              f"peak mem (MiB, {memory_kind})"]
    if with_heldout:
        header += ["held-out loss", "gap closed", "served weights (MiB)", "over NF4 (%)"]
    header += ["GSM8K EM strict (%)", "GSM8K EM flexible (%)", "MMLU acc (%)", "HellaSwag acc (%)",
               "WikiText-2 word PPL", "GNMR promotion ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        def pct(key: str, r: dict[str, Any] = r) -> str:
            return _fmt(None if r.get(key) is None else 100 * r[key], ".2f")

        loss = "-" if r.get("final_loss") is None else f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}"
        cells = [r["run"], _fmt(r.get("steps"), "d"), loss, _fmt(r.get("wall_time_s"), ".0f"),
                 _fmt(r.get("step_time_s"), ".2f"), _fmt(r.get("setup_s"), ".0f"), _fmt(r.get("peak_memory_mib"), ".0f")]
        if with_heldout:
            w = r.get("weights_bytes")
            cells += [_fmt(r.get("heldout_loss"), ".4f"), _fmt(r.get("gap_closed"), ".3f"),
                      _fmt(None if w is None else w / 2**20, ".1f"),
                      _fmt(None if r.get("over_nf4") is None else 100 * r["over_nf4"], "+.1f")]
        cells += [pct("gsm8k_em"), pct("gsm8k_em_flexible"), pct("mmlu_acc"), pct("hellaswag_acc"),
                  _fmt(r.get("wikitext_word_ppl"), ".3f"), _fmt(r.get("promotion_ratio"), ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings_lines(rows: list[dict[str, Any]], dtype: str, reason: str, eval_settings: str | None) -> list[str]:
    """The lines under the table: what the runs computed in (and why), and how they were evaluated."""
    trained = sorted({r["compute_dtype"] for r in rows if r.get("compute_dtype")})
    lines = [f"Training compute dtype: {', '.join(trained) or dtype} ({reason})."]
    if len(trained) > 1:
        each = ", ".join(f"{r['run']} {r['compute_dtype']}" for r in rows if r.get("compute_dtype"))
        lines[0] += f" The runs differ: {each}."
    for r in rows:
        plan = r.get("plan")
        if plan and plan.get("rung_counts"):
            counts = ", ".join(f"{n} on {rung.upper()}" for rung, n in plan["rung_counts"].items())
            made = (f"the plan of {Path(plan['plan_file']).parent.name}'s profile, read with profile.plan (nothing "
                    "profiled again)" if plan.get("plan_file") else
                    f"planned by a {plan.get('criterion')} profile of the first training batches "
                    f"({plan.get('profile_seconds', 0):.0f} s)")
            budget = f" under {plan['budget']}" if plan.get("budget") else ""
            lines.append(f"{r['run']}: the precision ladder{budget}: {counts}, the other linears NF4; {made}; its "
                         "profile.json holds the rungs gnmr_hf.load_planned serves.")
        elif plan:
            lines.append(f"{r['run']}: {len(plan.get('indices') or [])} linears kept on BF16 "
                         f"({100 * plan['bytes'] / plan['total_bytes']:.1f} % extra bytes over the quantised weights' "
                         f"BF16 size), planned by a {plan['criterion']} profile of the first training batches "
                         f"({plan.get('profile_seconds', 0):.0f} s); its profile.json holds the llm_int8_skip_modules "
                         "list that serves the same mixed base with stock transformers.")
    if eval_settings:
        lines.append(f"Evaluation: {eval_settings}.")
    return lines


def _cpu_seconds() -> float | None:
    """CPU seconds of this process and its finished children (the training runs); None without ``resource``."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class PhaseTimer:
    """Wall and CPU seconds of each phase of the demo (CPU time is what the phase itself used; on a machine
    shared with other jobs the wall time is longer)."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []
        self._start: tuple[float, float | None] | None = None

    def start(self) -> None:
        self._start = (time.time(), _cpu_seconds())

    def stop(self, name: str, note: str = "") -> dict[str, Any]:
        assert self._start is not None, "start() first"
        wall0, cpu0 = self._start
        cpu1 = _cpu_seconds()
        phase = {"phase": name, "wall_s": round(time.time() - wall0, 1),
                 "cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 1), "note": note}
        self.phases.append(phase)
        self._start = None
        return phase

    def table(self) -> str:
        lines = [f"  {'phase':<28} {'wall (s)':>9} {'CPU (s)':>9}"]
        for p in self.phases:
            cpu = "-" if p["cpu_s"] is None else f"{p['cpu_s']:.0f}"
            lines.append(f"  {p['phase']:<28} {p['wall_s']:>9.0f} {cpu:>9}" + (f"  {p['note']}" if p["note"] else ""))
        return "\n".join(lines)


def plot_value(rows: list[dict[str, Any]], path: Path) -> Path:
    """What each run buys: its held-out loss (left) and gap closed (right) against its served weights' memory
    over NF4, one labelled point per run; the NF4 and BF16 runs' losses as reference lines."""
    import matplotlib  # the [all] extra, loaded only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("heldout_loss") is not None and r.get("over_nf4") is not None
           and not r["run"].startswith("base")]
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(12, 4.8))
    placed: dict[tuple[int, str], int] = {}  # runs at one point (nf4 and a gnmr-nf4 that promoted nothing): stacked

    def label(ax, x: float, y: float, text: str, which: str) -> None:
        k = placed.get((round(x), f"{which}{y:.3f}"), 0)
        placed[(round(x), f"{which}{y:.3f}")] = k + 1
        ax.scatter([x], [y])
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4 + 10 * k), fontsize=8)

    for r in pts:
        x = 100 * r["over_nf4"]
        label(ax_l, x, r["heldout_loss"], r["run"], "loss")
        if r.get("gap_closed") is not None:
            label(ax_g, x, r["gap_closed"], r["run"], "gap")
    by = {r["run"]: r for r in pts}
    for name, style in (("nf4", ":"), ("bf16", "--")):
        if name in by:
            ax_l.axhline(by[name]["heldout_loss"], linestyle=style, color="grey", linewidth=1, label=name)
    ax_g.axhline(0, linestyle=":", color="grey", linewidth=1, label="as NF4")
    ax_g.axhline(1, linestyle="--", color="grey", linewidth=1, label="as BF16")
    ax_l.set(xlabel="served weights over NF4 (%)", ylabel="held-out loss (per response token)",
             title="Held-out loss (never-trained GSM8K test problems)")
    ax_g.set(xlabel="served weights over NF4 (%)", ylabel="gap closed (L_nf4 - L) / (L_nf4 - L_bf16)",
             title="NF4-to-BF16 gap closed")
    for ax in (ax_l, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct LoRA: what each recipe buys over NF4 QLoRA")
    return save_figure(fig, path)


def write_summary(out: Path, compare: str, precisions: list[str], evals: dict[str, dict[str, Any]],
                  heldout: dict[str, dict[str, Any]], dtype: str, reason: str, eval_settings: str | None,
                  heldout_note: str | None) -> tuple[list[dict[str, Any]], str]:
    """``summary.md`` (the table and the notes under it) and ``summary.json`` (the rows, each with the reason for
    its compute dtype) of the comparison ``compare``; returns the rows and the Markdown text."""
    suffix = SUFFIX[compare]
    rows = comparison_rows(out, precisions, evals, heldout)
    memory_kind = "GPU" if json.loads((out / precisions[0] / "run.json").read_text())["device"] == "cuda" else "RSS"
    table = format_comparison(rows, memory_kind)
    notes = settings_lines(rows, dtype, reason, eval_settings)
    if heldout_note:
        notes.append(f"Held-out loss: {heldout_note}.")
    for r in rows:
        r.setdefault("compute_dtype", None)
        r["compute_dtype_reason"] = reason if r["compute_dtype"] == dtype else None
    text = table + "\n\n" + "\n".join(notes)
    (out / f"summary{suffix}.md").write_text(text + "\n")
    (out / f"summary{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows, text


def draw_plots(out: Path, compare: str, precisions: list[str], rows: list[dict[str, Any]]) -> list[Path]:
    """The loss curves, the held-out plot (:func:`plot_value`, with an nf4 run) and the GNMR heat map of a
    controller run; one set of names per comparison, so all of them can share one ``--out`` folder."""
    suffix, low = SUFFIX[compare], LOW_NAME[compare]
    plots = [plot_loss_curves({p: out / p for p in precisions}, out / f"loss_curves{suffix}.png",
                              title=f"SmolLM2-135M-Instruct LoRA on generated GSM8K-style problems "
                                    f"(BF16 vs {low})")]
    if any(r.get("heldout_loss") is not None and r.get("over_nf4") is not None for r in rows):  # with an nf4 run
        plots.append(plot_value(rows, out / f"heldout{suffix}.png"))
    for p in precisions:
        if p in GNMR_PRECISIONS:
            plots.append(plot_gnmr_heatmap(out / p / "gnmr_trace.jsonl", out / f"gnmr_heatmap{suffix}.png",
                                           title=f"GNMR per decoder layer (SmolLM2-135M, {low} + BF16 recovery)"))
    return plots
