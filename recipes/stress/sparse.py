"""Dynamic sparse training stress bench: SMET's cold-start spikes at CPU scale, and GNMR in control of the warm-up.

Same model shapes, corpus (the Python 3.11 documentation), tokenizer and data order as
``recipes/stress/pretrain.py``; every linear inside the decoder layers is a
:class:`gnmr_hf.sparse.SparseLinear` at ``sparse.density`` (except for ``dense``), its topology updated
every ``sparse.update_every`` steps (drop ``sparse.drop_fraction`` of the active weights with the smallest
magnitude, regrow as many by ``sparse.regrow``: ``set`` random, ``rigl`` gradient), trained by
:class:`gnmr_hf.sparse.SparseAdamW`:

    method         sparse linears   regrown weights' treatment (per unit)                  chooser
    dense          no               -                                                       -
    dst            yes              plain DST update (global Adam step, full rate)          -
    smet           yes              SMET warm-up (own timestep, rate ramped over W) always  all units
    gnmr           yes              SMET warm-up for up to max_active units, else plain     GNMR controller
    random         yes              SMET warm-up for max_active random units per step       seeded random
    random_budget  yes              SMET warm-up for random units, baselines.random_mean_active
                                    per step on average (GNMR's measured budget)            seeded random

Units are the sparse linears (``sparse.units: linears``, 28 at the CPU bench shape) or the decoder layers
(``layers``). Every method runs ``GNMRCallback`` (the fixed ones with a monitor or a static set), so the
norms and trace are taken the same way; the decision GNMR makes after step t applies to update t+1.
SMET's density-aware rate 1/sqrt(d) is ``sparse.density_scaling`` (off by default, for every sparse
method alike, so the methods differ only in the warm-up).

Usage:
    python recipes/stress/sparse.py --config recipes/stress/configs/cpu_bench.yaml --method dst \\
        --output_dir runs/sparse/dst [sparse.density=0.1 train.max_steps=600 ...]
    python recipes/stress/sparse.py --summarise runs/sparse/dense runs/sparse/dst ... [--out summary.json]

Writes ``<output_dir>/metrics.jsonl`` (per step: loss, learning rate, the units whose regrown weights got
the warm-up in that step's update; eval losses), ``dst_updates.jsonl`` (one line per topology update),
``gnmr_trace.jsonl`` and ``result.json`` (final held-out loss and perplexity, optimizer-state and
gradient bytes, recovered unit-steps, the policy summary). ``--summarise`` measures the loss spikes after
each topology update against the dense run in the list (docs/sparse.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pretrain as base  # noqa: E402  (the stress bench's config, data and model)

METHODS = ("dense", "dst", "smet", "gnmr", "random", "random_budget")
SPARSE_DEFAULTS = {
    "density": 0.1,
    "block_size": 1,
    "update_every": 50,
    "drop_fraction": 0.3,
    "regrow": "set",
    "warmup_steps": 20,
    "density_scaling": False,
    "end_fraction": 1.0,  # no topology update after this share of the run
    "units": "linears",
    "dtype": "float32",
}


def sparse_config(cfg: dict) -> dict:
    s = {**SPARSE_DEFAULTS, **(cfg.get("sparse") or {})}
    unknown = set(s) - set(SPARSE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown sparse.* keys {sorted(unknown)}; known: {sorted(SPARSE_DEFAULTS)}")
    return s


def build_policy(method: str, cfg: dict, num_units: int, max_steps: int):
    """The chooser of the units whose regrown weights get the warm-up, for ``GNMRCallback(policy=...)``."""
    if method in ("dense", "dst"):
        return base.build_policy("gnmr", cfg, num_units, max_steps, max_active=0)[0]  # a monitor
    if method == "smet":
        return base.build_policy("static_set", cfg, num_units, max_steps, max_active=num_units,
                                 units=list(range(num_units)))[0]
    return base.build_policy(method, cfg, num_units, max_steps)[0]


def _metrics_callback(out_path: Path | None, opt, layers, units):
    from transformers import TrainerCallback

    unit_of = {}  # id(layer) -> unit index
    for u, (_, unit) in enumerate(units):
        for m in unit.modules():
            unit_of[id(m)] = u

    class SparseMetrics(TrainerCallback):
        def __init__(self):
            self.f = open(out_path, "a") if out_path is not None else None
            self.evals: list[tuple[int, float]] = []
            self.recovered_unit_steps = 0
            self.step_times: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step > 0 and self.f is not None:  # resumed: the steps after the checkpoint run again
                from gnmr_hf.sparse.callback import cut_jsonl

                self.f.close()
                cut_jsonl(str(out_path), state.global_step)
                self.f = open(out_path, "a")

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self.t0)
            rec = sorted({unit_of[id(m)] for m in layers if opt.last_step.get(id(m), {}).get("recovery")})
            self.recovered_unit_steps += len(rec)
            self.pending = {"step": state.global_step, "recovered": rec}

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                line = {**getattr(self, "pending", {"step": state.global_step}), "loss": logs["loss"],
                        "lr": logs.get("learning_rate")}
                self._write(line)
            if "eval_loss" in logs:
                self.evals.append((state.global_step, logs["eval_loss"]))
                self._write({"step": state.global_step, "eval_loss": logs["eval_loss"]})

        def _write(self, rec):
            if self.f is not None:
                self.f.write(json.dumps(rec) + "\n")
                self.f.flush()

    return SparseMetrics()


def run(cfg: dict, method: str, output_dir: str | os.PathLike, resume: bool = False,
        extra_callbacks: list | tuple = ()) -> dict:
    """Train one method; returns (and writes) the result record."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from gnmr_hf.sparse import DSTCallback, SparseAdamW, prepare_sparse, realised_density, sparse_linears
    from gnmr_hf.trainer.callback import GNMRCallback
    from gnmr_hf.units import resolve_units

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "random_budget" and cfg.get("baselines", {}).get("random_mean_active") is None:
        raise ValueError("method 'random_budget' needs baselines.random_mean_active (a gnmr run's mean_active)")
    s = sparse_config(cfg)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tr = cfg["train"]
    torch.set_num_threads(int(tr.get("threads", torch.get_num_threads())))
    cache_dir = Path(cfg["data"].get("cache_dir") or out.parent / ".cache")
    tokenizer, train_ds, val_ds, data_info = base.build_data(cfg, cache_dir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[s["dtype"]]
    model = base.build_model(cfg, len(tokenizer), dtype)
    max_steps = tr["max_steps"]
    if method != "dense":
        prepare_sparse(model, density=s["density"], block_size=s["block_size"], seed=tr["seed"])
    units = resolve_units(model, "linears" if s["units"] == "linears" else None)
    policy = build_policy(method, cfg, len(units), max_steps)
    opt = SparseAdamW.from_model(model, lr=tr["learning_rate"], betas=(0.9, tr.get("adam_beta2", 0.95)),
                                 weight_decay=tr.get("weight_decay", 0.0), warmup_steps=s["warmup_steps"],
                                 density_scaling=s["density_scaling"])
    layers = [m for _, m in sparse_linears(model)]
    metrics_path = out / "metrics.jsonl"
    updates_path = out / "dst_updates.jsonl"
    if not resume:
        for p in (metrics_path, updates_path):
            p.unlink(missing_ok=True)
    metrics = _metrics_callback(metrics_path, opt, layers, units)
    callbacks: list = [GNMRCallback(units=[n for n, _ in units], policy=policy, trace=str(out / "gnmr_trace.jsonl")),
                       metrics]
    if method != "dense":
        callbacks.insert(1, DSTCallback(update_every=s["update_every"], drop_fraction=s["drop_fraction"],
                                        regrow=s["regrow"], seed=tr["seed"],
                                        end_step=int(s["end_fraction"] * max_steps), log_path=str(updates_path)))
    callbacks.extend(extra_callbacks)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=tr["batch_size"],
        per_device_eval_batch_size=tr.get("eval_batch_size", tr["batch_size"]),
        gradient_accumulation_steps=tr["gradient_accumulation_steps"],
        learning_rate=tr["learning_rate"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": tr.get("min_lr_rate", 0.1)},
        warmup_steps=max(1, round(tr.get("warmup_ratio", 0.1) * max_steps)),
        max_grad_norm=tr.get("max_grad_norm", 1.0),
        eval_strategy="steps",
        eval_steps=tr["eval_steps"],
        logging_steps=1,  # the per-step loss the spike measure reads
        save_strategy="steps" if tr.get("save_steps") else "no",
        save_steps=tr.get("save_steps") or 500,
        save_total_limit=tr.get("save_total_limit", 1),
        seed=tr["seed"],
        data_seed=tr["seed"],
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        restore_callback_states_from_checkpoint=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=val_ds,
                      data_collator=default_data_collator, callbacks=callbacks, optimizers=(opt, None))
    has_ckpt = resume and any(out.glob("checkpoint-*"))
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if has_ckpt else None)
    wall = time.perf_counter() - t0
    final = float(trainer.evaluate()["eval_loss"])
    times = metrics.step_times[1:] or metrics.step_times
    summary = policy.summary()
    result = {
        "method": method,
        "final_eval_loss": final,
        "final_ppl": math.exp(final) if final < 50 else float("inf"),
        "eval_curve": metrics.evals + [(max_steps, final)],
        "density": realised_density(model) if layers else 1.0,
        "optimizer_state_bytes": opt.state_bytes(),
        "num_units": len(units),
        "recovered_unit_steps": metrics.recovered_unit_steps,  # this process's steps (a resumed run: since resume)
        "policy_summary": summary,
        "step_time_s": sum(times) / len(times) if times else None,
        "wall_s": wall,
        "sparse": s,
        "data": data_info,
        "config": cfg,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


# ---------------------------------------------------------------- spikes
def read_losses(run_dir: Path) -> dict[int, float]:
    from gnmr_hf.reporting.stored import open_text

    losses = {}
    with open_text(run_dir / "metrics.jsonl") as f:
        lines = f.readlines()
    for line in lines:
        r = json.loads(line)
        if "loss" in r:
            losses[r["step"]] = r["loss"]
    return losses


def spike_table(losses: dict[int, float], dense: dict[int, float] | None, updates: list[int], h: int = 10) -> dict:
    """For each update step u: ``rise`` = max loss of steps u+1..u+h over the mean of u-h+1..u, minus 1 (the
    summary's statistic), and ``excess`` = mean(loss - dense loss) over u+1..u+h minus the same over
    u-h+1..u (paired with the dense run: same data order, so batch difficulty cancels)."""
    rows = []
    for u in updates:
        after = [s for s in range(u + 1, u + h + 1) if s in losses]
        before = [s for s in range(u - h + 1, u + 1) if s in losses]
        if len(after) < h or len(before) < h:
            continue
        row = {"step": u, "rise": max(losses[s] for s in after) / (sum(losses[s] for s in before) / h) - 1}
        if dense is not None and all(s in dense for s in after + before):
            row["excess"] = (sum(losses[s] - dense[s] for s in after) - sum(losses[s] - dense[s] for s in before)) / h
            row["dense_rise"] = max(dense[s] for s in after) / (sum(dense[s] for s in before) / h) - 1
        rows.append(row)
    return {"updates": rows,
            "max_rise": max((r["rise"] for r in rows), default=None),
            "mean_excess": (sum(r["excess"] for r in rows) / len(rows)) if rows and "excess" in rows[0] else None,
            "count_rise_over_dense_max": (sum(r["rise"] > max(x["dense_rise"] for x in rows) for r in rows)
                                          if rows and "dense_rise" in rows[0] else None)}


def summarise(run_dirs: list[str], h: int = 10) -> dict:
    """A small summary of several runs of one seed and setting (one of them ``dense``)."""
    from gnmr_hf.reporting.stored import exists, open_text

    runs = {}
    for d in map(Path, run_dirs):
        # a run still going (no result.json yet): its folder name is the method, its losses so far count
        res = json.loads((d / "result.json").read_text()) if (d / "result.json").is_file() else {"method": d.name}
        runs[res["method"]] = (d, res)
    dense = read_losses(runs["dense"][0]) if "dense" in runs else None
    updates = None
    out = {}
    for method, (d, res) in runs.items():
        upd_file = d / "dst_updates.jsonl"
        if exists(upd_file):
            with open_text(upd_file) as f:
                updates = [json.loads(line)["step"] for line in f]
        out[method] = {k: res.get(k) for k in ("final_eval_loss", "final_ppl", "density", "optimizer_state_bytes",
                                                 "recovered_unit_steps", "step_time_s")}
        out[method]["mean_active"] = res.get("policy_summary", {}).get("mean_active")
        out[method]["finished"] = "final_eval_loss" in res
        out[method]["steps_logged"] = len(read_losses(d))
    for method, (d, _) in runs.items():
        if method != "dense" and updates:
            out[method]["spikes"] = spike_table(read_losses(d), dense, updates, h)
    return {"window": h, "update_steps": updates, "runs": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config")
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--summarise", nargs="+", metavar="RUN_DIR", help="summarise finished runs instead of training")
    p.add_argument("--out", help="with --summarise: write the summary here")
    p.add_argument("--window", type=int, default=10, help="with --summarise: steps before and after each update")
    p.add_argument("overrides", nargs="*", help="section.key=value (YAML values)")
    a = p.parse_args(argv)
    if a.summarise:
        summary = summarise(a.summarise, a.window)
        text = json.dumps(summary, indent=1)
        if a.out:
            Path(a.out).write_text(text + "\n")
        print(text)
        return
    if not (a.config and a.method and a.output_dir):
        p.error("--config, --method and --output_dir are required to train")
    cfg = base.load_config(a.config, a.overrides)
    res = run(cfg, a.method, a.output_dir, resume=a.resume)
    print(json.dumps({k: res[k] for k in ("method", "final_eval_loss", "final_ppl", "density",
                                          "optimizer_state_bytes", "recovered_unit_steps", "step_time_s")}))


if __name__ == "__main__":
    sys.exit(main())
