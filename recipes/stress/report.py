"""Tables and plot of the activation-quantisation stress bench, in the paper's layouts.

    python recipes/stress/report.py runs/stress/bench --out docs/stress_tables.md --plot docs/stress_loss.png

reads ``<run>/result.json`` and ``<run>/metrics.jsonl`` of every run folder under the given folder(s)
(written by ``pretrain.py``) and prints:

- validation perplexity per method (paper Table 1 / Table 10);
- GNMR and Delta-GNMR threshold exceedance rates (Table 3);
- the matched-trigger table: final PPL, promotion ratio, hit-maxO rate, step time, peak memory (Table 11);

and draws the validation loss per method against the optimizer step (PNG).
"""

from __future__ import annotations

import argparse
import json
import math
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


def load_result(run_dir: str | Path) -> dict:
    """``result.json`` of one run, with its eval curve re-read from ``metrics.jsonl``."""
    run_dir = Path(run_dir)
    res = json.loads((run_dir / "result.json").read_text())
    curve = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if "eval_loss" in rec:
                curve[rec["step"]] = rec["eval_loss"]
    curve[res["config"]["train"]["max_steps"]] = res["final_eval_loss"]
    res["curve"] = sorted(curve.items())
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


def render(results: list[dict]) -> str:
    if not results:
        raise ValueError("no results to report")
    r0 = results[0]
    m, d, t = r0["config"]["model"], r0["config"]["data"], r0["config"]["train"]
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


def plot(results: list[dict], path: str | Path) -> None:
    """Validation loss per method against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in _sorted(results):
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, marker="o", ms=2.5, lw=1.2, label=LABELS.get(r["method"], r["method"]))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title("Saved-activation quantisation stress bench")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Tables and plot of the stress bench")
    p.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    p.add_argument("--out", help="write the Markdown here as well as to stdout")
    p.add_argument("--plot", help="PNG of the validation loss per method")
    a = p.parse_args(argv)
    dirs: list[Path] = []
    for d in map(Path, a.runs):
        dirs.extend([d] if (d / "result.json").is_file() else sorted(x.parent for x in d.glob("*/result.json")))
    results = [load_result(d) for d in dirs]
    md = render(results)
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
