"""Helper of ``bench/gpu/gpu_paper.sh``: the step count that fits the time budget, GNMR's measured budget, and the
paper's Table 1 layout for the runs.

    python bench/gpu/gpu_paper.py steps OUT/calibrate/result.json --budget-s 360 --runs 4
    python bench/gpu/gpu_paper.py mean-active OUT/gnmr/result.json
    python bench/gpu/gpu_paper.py table OUT/bf16 OUT/fixed4 OUT/gnmr OUT/random_budget
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

LABELS = {
    "fixed4": "4-bit",
    "gnmr": "4-bit/8-bit GNMR+Δ",
    "random_budget": "4-bit/8-bit random at GNMR's budget",
    "fixed8": "8-bit",
    "bf16": "16-bit (BF16)",
}


def fit_steps(calibration: dict, budget_s: float, runs: int, safety: float = 0.85, floor: int = 10) -> int:
    """Optimizer steps per run so that ``runs`` runs of the calibrated step time fit ``budget_s`` seconds of
    training (``safety`` leaves room for the first step's warm-up and the evaluations)."""
    step = calibration.get("step_time_s")
    if not step or step <= 0:
        raise ValueError("the calibration run has no step time")
    return max(floor, int(budget_s * safety / (runs * step)))


def thresholds(res: dict) -> tuple[str, str]:
    """(α_t, β_t) as the paper's Table 1 writes them: N.A. where no threshold selects (fixed precisions, random)."""
    if res["method"] != "gnmr":
        return "N.A.", "N.A."
    g = res["config"]["gnmr"]
    a, a0 = g["alpha"], g.get("alpha_init")
    alpha = f"{a0}→{a}" if a0 not in (None, a) and g.get("init_fraction", 0) else f"{a}"
    return alpha, f"{g['beta']}"


def table(run_dirs: list[str]) -> str:
    """The Table 1 layout (precision, α_t, β_t, validation PPL and loss) with the budget columns beside it."""
    rows = []
    results = [json.loads((Path(d) / "result.json").read_text()) for d in run_dirs]
    tokens = results[0]["tokens"] if results else 0
    head = (f"| precision | α_t | β_t | steps | val. PPL ({tokens / 1e6:.2f}M tokens) | val. loss | mean active units "
            "| promotion ratio | step time (s) | training wall (s) | peak CUDA MiB |")
    rows.append(head)
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        alpha, beta = thresholds(res)
        s = res.get("policy_summary") or {}
        dynamic = not res.get("monitor_only", False)
        ppl = res["final_ppl"]
        cuda = res.get("peak_cuda_MB")
        rows.append(
            f"| {LABELS.get(res['method'], res['method'])} | {alpha} | {beta} | {res['config']['train']['max_steps']} "
            f"| {ppl:.2f} | {res['final_eval_loss']:.4f} "
            f"| {s.get('mean_active', 0.0) if dynamic else 0:.2f} of {res['num_units']} "
            f"| {s.get('promotion_ratio', 0.0) if dynamic else 0:.4f} | {res['step_time_s']:.3f} | {res['wall_s']:.0f} "
            f"| {'-' if cuda is None else f'{cuda:.0f}'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("steps")
    s.add_argument("result")
    s.add_argument("--budget-s", type=float, default=360.0)
    s.add_argument("--runs", type=int, default=4)
    m = sub.add_parser("mean-active")
    m.add_argument("result")
    t = sub.add_parser("table")
    t.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "steps":
        print(fit_steps(json.loads(Path(a.result).read_text()), a.budget_s, a.runs))
    elif a.cmd == "mean-active":
        mean = json.loads(Path(a.result).read_text())["policy_summary"]["mean_active"]
        if not math.isfinite(mean):
            raise SystemExit(f"GNMR's mean active units is {mean}")
        print(f"{mean:.6f}")
    else:
        print(table(a.runs))


if __name__ == "__main__":
    main()
