"""Tables and heat maps from MX proxy runs (the JSONs of recipes/stress/mx_proxy.py).

    python recipes/stress/mx_report.py bench/results/mx_sweep bench/results/mx_methods --only bf16,fixed
    python recipes/stress/mx_report.py bench/results/mx_methods --methods      # GNMR vs the baselines
    python recipes/stress/mx_report.py bench/results/mx_oracle --oracle --heatmap docs/mx_gap_heatmap.png

Outcome codes per seed: ``.`` no spike, ``S<n>`` n spikes, ``D`` diverged (``D`` wins over ``S``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

SWEEP_KEYS = ("width", "depth", "batch", "lr", "fmt", "steps", "method", "cosine", "teacher_std", "quantize_norms")
METHOD_ORDER = ("bf16", "fixed", "gnmr", "random", "adapt", "gsnr")


def load_runs(folder: str | Path) -> list[dict[str, Any]]:
    """Every finished run JSON in ``folder`` (sorted by name)."""
    runs = []
    for path in sorted(Path(folder).glob("*.json")):
        run = json.loads(path.read_text())
        run["_name"] = path.stem
        runs.append(run)
    return runs


def outcome(run: dict[str, Any]) -> str:
    """``D`` (diverged), ``S<n>`` (n spikes) or ``.`` (clean)."""
    if run["diverged"]:
        return "D"
    return f"S{run['n_spikes']}" if run["n_spikes"] else "."


def val_train_path(run: dict[str, Any]) -> float:
    """Final validation loss on the training path; for a BF16 run that is the BF16 path by definition
    (runs written before the training-path column existed)."""
    if "final_val_loss_train_path" in run:
        return run["final_val_loss_train_path"]
    return run["final_val_loss"] if run["config"]["method"] == "bf16" else math.nan


def unstable(run: dict[str, Any]) -> bool:
    return bool(run["diverged"] or run["n_spikes"])


def _fmt(v: float | None, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _median_range(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def sweep_table(runs: list[dict[str, Any]]) -> str:
    """One row per configuration (seeds pooled): outcome per seed, unstable seeds, best/final losses."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        cfg = dict(run["config"])
        if cfg["method"] == "bf16":  # the MX settings do not touch an all-BF16 run
            cfg["fmt"], cfg["quantize_norms"] = "bf16", False
        groups.setdefault(tuple(cfg[k] for k in SWEEP_KEYS), []).append(run)
    lines = ["| width | depth | batch | lr | format | steps | method | cosine | teacher std | norms quantised "
             "| outcome per seed | unstable | min train loss, median [range] | final val loss, training path, "
             "median [range] | final val loss, BF16 path, median [range] | wall s (median) |",
             "|" + "---|" * 16]
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k[:6]) + (_method_rank(k[6]),)):
        rs = sorted(groups[key], key=lambda r: r["config"]["seed"])
        cells = [str(key[0]), str(key[1]), str(key[2]), f"{key[3]:g}", key[4], str(key[5]), key[6],
                 "yes" if key[7] else "no", f"{key[8]:g}", "-" if key[6] == "bf16" else ("yes" if key[9] else "no"),
                 " ".join(f"{r['config']['seed']}:{outcome(r)}" for r in rs),
                 f"{sum(unstable(r) for r in rs)}/{len(rs)}",
                 _median_range([r["min_train_loss"] for r in rs]),
                 _median_range([val_train_path(r) for r in rs]),
                 _median_range([r["final_val_loss"] for r in rs]),
                 f"{statistics.median(r['wall_time_s'] for r in rs):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _method_rank(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def methods_table(runs: list[dict[str, Any]]) -> str:
    """GNMR against the baselines at one setting: one row per method, seeds pooled."""
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        by_method.setdefault(run["config"]["method"], []).append(run)
    lines = ["| method | seeds | runs with spikes | diverged | final val loss, training path, median [range] "
             "| final val loss, BF16 path, median [range] | min train loss, median | promotion ratio "
             "| hit-maxO rate | GNMR exceed. | Delta exceed. | wall s, median [range] |",
             "|" + "---|" * 12]
    for method in sorted(by_method, key=_method_rank):
        rs = by_method[method]
        def mean(key: str, rs: list[dict] = rs) -> float | None:
            return statistics.mean(r[key] for r in rs) if rs[0].get(key) is not None else None

        cells = [method, str(len(rs)), f"{sum(bool(r['n_spikes']) for r in rs)}/{len(rs)}",
                 f"{sum(bool(r['diverged']) for r in rs)}/{len(rs)}",
                 _median_range([val_train_path(r) for r in rs]),
                 _median_range([r["final_val_loss"] for r in rs]),
                 _fmt(statistics.median(r["min_train_loss"] for r in rs), ".4g"),
                 _fmt(statistics.mean(r["promotion_ratio"] for r in rs), ".3f"),
                 _fmt(mean("hit_max_rate"), ".3f"), _fmt(mean("gnmr_exceedance_rate"), ".3f"),
                 _fmt(mean("delta_exceedance_rate"), ".3f"),
                 _median_range([r["wall_time_s"] for r in rs])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed_table(runs: list[dict[str, Any]], key: str = "min_train_loss") -> str:
    """One row per method, one column per seed: the value of ``key`` (paired comparisons by seed)."""
    seeds = sorted({r["config"]["seed"] for r in runs})
    by = {(r["config"]["method"], r["config"]["seed"]): r for r in runs}
    methods = sorted({r["config"]["method"] for r in runs}, key=_method_rank)
    lines = [f"| method | {' | '.join(f'seed {s}' for s in seeds)} |", "|" + "---|" * (len(seeds) + 1)]
    for m in methods:
        cells = [_fmt(by[(m, s)][key], ".4g") if (m, s) in by else "-" for s in seeds]
        lines.append(f"| {m} | {' | '.join(cells)} |")
    return "\n".join(lines)


def oracle_table(runs: list[dict[str, Any]]) -> str:
    """Per trigger, how close its recovery set comes to the oracle's (runs with ``--oracle``)."""
    lines = ["| method | seed | steps scored | precision@maxO | precision of the chosen | recall "
             "| captured-gap fraction | oracle's captured fraction | mean BF16 blocks | mean gap |",
             "|" + "---|" * 10]
    for run in sorted((r for r in runs if "oracle" in r), key=lambda r: (_method_rank(r["config"]["method"]),
                                                                          r["config"]["seed"])):
        o = run["oracle"]
        gaps = [g for row in run["per_unit"]["gap"] for g in row if math.isfinite(g)]
        cells = [run["config"]["method"], str(run["config"]["seed"]), _fmt(o.get("steps"), ".0f"),
                 _fmt(o.get("precision_at_k"), ".3f"), _fmt(o.get("precision"), ".3f"), _fmt(o.get("recall"), ".3f"),
                 _fmt(o.get("captured"), ".3f"), _fmt(o.get("oracle_captured"), ".3f"), _fmt(o.get("n_chosen"), ".2f"),
                 _fmt(statistics.mean(gaps) if gaps else None, ".3g")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def insitu_table(runs: list[dict[str, Any]]) -> str:
    """Runs resumed from another run's checkpoint with a changed precision, beside that run: the losses
    after the switch step only."""
    resumed = [r for r in runs if r.get("resumed_from")]
    if not resumed:
        return "no resumed runs"
    at = resumed[0]["resumed_from"]["step"]
    lines = [f"| run | from step | min train loss after the switch (every 10th step; step {at} without one) | spikes "
             "| final val loss, training path "
             "| final val loss, BF16 path | BF16 share after the switch |", "|" + "---|" * 7]
    for r in sorted(runs, key=lambda r: (r.get("resumed_from") is not None, _method_rank(r["config"]["method"]))):
        start = r["resumed_from"]["step"] if r.get("resumed_from") else at
        after = [v for s, v in r["losses"] if s > start] if r.get("resumed_from") else [v for s, v in r["losses"] if s > at]
        origin = (f"{r['resumed_from']['method']} ({r['resumed_from']['fmt']}) -> {r['config']['method']}"
                  if r.get("resumed_from") else f"{r['config']['method']} ({r['config']['fmt']}), no switch")
        cells = [origin, str(start) if r.get("resumed_from") else "-", _fmt(min(after) if after else None, ".4g"),
                 str(r["n_spikes"]), _fmt(val_train_path(r), ".4g"), _fmt(r["final_val_loss"], ".4g"),
                 _fmt(r["promotion_ratio"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmap(run: dict[str, Any], path: str | Path) -> None:
    """Per-step recovery gap beside the per-step GNMR of one oracle run (units x steps), with the
    recovery set marked on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from gnmr_hf.reporting.plots import save_figure

    per = run["per_unit"]
    gap = np.array(per["gap"], dtype=float).T  # [U, T]
    panels = [("recovery gap ||g_MX - g_BF16|| / ||g_BF16||", gap)]
    if per.get("gnmr"):
        panels.append(("GNMR", np.array(per["gnmr"], dtype=float).T))
    T = gap.shape[1]
    active = np.zeros_like(gap)
    for t, idx in enumerate(per["active"][:T]):
        active[idx, t] = 1
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.6 + 1.2 * len(panels) * gap.shape[0] / 4),
                             sharex=True, squeeze=False)
    for ax, (title, data) in zip(axes[:, 0], panels):
        im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis")
        ys, xs = np.nonzero(active)
        ax.scatter(xs, ys, s=14, c="red", marker="s", linewidths=0)
        ax.set_ylabel("block")
        ax.set_title(f"{title}; red: on the BF16 path")
        fig.colorbar(im, ax=ax)
    cfg = run["config"]
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{cfg['method']} {cfg['fmt']} d={cfg['width']} L={cfg['depth']} lr={cfg['lr']:g} seed={cfg['seed']}")
    save_figure(fig, path, dpi=120)  # titles wrapped to fit, then laid out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="folders of run JSONs, pooled")
    p.add_argument("--only", help="comma-separated methods to keep (e.g. bf16,fixed)")
    p.add_argument("--methods", action="store_true", help="the GNMR-vs-baselines table instead of the sweep table")
    p.add_argument("--oracle", action="store_true", help="the oracle-agreement table")
    p.add_argument("--insitu", action="store_true", help="the in-situ switch table (resumed runs)")
    p.add_argument("--per-seed", metavar="KEY", help="a method x seed table of one result field (min_train_loss, ...)")
    p.add_argument("--heatmap", help="save the gap/GNMR heat map of the first GNMR oracle run here")
    args = p.parse_args(argv)
    runs = [r for folder in args.folders for r in load_runs(folder)]
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r["config"]["method"] in keep]
    if not runs:
        raise SystemExit(f"no run JSONs in {args.folders}")
    if args.per_seed:
        print(per_seed_table(runs, args.per_seed))
    elif args.insitu:
        print(insitu_table(runs))
    elif args.oracle:
        print(oracle_table(runs))
    elif args.methods:
        print(methods_table(runs))
    else:
        print(sweep_table(runs))
    if args.heatmap:
        pick = [r for r in runs if "oracle" in r and r["config"]["method"] == "gnmr"] or [r for r in runs if "oracle" in r]
        if not pick:
            raise SystemExit("no oracle run for the heat map")
        heatmap(pick[0], args.heatmap)
        print(f"heat map: {args.heatmap} ({pick[0]['_name']})")


if __name__ == "__main__":
    main()
