"""Do dynamic sparse training's cold-start spikes show at CPU scale? A resumable sweep of
``recipes/stress/sparse.py`` over settings chosen to provoke them (docs/sparse.md, "The sweep").

Each setting is a set of recipe overrides on ``recipes/stress/configs/cpu_bench.yaml`` (the 4-layer, 128-wide
LLaMA on the Python docs, 16 x 128 tokens a step, float32, one torch thread). A job is (setting, method, seed);
jobs run through the shared runner (``bench/runner.py``: claimed, logged, resumed: a killed sweep started again
continues where it stopped, each run from its own last checkpoint). ``report`` runs the recipe's
``--summarise`` per (setting, seed) over the runs that exist, writes ``<out>/<setting>_seed<k>.json``, a table
``<out>/summary.md`` and a plot per setting (each method's loss minus dense's, the topology updates marked).

    python bench/stress/sparse_sweep.py run --settings bytes-d0.2 --methods dense dst smet --seeds 0
    python bench/stress/sparse_sweep.py report --out bench/results/sparse/sweep
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "recipes" / "stress"))

import runner  # noqa: E402

CONFIG = ROOT / "recipes" / "stress" / "configs" / "cpu_bench.yaml"
# the throwaway probe of docs/sparse.md's source summary: byte-level tokens, density 0.2, a topology update every
# 100 steps, Adam at a constant 3e-3 (after a 5 % ramp), 800 steps, float32
_PROBE = ["data.vocab_size=257", "train.dtype=float32", "train.learning_rate=3.0e-3", "train.min_lr_rate=1.0",
          "train.warmup_ratio=0.05", "train.max_steps=800", "train.eval_steps=100", "train.save_steps=100",
          "sparse.update_every=100", "sparse.end_fraction=0.9", "sparse.drop_fraction=0.3", "sparse.warmup_steps=20"]
SETTINGS: dict[str, list[str]] = {
    "bytes-d0.2": _PROBE + ["sparse.density=0.2"],
    "bytes-d0.1": _PROBE + ["sparse.density=0.1"],
    "bytes-d0.4": _PROBE + ["sparse.density=0.4"],
    "bytes-d0.2-lr1e-2": [o for o in _PROBE if not o.startswith("train.learning_rate")]
    + ["train.learning_rate=1.0e-2", "sparse.density=0.2"],
}
METHODS = ("dense", "dst", "smet", "gnmr", "random_budget")


def dense_key(setting: str) -> str:
    """Dense training ignores every ``sparse.*`` override: settings that differ only there share one dense run,
    the first such setting's."""
    def rest(s: str) -> list[str]:
        return [o for o in SETTINGS[s] if not o.startswith("sparse.")]

    return next(s for s in SETTINGS if rest(s) == rest(setting))


def run_dir(work: Path, setting: str, method: str, seed: int) -> Path:
    if method == "dense":
        setting = dense_key(setting)
    return work / setting / f"seed{seed}" / method


def jobs(work: Path, settings: list[str], methods: list[str], seeds: list[int]) -> list[runner.Job]:
    out, seen = [], set()
    for s in settings:
        for seed in seeds:
            for m in methods:
                d = run_dir(work, s, m, seed)
                if d in seen:
                    continue
                seen.add(d)
                extra = [f"train.seed={seed}", f"data.cache_dir={work / '.cache'}"]
                needs = ()
                if m == "random_budget":  # the same mean number of warmed units a step as GNMR's run
                    gnmr = run_dir(work, s, "gnmr", seed) / "result.json"
                    if not gnmr.is_file():
                        print(f"[sweep] {s} seed {seed}: random_budget waits for the gnmr run; run it first")
                        continue
                    mean = json.loads(gnmr.read_text())["policy_summary"]["mean_active"]
                    extra.append(f"baselines.random_mean_active={mean}")
                cmd = [sys.executable, str(ROOT / "recipes" / "stress" / "sparse.py"), "--config", str(CONFIG),
                       "--method", m, "--output_dir", str(d), "--resume", *SETTINGS[s], *extra]
                out.append(runner.Job((s, m, seed), d, cmd, d / "result.json", needs, label=f"{s} {m} seed {seed}"))
    return out


def report(work: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sparse import read_losses, summarise

    out.mkdir(parents=True, exist_ok=True)
    rows = ["| setting | seed | method | held-out loss | largest rise after an update | updates above dense's "
            "largest rise | mean excess (nats) | warmed unit-steps |", "|---|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        fig, ax, drew = None, None, False
        for seed_dir in sorted((work / s).glob("seed*")):
            seed = int(seed_dir.name[4:])
            dirs = [run_dir(work, s, m, seed) for m in METHODS]
            dirs = [d for d in dirs if (d / "metrics.jsonl").is_file() or (d / "metrics.jsonl.gz").is_file()]
            if len(dirs) < 2:
                continue
            summ = summarise([str(d) for d in dirs])
            summ["setting"], summ["overrides"], summ["seed"] = s, SETTINGS[s], seed
            (out / f"{s}_seed{seed}.json").write_text(json.dumps(summ, indent=1))
            dense_max = None
            for r in summ["runs"].values():
                sp = r.get("spikes") or {}
                if sp.get("updates") and "dense_rise" in sp["updates"][0]:
                    dense_max = max(u["dense_rise"] for u in sp["updates"])
            for m, r in summ["runs"].items():
                sp = r.get("spikes") or {}
                loss = f"{r['final_eval_loss']:.3f}" if r.get("final_eval_loss") is not None else "(running)"
                rise = f"{100 * sp['max_rise']:.1f} %" if sp.get("max_rise") is not None else (
                    f"(dense at the update steps: {100 * dense_max:.1f} %)" if m == "dense" and dense_max else "-")
                n_up = len(sp.get("updates", []))
                above = f"{sp['count_rise_over_dense_max']} of {n_up}" if sp.get("count_rise_over_dense_max") \
                    is not None else "-"
                exc = f"{sp['mean_excess']:+.3f}" if sp.get("mean_excess") is not None else "-"
                rows.append(f"| {s} | {seed} | {m} | {loss} | {rise} | {above} | {exc} | "
                            f"{r.get('recovered_unit_steps') or 0} |")
            if seed == 0 and "dense" in summ["runs"]:
                dense = read_losses(run_dir(work, s, "dense", seed))
                fig, ax = plt.subplots(figsize=(9, 3.5))
                for d in dirs:
                    if d.name == "dense":
                        continue
                    lo = read_losses(d)
                    steps = [k for k in sorted(lo) if k in dense]
                    w = 5  # a 5-step moving mean of the paired difference
                    diff = [lo[k] - dense[k] for k in steps]
                    smooth = [sum(diff[max(0, i - w + 1):i + 1]) / len(diff[max(0, i - w + 1):i + 1])
                              for i in range(len(diff))]
                    ax.plot(steps, smooth, lw=1, label=d.name)
                    drew = True
                for u in summ.get("update_steps") or []:
                    ax.axvline(u, color="grey", lw=0.5, ls=":")
                ax.axhline(0, color="black", lw=0.5)
                ax.set_xlabel("step (dotted: topology updates)")
                ax.set_ylabel("training loss - dense (nats, 5-step mean)")
                ax.set_title(f"{s}, seed 0")
                ax.legend(fontsize=8)
        if fig is not None:
            if drew:
                fig.tight_layout()
                fig.savefig(out / f"{s}.png", dpi=90)
            plt.close(fig)
    cmd = "python bench/stress/sparse_sweep.py report --out " + str(out)
    (out / "summary.md").write_text("Sparse sweep (recipes/stress/sparse.py; settings in bench/stress/sparse_sweep.py)."
                                    f" Command: `{cmd}`.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the jobs of the settings x methods x seeds (resumable)")
    r.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["bytes-d0.2"])
    r.add_argument("--methods", nargs="+", choices=METHODS, default=["dense", "dst", "smet"])
    r.add_argument("--seeds", nargs="+", type=int, default=[0])
    r.add_argument("--work", default=str(ROOT / "runs" / "sparse_sweep"), help="run folders (checkpoints)")
    q = sub.add_parser("report", help="summarise the runs that exist")
    q.add_argument("--work", default=str(ROOT / "runs" / "sparse_sweep"))
    q.add_argument("--out", default=str(ROOT / "bench" / "results" / "sparse" / "sweep"))
    a = p.parse_args(argv)
    if a.cmd == "run":
        outcome = runner.run_plan(jobs(Path(a.work), a.settings, a.methods, a.seeds))
        sys.exit(1 if outcome.failed else 0)
    report(Path(a.work), Path(a.out))


if __name__ == "__main__":
    main()
