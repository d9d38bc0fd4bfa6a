"""What a BF16 budget buys on an NF4 (QLoRA) base: GNMR against equal-budget baselines and the oracle.

Every run fine-tunes the same model the ``gnmr-nf4`` recipe builds (SmolLM2-135M-Instruct, bitsandbytes
NF4 base with BF16 compute, a BF16 recovery path per decoder layer, LoRA r=8 on all seven projections,
the recipe's data, optimizer and clipping) and differs only in which decoder layers run their base
weights in BF16 at each step, chosen by a trigger policy through ``GNMRCallback(policy=...)``:

=================  ==========================================================================================
method             layers on the BF16 path
=================  ==========================================================================================
``nf4``            none (plain QLoRA; bit-identical to stock PEFT over stock 4-bit)
``bf16``           all 30 (the BF16 model with the same LoRA weights)
``gnmr``           GNMR + Delta-GNMR, the recipe's block (max_active 8 of 30, lock 1, alpha 1.5 -> 1.1 ...)
``random``         a seeded draw per step whose size follows GNMR's mean active count (same seed's GNMR run)
``static_gnmr``    the k layers GNMR (same seed) kept on BF16 most often, k = round(GNMR's mean active), fixed
``edge``           the first and last layers, as many as GNMR's peak active count (same peak BF16 bytes)
``gap-K``          the K layers with the largest measured recovery gap over the first ``--profile-steps``
                   steps (one extra all-NF4 and one all-BF16 backward per profiled step), then fixed
``rand-K``         a seeded uniform draw of K layers every step
=================  ==========================================================================================

``gap-K`` at K = 3, 8, 15 and ``rand-K`` at K = 3, 15 (10, 25, 50 % of the layers; ``random`` at GNMR's
mean is the random point near 25 %), with ``nf4`` (0 %) and ``bf16`` (100 %), are the price curve. After training, the adapter's held-out loss (mean over response tokens of
``--eval-problems`` generated test problems, disjoint from the training problems) is measured on the NF4
base (no layer on BF16) and on the BF16 base (every layer on BF16). The gap closed is measured on the BF16
base, ``(L_nf4 - L_method) / (L_nf4 - L_bf16)`` per seed with the same seed's ``nf4`` and ``bf16`` runs:
what the BF16 layer-steps bought an adapter that is then used on (or merged into) the original weights.
On the NF4 base there is no such scale (the ``bf16`` adapter is worse there than the ``nf4`` one), so the
table gives that loss as it is.

With ``--oracle`` (seed 0's ``gnmr`` run in the plan) every step also measures every layer's recovery
gap (relative error of the LoRA gradient on the NF4 base against the BF16 base, same LoRA weights,
same batch, dropout off) and scores, against the oracle set (the top max_active by gap), the set GNMR
ran and the sets other triggers would have chosen on the same steps (the previous step's gap, the
profile of the first steps, the first/last layers, the layers GNMR used most). The oracle's extra
passes are timed apart and left out of the step time.

Commands::

    python bench/value/nf4_bench.py plan --out bench/results/nf4 --workers 2     # resumable; logs per run
    python bench/value/nf4_bench.py report --out bench/results/nf4 --plot docs/nf4_price.png
    python bench/value/nf4_bench.py run --method gnmr --seed 0 --out /tmp/x      # one run

One torch thread per run (a shared 2-core machine). A finished run has ``result.json``; ``plan`` skips
it, takes a run by an exclusive lock file (a dead owner's lock is reclaimed) and runs it in a
subprocess with its log beside the result (bench/runner.py, the run loop the resumable benches share).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared runner.py
import runner  # noqa: E402  (bench/runner.py: the run loop every resumable bench shares)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2-135m" / "gnmr-nf4.yaml"
PRICE_K = (3, 8, 15)
RAND_K = (3, 15)  # the 25 % random point is "random" (GNMR's mean budget)
BASE_METHODS = ("bf16", "nf4", "gnmr")
DERIVED = ("random", "static_gnmr", "edge")  # need the same seed's gnmr run


# ---------------------------------------------------------------------------------------------- one run


def _policy(method: str, num_units: int, config, seed: int, out: Path, profile_steps: int):
    """The trigger policy of ``method`` (``None`` for gnmr: the callback's own controller)."""
    from gnmr_hf.core.controller import GNMRConfig
    from gnmr_hf.core.policies import edge_units, make_policy, most_active_units

    if method not in BASE_METHODS + DERIVED and not (
            method.partition("-")[0] in ("gap", "rand") and method.partition("-")[2].isdigit()):
        raise SystemExit(f"unknown method {method!r}")
    if method == "gnmr":
        return None, {}
    if method == "nf4":
        return make_policy("static_set", num_units, GNMRConfig(max_active=1), units=[]), {}
    if method == "bf16":
        return make_policy("static_set", num_units, GNMRConfig(max_active=num_units), units=list(range(num_units))), {}
    if method.startswith("gap-"):
        k = int(method[4:])
        cfg = GNMRConfig(**{**config.to_dict(), "max_active": k})
        return make_policy("gap_profile", num_units, cfg, profile_steps=profile_steps), {"k": k}
    if method.startswith("rand-"):
        k = int(method[5:])
        cfg = GNMRConfig(**{**config.to_dict(), "max_active": k})
        return make_policy("random_budget", num_units, cfg, mean_active=float(k), seed=1000 + seed), {"k": k}
    ref = _load(out.parent.parent / "gnmr" / f"seed{seed}" / "result.json")
    mean_active = ref["mean_active"]
    if method == "random":
        return (make_policy("random_budget", num_units, config, mean_active=mean_active, seed=1000 + seed),
                {"mean_active_target": mean_active})
    if method == "static_gnmr":
        k = max(1, round(mean_active))
        units = most_active_units(ref["active_per_step"], num_units, k)
        return make_policy("static_set", num_units, GNMRConfig(max_active=k), units=units), {"k": k, "units": units}
    if method == "edge":
        k = max(1, ref["peak_active"])
        units = edge_units(num_units, k)
        return make_policy("static_set", num_units, GNMRConfig(max_active=k), units=units), {"k": k, "units": units}
    raise SystemExit(f"unknown method {method!r}")


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run that method first")
    return json.loads(path.read_text())


class GapProbe:
    """Per-layer recovery gaps on one batch: LoRA gradients with every layer on NF4 and on BF16."""

    def __init__(self, model, units) -> None:
        self.model, self.units = model, units
        self.params = [[p for p in module.parameters() if p.requires_grad] for _, module in units]
        self.seconds = 0.0

    def measure(self, inputs) -> list[float]:
        import torch

        from gnmr_hf.backends.base import active_units, set_active_units
        from gnmr_hf.core.oracle import recovery_gap

        t0 = time.perf_counter()
        model, units = self.model, self.units
        running = active_units(model, units)
        was_training = model.training
        model.eval()  # dropout off: both passes see the same network
        grads = []
        for idx in ([], list(range(len(units)))):
            set_active_units(model, idx, units)
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                model(**inputs).loss.backward()
            grads.append([[None if p.grad is None else p.grad.detach().clone() for p in ps] for ps in self.params])
        model.zero_grad(set_to_none=True)
        set_active_units(model, running, units)
        model.train(was_training)
        self.seconds += time.perf_counter() - t0
        return recovery_gap(grads[0], grads[1]).tolist()


def heldout_loss(model, tokenizer, problems: list[dict[str, str]], script, batch_size: int = 8) -> float:
    """Mean loss per response token over ``problems``, tokenised and padded as the recipe trains: the demo's
    :func:`gnmr_hf.demo.heldout_loss` (prompt tokens masked; the Trainer's collator)."""
    from gnmr_hf.demo import heldout_loss as demo_heldout_loss

    return demo_heldout_loss(model, tokenizer, script, problems, batch_size)[0]


def token_loss(model, batches) -> float:
    """Mean loss per target token over collated ``batches`` (``labels`` -100 where not scored):
    :func:`gnmr_hf.demo.token_loss`, so batches weigh by their tokens."""
    from gnmr_hf.demo import token_loss as demo_token_loss

    return demo_token_loss(model, batches)[0]


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback, set_seed

    import gnmr_hf
    from gnmr_hf.backends.base import active_units, recovery_device_bytes, set_active_units
    from gnmr_hf.core.oracle import OracleAccumulator
    from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl
    from gnmr_hf.reporting.stored import compress
    from gnmr_hf.trainer.trace import TRACE_NAME
    from gnmr_hf.units import resolve_units

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else out.parent.parent / "data"
    recipe = finetune.load_config(["--config", str(RECIPE), "--output_dir", str(out), "--seed", str(args.seed),
                                   "--max_steps", str(args.steps), "--data_dir", str(data_dir),
                                   "--report_to", "none", "--disable_tqdm", "true",
                                   "--compute_dtype", args.compute_dtype])
    script, training = recipe.script, recipe.training
    set_seed(args.seed)
    model_path = finetune.resolve_model_path(script.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_ds = finetune.tokenize_dataset(script, finetune.load_records(script, str(out)), tokenizer)
    # FP32 by default: recipes/finetune.py computes in BF16, which a CPU without BF16 matrix instructions
    # runs about 12x slower (bench/cost/nf4_step.py); the NF4 path then de-quantises to FP32 and the recovery
    # path holds the checkpoint's BF16 weights upcast to FP32 (the same values): the paths differ in the
    # weights alone
    model = finetune.load_model(recipe, model_path)
    units = resolve_units(model)
    U = len(units)

    policy, extra = _policy(args.method, U, recipe.gnmr.config, args.seed, out, args.profile_steps)
    if policy is None:
        callback = gnmr_hf.GNMRCallback(recipe.gnmr.config, init_fraction=recipe.gnmr.init_fraction)
    else:
        callback = gnmr_hf.GNMRCallback(policy=policy)
    wants_gap = getattr(policy, "wants_gap", None)
    probe = GapProbe(model, units) if (wants_gap or args.oracle) else None
    max_active = recipe.gnmr.config.max_active
    oracle = OracleAccumulator(U, max_active) if args.oracle else None
    oracle_rows: list[dict[str, Any]] = []
    step_times: list[float] = []
    recovery_bytes: list[int] = []
    active_per_step: list[list[int]] = []

    class Bench(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.probe0 = time.perf_counter(), probe.seconds if probe else 0.0
            # what this step runs: the policy's answer after the last step is applied by now
            active_per_step.append(active_units(model, units))
            recovery_bytes.append(recovery_device_bytes(model))

        def on_step_end(self, a, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0 - ((probe.seconds if probe else 0.0) - self.probe0))

    class BenchTrainer(Trainer):
        def training_step(self, model_, inputs, num_items_in_batch=None):
            step = self.state.global_step + 1
            gap_wanted = wants_gap is not None and wants_gap(step)
            if gap_wanted or oracle is not None:
                gaps = probe.measure(self._prepare_inputs(dict(inputs)))
                if gap_wanted:
                    policy.observe_gap(gaps)
                if oracle is not None:
                    oracle_rows.append({"step": step, "gaps": gaps})
            return super().training_step(model_, inputs, num_items_in_batch)

    trainer = BenchTrainer(model=model, args=training, train_dataset=train_ds,
                           data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
                           callbacks=[Bench(), callback])
    start = time.time()
    trainer.train()
    train_s = time.time() - start

    summary = json.loads((out / "gnmr_summary.json").read_text())
    test = [json.loads(line) for line in
            (write_gsm8k_jsonl(data_dir, n_train=script.num_generated, seed=script.generated_seed)
             / "test.jsonl").read_text().splitlines()][:args.eval_problems]
    set_active_units(model, [], units)
    loss_nf4 = heldout_loss(model, tokenizer, test, script)
    set_active_units(model, list(range(U)), units)
    loss_bf16 = heldout_loss(model, tokenizer, test, script)
    set_active_units(model, [], units)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    counts = [len(a) for a in active_per_step]
    result: dict[str, Any] = {
        "method": args.method, "seed": args.seed, "steps": args.steps, "num_units": U, "max_active": max_active,
        "policy": extra, "train_losses": losses, "heldout_loss_nf4_base": loss_nf4,
        "heldout_loss_bf16_base": loss_bf16, "eval_problems": len(test),
        "mean_active": sum(counts) / len(counts), "peak_active": max(counts), "active_per_step": active_per_step,
        "peak_recovery_bytes": max(recovery_bytes), "step_s_median": statistics.median(step_times),
        "step_s": step_times, "train_wall_s": round(train_s, 1), "gap_probe_s": round(probe.seconds, 1) if probe else 0.0,
        "summary": summary, "threads": torch.get_num_threads(), "compute_dtype": args.compute_dtype,
    }
    if oracle is not None:
        for row in oracle_rows:  # the set this step ran, as recorded at its start
            row["active"] = active_per_step[row["step"] - 1]
        result["oracle"] = oracle_report(oracle, oracle_rows, U, max_active, args.profile_steps, args.method)
    compress(out / TRACE_NAME)  # results stay light: the trace as gnmr_trace.jsonl.gz, before the run counts as done
    tmp = out / ".result.json.tmp"
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, out / "result.json")
    print(f"{args.method} seed {args.seed}: held-out loss NF4 base {loss_nf4:.4f}, BF16 base {loss_bf16:.4f}, "
          f"mean BF16 layers {result['mean_active']:.2f}, step {result['step_s_median']:.2f} s")
    return result


def oracle_report(acc, rows: list[dict[str, Any]], U: int, K: int, profile_steps: int, method: str) -> dict[str, Any]:
    """Score the run's own sets and counterfactual triggers' sets against the oracle on the run's steps."""
    from gnmr_hf.core.oracle import oracle_mask
    from gnmr_hf.core.policies import edge_units, most_active_units

    def top(gaps):  # the K largest gaps, ties to the lower index
        return oracle_mask(gaps, K).nonzero().flatten().tolist()

    profile = None
    used_most = most_active_units([r["active"] for r in rows], U, K)
    edges = edge_units(U, K)
    for i, r in enumerate(rows):
        choices = {f"{method} (as run)": r["active"], "first/last layers": edges, "GNMR's most-used layers": used_most}
        if i > 0:
            choices["previous step's gap"] = top(rows[i - 1]["gaps"])
        if i >= profile_steps:
            if profile is None:
                cols = list(zip(*[rows[j]["gaps"] for j in range(profile_steps)]))
                profile = top([sum(c) / len(c) for c in cols])
            choices[f"gap profile (first {profile_steps} steps)"] = profile
        acc.add(r["step"], r["gaps"], choices)
    return acc.to_dict()


# ---------------------------------------------------------------------------------------------- the plan


def plan_runs(seeds: list[int], oracle_seed: int | None) -> list[tuple[str, int, bool]]:
    runs = []
    for s in seeds:
        runs += [(m, s, m == "gnmr" and s == oracle_seed) for m in BASE_METHODS]
    for s in seeds:
        runs += [(m, s, False) for m in DERIVED]
        runs += [(f"gap-{k}", s, False) for k in PRICE_K] + [(f"rand-{k}", s, False) for k in RAND_K]
    return runs


def plan(args: argparse.Namespace) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = plan_runs(seeds, None if args.no_oracle else seeds[0])
    if args.workers > 1 and not args.worker:
        runner.fan_out(args.workers)
    out = Path(args.out)
    jobs = []
    for method, seed, with_oracle in runs:
        run_dir = out / method / f"seed{seed}"
        cmd = [sys.executable, __file__, "run", "--method", method, "--seed", str(seed), "--out", str(run_dir),
               "--steps", str(args.steps), "--eval-problems", str(args.eval_problems),
               "--profile-steps", str(args.profile_steps), "--data-dir", str(out / "data")]
        if with_oracle:
            cmd.append("--oracle")
        jobs.append(runner.Job((method, seed), run_dir, cmd, run_dir / "result.json",
                               needs=(("gnmr", seed),) if method in DERIVED else ()))
    runner.run_plan(jobs)


# ---------------------------------------------------------------------------------------------- report


def _collect(out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(out.glob("*/seed*/result.json")):
        r = json.loads(path.read_text())
        runs.setdefault(r["method"], {})[r["seed"]] = r
    return runs


def _med_range(values: list[float], fmt: str = ".4f") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def gap_closed(runs, method: str, base: str) -> list[float]:
    key = f"heldout_loss_{base}_base"
    vals = []
    for seed, r in runs.get(method, {}).items():
        lo, hi = runs.get("nf4", {}).get(seed), runs.get("bf16", {}).get(seed)
        if lo is None or hi is None or lo[key] == hi[key]:
            continue
        vals.append((lo[key] - r[key]) / (lo[key] - hi[key]))
    return vals


METHOD_ORDER = ["bf16", "nf4", "gnmr", "random", "static_gnmr", "edge"] + \
    [f"gap-{k}" for k in PRICE_K] + [f"rand-{k}" for k in PRICE_K]


def report(args: argparse.Namespace) -> str:
    out = Path(args.out)
    runs = _collect(out)
    lines = [f"Held-out loss per response token ({next(iter(next(iter(runs.values())).values()))['eval_problems']} "
             "generated test problems), median [min, max] over seeds; gap closed = (L_nf4 - L) / (L_nf4 - L_bf16) "
             "per seed, from the losses on the BF16 base.", "",
             "| method | seeds | loss, NF4 base | loss, BF16 base | gap closed (BF16 base) "
             "| mean BF16 layers/step | peak BF16 layers | peak recovery MiB | step s (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in [m for m in METHOD_ORDER if m in runs] + sorted(set(runs) - set(METHOD_ORDER)):
        rs = list(runs[m].values())
        lines.append("| " + " | ".join([
            m, str(len(rs)),
            _med_range([r["heldout_loss_nf4_base"] for r in rs]),
            _med_range([r["heldout_loss_bf16_base"] for r in rs]),
            _med_range(gap_closed(runs, m, "bf16"), ".2f"),
            _med_range([r["mean_active"] for r in rs], ".2f"),
            str(max(r["peak_active"] for r in rs)),
            f"{max(r['peak_recovery_bytes'] for r in rs) / 2**20:.1f}",
            _med_range([r["step_s_median"] for r in rs], ".2f"),
        ]) + " |")
    oracle_runs = [r for m in runs.values() for r in m.values() if "oracle" in r]
    for r in oracle_runs:
        table = r["oracle"]["table"]
        lines += ["", f"Oracle diagnostic ({r['method']} seed {r['seed']}, {len(r['oracle']['steps'])} steps scored, "
                  f"budget {r['oracle']['max_active']} of {r['num_units']} layers; chance precision "
                  f"{r['oracle']['max_active'] / r['num_units']:.2f})", "",
                  "| trigger | steps | precision@max_active | captured gap | oracle's captured gap | mean set size |",
                  "|---|---|---|---|---|---|"]
        for name, row in table.items():
            lines.append(f"| {name} | {int(row['steps'])} | {row['precision_at_k']:.3f} | {row['captured']:.3f} | "
                         f"{row['oracle_captured']:.3f} | {row['n_chosen']:.2f} |")
        gaps = r["oracle"]["gaps"]
        mean_gap = [statistics.mean(col) for col in zip(*gaps)]
        lines += ["", "Mean recovery gap per layer (layer: gap): "
                  + ", ".join(f"{b}: {g:.2f}" for b, g in enumerate(mean_gap))]
    text = "\n".join(lines)
    if args.plot:
        plot(runs, oracle_runs, args.plot)
    return text


def plot(runs, oracle_runs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.reporting.plots import save_figure

    fig, axes = plt.subplots(1, 2 if oracle_runs else 1, figsize=(13 if oracle_runs else 6.5, 4.5), squeeze=False)
    ax = axes[0][0]
    for label, methods, style in (("static by gap", ["nf4"] + [f"gap-{k}" for k in PRICE_K] + ["bf16"], "o-"),
                                  ("random", ["nf4", "rand-3", "rand-8", "random", "rand-15", "bf16"], "s--")):
        xs, ys, lo, hi = [], [], [], []
        for m in methods:
            g = gap_closed(runs, m, "bf16")
            if not g or m not in runs:
                continue
            xs.append(statistics.median(r["mean_active"] for r in runs[m].values()))
            ys.append(statistics.median(g))
            lo.append(ys[-1] - min(g))
            hi.append(max(g) - ys[-1])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=label)
    for m, marker in (("gnmr", "*"), ("random", "x"), ("static_gnmr", "D"), ("edge", "^")):
        g = gap_closed(runs, m, "bf16")
        if g:
            x = statistics.median(r["mean_active"] for r in runs[m].values())
            ax.scatter([x] * len(g), g, marker=marker, s=60 if marker == "*" else 30, label=m, zorder=3)
    ax.axhline(0, color="grey", lw=0.5)
    ax.axhline(1, color="grey", lw=0.5)
    ax.set_xlabel("mean BF16 layers per step (of 30)")
    ax.set_ylabel("NF4-to-BF16 gap closed (held-out loss, BF16 base)")
    ax.set_title("What each BF16 layer buys (median, range over seeds)")
    ax.legend(fontsize=8)
    if oracle_runs:
        r = oracle_runs[0]
        ax2 = axes[0][1]
        gaps = r["oracle"]["gaps"]
        im = ax2.imshow(list(map(list, zip(*gaps))), aspect="auto", origin="lower", cmap="viridis",
                        extent=(r["oracle"]["steps"][0] - 0.5, r["oracle"]["steps"][-1] + 0.5, -0.5, r["num_units"] - 0.5))
        steps = r["oracle"]["steps"]
        active = {row_step: a for row_step, a in zip(steps, (x for x in r["active_per_step"]))}
        xs = [s for s in steps for _ in active.get(s, [])]
        ys = [b for s in steps for b in active.get(s, [])]
        ax2.scatter(xs, ys, s=6, c="red", marker="s", label="GNMR's BF16 layers")
        fig.colorbar(im, ax=ax2, label="recovery gap (relative LoRA-gradient error)")
        ax2.set_xlabel("step")
        ax2.set_ylabel("decoder layer")
        ax2.set_title(f"Recovery gap per layer and step ({r['method']}, seed {r['seed']})")
        ax2.legend(fontsize=8, loc="upper right")
    save_figure(fig, path, dpi=120)  # titles wrapped to fit, then laid out
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one run")
    r.add_argument("--method", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    r.add_argument("--oracle", action="store_true")
    r.add_argument("--data-dir", default=None)
    for q in (r, pl := sub.add_parser("plan", help="every run, resumable")):
        q.add_argument("--steps", type=int, default=20)
        q.add_argument("--eval-problems", type=int, default=48)
        q.add_argument("--profile-steps", type=int, default=3)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    pl.add_argument("--out", required=True)
    pl.add_argument("--seeds", default="0,1,2")
    pl.add_argument("--workers", type=int, default=1)
    pl.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    pl.add_argument("--no-oracle", action="store_true")
    rp = sub.add_parser("report", help="the tables (and a plot)")
    rp.add_argument("--out", required=True)
    rp.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.cmd == "run":
        run_one(args)
    elif args.cmd == "plan":
        plan(args)
    else:
        print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
