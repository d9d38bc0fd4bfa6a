"""Resumable sweep of the MX stress proxy (recipes/stress/mx_proxy.py), one run at a time.

Every combination of the ``--grid`` values is one run, written to ``<out>/<name>.json`` where the
name lists the values; a run whose JSON exists is skipped, so an interrupted sweep continues where
it stopped. Each run is a ``nice`` subprocess with one torch thread, its output in
``<out>/logs/<name>.log``. Start it in the background:

    nohup python bench/stress/mx_sweep.py --out bench/results/mx_sweep \
        --grid width=128 depth=4 batch=256 lr=1e-3,3e-3 steps=1500 fmt=mxfp8_e4m3 \
               method=bf16,fixed seed=0,1,2,3,4 > bench/results/mx_sweep/sweep.log 2>&1 &

Then ``python recipes/stress/mx_report.py bench/results/mx_sweep`` prints the tables.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "recipes" / "stress" / "mx_proxy.py"
# the name of a run lists these keys first, in this order, then any other grid key
NAME_ORDER = ("method", "fmt", "width", "depth", "batch", "lr", "steps", "seed")


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["lr=1e-3,3e-3", "seed=0,1"]`` -> ``{"lr": ["1e-3", "3e-3"], "seed": ["0", "1"]}``."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"grid entry {item!r} is not key=v1,v2,...")
        grid[key.replace("-", "_")] = values.split(",")
    return grid


def run_name(point: dict[str, str]) -> str:
    keys = [k for k in NAME_ORDER if k in point] + sorted(k for k in point if k not in NAME_ORDER)
    return "_".join(f"{k}{point[k]}" if k not in ("method", "fmt") else point[k] for k in keys)


def points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the run JSONs and logs")
    p.add_argument("--grid", nargs="+", required=True, help="key=v1,v2 ... (ProxyConfig fields)")
    p.add_argument("--extra", action="append", default=None,
                   help="a flag passed to every run, repeatable (write --extra=--oracle)")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="list the runs that would start")
    args = p.parse_args(argv)
    args.extra = args.extra or []
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    todo = points(parse_grid(args.grid))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for i, point in enumerate(todo, 1):
        name = run_name(point) + ("_" + "_".join(a.strip("-") for a in args.extra) if args.extra else "")
        target = out / f"{name}.json"
        if target.exists():
            print(f"[{i}/{len(todo)}] skip {name} (done)", flush=True)
            continue
        cmd = ["nice", "-n", str(args.nice), sys.executable, str(PROXY), "--out", str(target), "--threads", "1"]
        for key, value in point.items():
            cmd += [f"--{key}", value]
        cmd += args.extra
        if args.dry_run:
            print(" ".join(cmd))
            continue
        t0 = time.time()
        with open(out / "logs" / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        print(f"[{i}/{len(todo)}] {name}: rc={rc} {time.time() - t0:.0f}s {time.strftime('%H:%M:%S')}", flush=True)


if __name__ == "__main__":
    main()
