"""Tables and plot of the activation-quantisation stress bench, in the paper's layouts.

    python recipes/stress/report.py runs/stress/bench --out docs/stress_tables.md --plot docs/stress_loss.png

reads ``<run>/result.json`` and ``<run>/metrics.jsonl`` of every run folder under the given folder(s)
(written by ``pretrain.py``) and prints:

- validation perplexity per method (paper Table 1 / Table 10);
- GNMR and Delta-GNMR threshold exceedance rates (Table 3);
- the matched-trigger table: final PPL, promotion ratio, hit-maxO rate, step time, peak memory (Table 11);

and draws the validation loss per method against the optimizer step (PNG).

With ``--seeds`` (several seeds per method, e.g. the MX bench of ``bench/stress/mx_llama_bench.sh``) it prints
one row per method instead: runs with spikes, divergences, final validation loss (median [min, max]),
its difference from BF16's on the same seed (median [min, max]; same initial weights and data order), promotion ratio, hit-maxO rate, exceedance rates and wall time (medians over seeds), and plots the
median validation curve per method with its min-max band. A spike is a maximal run of steps whose
training loss is non-finite or above ``--spike-factor`` times the running minimum of the earlier
steps' losses; a run diverged when a loss is non-finite or the mean of its last 20 losses is above
that factor times its minimum (``mx_proxy.detect_spikes`` / ``mx_proxy.diverged``, with the factor
set for cross-entropy losses rather than the proxy's MSE). Spikes need a training loss every step
(``train.logging_steps=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ORDER = ("fixed4", "gnmr", "fixed8", "bf16", "adapt", "gsnr", "random")
LABELS = {
    "fixed4": "4-bit",
    "gnmr": "4-bit/8-bit GNMR+Δ",
    "fixed8": "8-bit",
    "bf16": "16-bit (BF16)",
    "adapt": "ADAPT-style static 4/8",
    "gsnr": "GSNR ranking 4/8",
    "random": "Random ranking 4/8",
}
# on an MX low path (``--low mxfp4``): MX layers, up to max_active of them on the BF16 path
MX_ORDER = ("fixed", "gnmr", "random", "gsnr", "adapt", "bf16")
MX_LABELS = {
    "fixed": "MX (fixed)",
    "gnmr": "GNMR+Δ",
    "random": "Random ranking",
    "gsnr": "GSNR ranking",
    "adapt": "ADAPT-style static",
    "bf16": "BF16",
}


def load_result(run_dir: str | Path) -> dict:
    """``result.json`` of one run, with its eval curve re-read from ``metrics.jsonl`` (or its ``.gz``)."""
    from gnmr_hf.reporting.stored import exists, open_text

    run_dir = Path(run_dir)
    res = json.loads((run_dir / "result.json").read_text())
    curve, train = {}, {}
    metrics = run_dir / "metrics.jsonl"
    if exists(metrics):
        with open_text(metrics) as f:
            lines = f.read().splitlines()
        for line in lines:
            rec = json.loads(line)
            if "eval_loss" in rec:
                curve[rec["step"]] = rec["eval_loss"]
            if "train_loss" in rec:
                train[rec["step"]] = rec["train_loss"]
    curve[res["config"]["train"]["max_steps"]] = res["final_eval_loss"]
    res["curve"] = sorted(curve.items())
    res["train_curve"] = sorted(train.items())
    res["run_dir"] = str(run_dir)
    return res


def _sorted(results: list[dict]) -> list[dict]:
    return sorted(results, key=lambda r: (ORDER.index(r["method"]) if r["method"] in ORDER else 99, r["run_dir"]))


def _ppl(r: dict) -> str:
    p = r["final_ppl"]
    return "✗" if not math.isfinite(p) else f"{p:.2f}"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M tokens" if n >= 1e5 else f"{n} tokens"


def table_ppl(results: list[dict]) -> str:
    """Paper Table 1 / 10: final validation perplexity per method."""
    tokens = _tokens(results[0]["tokens"]) if results else ""
    lines = [
        f"| precision | α_t | β_t | val. PPL ({tokens}) | val. loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in _sorted(results):
        g = r["config"]["gnmr"]
        a_b = (f"{g.get('alpha_init') or g['alpha']}→{g['alpha']}", str(g["beta"])) if r["method"] == "gnmr" else ("N.A.", "N.A.")
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {a_b[0]} | {a_b[1]} | {_ppl(r)} | {r['final_eval_loss']:.4f} |")
    return "\n".join(lines)


def table_exceedance(results: list[dict]) -> str:
    """Paper Table 3: share of unit-steps over the GNMR (alpha_t) and Delta-GNMR (beta_t) thresholds."""
    lines = ["| run | units | α_t | β_t | GNMR | Δ-GNMR |", "| --- | --- | --- | --- | --- | --- |"]
    for r in _sorted(results):
        s = r.get("policy_summary")
        if not s:
            continue
        g = r["config"]["gnmr"]
        lines.append(
            f"| {LABELS.get(r['method'], r['method'])}{' (monitor)' if r.get('monitor_only') else ''} | {r['num_units']} | {g.get('alpha_init') or g['alpha']}→{g['alpha']} | "
            f"{g['beta']} | {100 * s['gnmr_exceedance_rate']:.3f}% | {100 * s['delta_exceedance_rate']:.3f}% |"
        )
    return "\n".join(lines)


def table_matched(results: list[dict]) -> str:
    """Paper Table 11: the triggers under the same actuator and max_active budget."""
    lines = [
        "| Trigger | Final PPL | Promotion Ratio | Hit-maxO | Switches | Step Time (s) | Peak saved act. (MB) | Peak RSS (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in _sorted(results):
        s = r.get("policy_summary")
        monitor = r.get("monitor_only", not s)
        pr, hm, sw = ("–", "–", "–") if monitor else (f"{s['promotion_ratio']:.4f}", f"{s['hit_max_rate']:.4f}", str(s["switches"]))
        mem = r.get("peak_cuda_MB") or r["peak_rss_MB"]
        lines.append(
            f"| {LABELS.get(r['method'], r['method'])} | {_ppl(r)} | {pr} | {hm} | {sw} | {r['step_time_s']:.3f} | "
            f"{r['peak_saved_act_MB']:.2f} | {mem:.0f} |"
        )
    return "\n".join(lines)


def _setting(results: list[dict]) -> tuple[dict, dict, dict, dict]:
    """The first run and its model, data and train config sections."""
    if not results:
        raise ValueError("no results to report")
    r0 = results[0]
    return r0, r0["config"]["model"], r0["config"]["data"], r0["config"]["train"]


def render(results: list[dict]) -> str:
    r0, m, d, t = _setting(results)
    head = (
        f"Model: LLaMA, hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_attention_heads']} heads, "
        f"{m['num_hidden_layers']} layers ({r0['num_units']} projection units), vocab {r0['data']['vocab_size']}, "
        f"seq {d['seq_len']}; {t['max_steps']} steps x {t['batch_size'] * t['gradient_accumulation_steps']} sequences = "
        f"{_tokens(r0['tokens'])}; max_active {r0['max_active']}; validation {r0['data']['val_blocks']} x {d['seq_len']} tokens."
    )
    return "\n\n".join([
        head,
        "**Validation perplexity (paper Table 1 / 10)**",
        table_ppl(results),
        "**Threshold exceedance (paper Table 3)**: share of unit-steps with GNMR ≥ α_t and Δ-GNMR ≥ β_t",
        table_exceedance(results),
        "**Matched-trigger comparison (paper Table 11)**: same 4-bit/8-bit actuator and max_active budget",
        table_matched(results),
    ]) + "\n"


def _label(r: dict) -> str:
    if r.get("low", "act") != "act":
        return r["low"] if r["method"] == "fixed" else MX_LABELS.get(r["method"], r["method"])
    return LABELS.get(r["method"], r["method"])


def _by_method(results: list[dict]) -> dict[str, list[dict]]:
    order = MX_ORDER if any(r.get("low", "act") != "act" for r in results) else ORDER
    groups: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: (order.index(r["method"]) if r["method"] in order else 99, r["run_dir"])):
        groups.setdefault(r["method"], []).append(r)
    return groups


def instability(r: dict, factor: float) -> tuple[int, bool]:
    """(number of spikes, diverged) of one run from its per-step training losses (see the module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from mx_proxy import detect_spikes, diverged
    finally:
        sys.path.pop(0)
    steps = [s for s, _ in r["train_curve"]]
    if steps != list(range(1, r["config"]["train"]["max_steps"] + 1)):
        raise ValueError(f"{r['run_dir']}: spikes need a training loss at every step (train.logging_steps=1); "
                         f"found {len(steps)} of {r['config']['train']['max_steps']}")
    losses = [v for _, v in r["train_curve"]]
    return len(detect_spikes(losses, factor)), diverged(losses, factor)


def _median_range(values: list[float], spec: str = ".4f") -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}, {max(values):{spec}}]"


def table_seeds(results: list[dict], spike_factor: float = 1.2) -> str:
    """One row per method over its seeds: instability, final validation loss, the trigger's statistics."""
    lines = [
        "| method | seeds | runs with spikes (spikes) | diverged | final val. loss, median [min, max] | − BF16, same seed | "
        "promotion ratio | hit-maxO | GNMR ≥ α | Δ ≥ β | wall (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups = _by_method(results)
    # the paired difference against BF16 on the same seed (same initial weights and data order)
    bf16 = {r["config"]["train"]["seed"]: r["final_eval_loss"] for r in groups.get("bf16", [])}
    for method, runs in groups.items():
        paired = [r["final_eval_loss"] - bf16[r["config"]["train"]["seed"]] for r in runs
                  if method != "bf16" and r["config"]["train"]["seed"] in bf16]
        paired_cell = (f"{statistics.median(paired):+.4f} [{min(paired):+.4f}, {max(paired):+.4f}]"
                       if paired else "–")
        inst = [instability(r, spike_factor) for r in runs]
        spiky = sum(1 for n, _ in inst if n)
        summaries = [r["policy_summary"] for r in runs if r.get("policy_summary")]
        monitor = all(r.get("monitor_only") for r in runs) or method == "bf16"

        def med(key: str, pct: bool = False, summaries=summaries) -> str:
            vals = [s[key] for s in summaries]
            if not vals:
                return "–"
            v = statistics.median(vals)
            return f"{100 * v:.1f}%" if pct else f"{v:.3f}"

        lines.append(
            f"| {_label(runs[0])} | {len(runs)} | {spiky} ({sum(n for n, _ in inst)}) | {sum(d for _, d in inst)} | "
            f"{_median_range([r['final_eval_loss'] for r in runs])} | {paired_cell} | "
            f"{'–' if monitor else med('promotion_ratio')} | "
            f"{'–' if monitor else med('hit_max_rate')} | {med('gnmr_exceedance_rate', True)} | "
            f"{med('delta_exceedance_rate', True)} | {statistics.median(r['wall_s'] for r in runs):.0f} |"
        )
    return "\n".join(lines)


def render_seeds(results: list[dict], spike_factor: float = 1.2) -> str:
    r0, m, d, t = _setting(results)
    head = (
        f"Model: LLaMA, hidden {m['hidden_size']}, {m['num_hidden_layers']} layers ({r0['num_units']} units), low path "
        f"{r0.get('low', 'act')}; {t['max_steps']} steps x {t['batch_size'] * t['gradient_accumulation_steps']} sequences "
        f"x {d['seq_len']} tokens, lr {t['learning_rate']}; max_active {r0['max_active']}; validation loss per token "
        f"on {r0['data']['val_blocks']} x {d['seq_len']} tokens, on the path in effect. Spike: training loss above "
        f"{spike_factor} x its running minimum."
    )
    return head + "\n\n" + table_seeds(results, spike_factor) + "\n"


def plot_seeds(results: list[dict], path: str | Path) -> None:
    """Median validation loss per method against the step, with the min-max band over seeds."""

    def draw(ax) -> None:
        for runs in _by_method(results).values():
            steps = sorted(set.intersection(*(set(s for s, _ in r["curve"]) for r in runs)))
            per_step = [[dict(r["curve"])[s] for r in runs] for s in steps]
            line, = ax.plot(steps, [statistics.median(v) for v in per_step], marker="o", ms=2.5, lw=1.2,
                            label=f"{_label(runs[0])} ({len(runs)} seeds)")
            ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=line.get_color(),
                            alpha=0.15)

    _loss_figure(draw, path, "validation loss per token", "Stress bench: median and min-max over seeds")


def _loss_figure(draw, path: str | Path, ylabel: str, title: str) -> None:
    """A loss-against-step PNG: ``draw(ax)`` adds the lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.reporting.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    draw(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)  # titles wrapped to fit, then laid out


def plot(results: list[dict], path: str | Path) -> None:
    """Validation loss per method against the optimizer step."""

    def draw(ax) -> None:
        for r in _sorted(results):
            steps, losses = zip(*r["curve"])
            ax.plot(steps, losses, marker="o", ms=2.5, lw=1.2, label=LABELS.get(r["method"], r["method"]))

    _loss_figure(draw, path, "validation loss", "Saved-activation quantisation stress bench")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Tables and plot of the stress bench")
    p.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    p.add_argument("--out", help="write the Markdown here as well as to stdout")
    p.add_argument("--plot", help="PNG of the validation loss per method")
    p.add_argument("--seeds", action="store_true", help="one row per method over several seeds (runs found recursively)")
    p.add_argument("--spike-factor", type=float, default=1.2,
                   help="with --seeds: a spike is a training loss above this factor x its running minimum (default 1.2)")
    a = p.parse_args(argv)
    dirs: list[Path] = []
    for d in map(Path, a.runs):
        found = d.rglob("result.json") if a.seeds else d.glob("*/result.json")
        dirs.extend([d] if (d / "result.json").is_file() else sorted(x.parent for x in found))
    if not dirs:
        p.error(f"no result.json under {', '.join(a.runs)}")
    results = [load_result(d) for d in dirs]
    md = render_seeds(results, a.spike_factor) if a.seeds else render(results)
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    if a.plot:
        (plot_seeds if a.seeds else plot)(results, a.plot)


if __name__ == "__main__":
    main()
