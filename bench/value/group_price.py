"""What planning whole serving groups costs, before training: free against grouped plans, forward only.

A grouped plan (``plan(..., groups="vllm")``, ``choose_rungs(..., groups=serving_groups(model))``) keeps q/k/v of
a layer together and gate/up together, as vLLM fuses them, so vLLM can serve it; a free plan picks linear by
linear. For each model (``--model``: SmolLM2-135M-Instruct, Gemma 3 270M) on the Python docs (the qlora bench's
``pydocs`` task: Debian's python3.11-doc sources as 256-token blocks, the loss on every token, every 20th file
held out; ``apt-get install -y python3.11-doc``), at +5 / +10 / +25 % memory over the NF4 model (the recipes'
one budget currency: what the plan adds to the served model over all-NF4), two routes:

- ``bf16``: the BF16-only plan, the product's planner (``gnmr_hf.planning.make_plan``, as ``gnmr-hf profile`` and
  the recipes choose) over the first-order profile of the dual-path NF4 model (``prepare_dual_path(...,
  units="linears")``, FP32 compute) on the profile batches, greedy by gain per byte served over NF4 (grouped:
  whole serving groups), measured with the set on BF16 (``measure_plan``);
- ``ladder``: the precision ladder (NF4, INT8 or BF16 per linear, ``rung_gains`` on the stock NF4 model,
  ``make_plan(..., rungs=("int8", "bf16"))``; grouped: one rung per group), measured on ``load_planned``'s stock
  mixed model.

Each plan's gap closed ``(L_nf4 - L) / (L_nf4 - L_bf16)`` on the profile batches (in-sample: the plan was
chosen on them; the first ``--profile-batches`` training batches of 4, as the recipes and the qlora bench
profile) and on ``--heldout`` held-out blocks (the held-out files). No training, one draw (the plans are
deterministic given the profile).

Commands::

    python bench/value/group_price.py run --out bench/results/group_price            # resumable, both models
    python bench/value/group_price.py run --model gemma3-270m --out bench/results/group_price
    python bench/value/group_price.py report --out bench/results/group_price         # summary.md / summary.json

One torch thread (``--threads``). Each plan's result is a small JSON (``MODEL/ROUTE-PCT-KIND.json``) written
atomically when measured; a rerun skips what exists (the profile is recomputed: a few minutes). Each model and
route runs in its own process (memory: the ladder loads hold a few GB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "value"))  # qlora_budget.py
sys.path.insert(0, str(ROOT / "recipes"))

MODELS = {"smollm2-135m-instruct": "smollm2-135m", "gemma3-270m": "gemma3-270m"}  # alias -> recipe folder
POINTS = (5, 10, 25)  # % memory over the NF4 model
ROUTES = ("bf16", "ladder")
KINDS = ("free", "grouped")
PYDOCS = "/usr/share/doc/python3.11/html/_sources"


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def result_path(out: Path, model: str, route: str, pct: int, kind: str) -> Path:
    return out / model / f"{route}-{pct}-{kind}.json"


def _data(alias: str, profile_batches: int, heldout: int, scratch: Path):
    """(model_path, profile batches, held-out batches): the qlora bench's pydocs task for the model's recipe."""
    import qlora_budget
    import torch

    from gnmr_hf.offline.gguf_models import resolve_model

    if not Path(PYDOCS).is_dir():
        raise SystemExit(f"{PYDOCS} is missing: apt-get install -y python3.11-doc")
    model_path = str(resolve_model(alias))
    setting = {"model": MODELS[alias], "task": "pydocs"}
    recipe, tokenizer, recipe_path = qlora_budget.load_recipe(scratch / "run", seed=0, steps=1,
                                                              data_dir=scratch / "data", setting=setting)
    if Path(recipe_path).resolve() != Path(model_path).resolve():
        raise SystemExit(f"the recipe's model {recipe_path} is not {alias}'s {model_path}")
    batches = qlora_budget.profile_batches(recipe, tokenizer, scratch / "run", profile_batches)
    rows = qlora_budget.heldout_set(recipe, tokenizer, scratch / "data", heldout)
    bs = 4
    held = []
    for i in range(0, len(rows), bs):
        ids = torch.tensor([r["input_ids"] for r in rows[i:i + bs]])
        held.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "labels": torch.tensor([r["labels"] for r in rows[i:i + bs]])})
    return model_path, batches, held


def _tokens(batches) -> int:
    return sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)


def _gap(low: float, high: float, loss: float) -> float | None:
    return (low - loss) / (low - high) if low != high else None


def bf16_route(alias: str, out: Path, model_path: str, batches, held) -> None:
    """The BF16-only plans, free and grouped, at each point (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import gnmr_hf
    from gnmr_hf.backends.bnb_4bit import keep_reference_layout
    from gnmr_hf.planning.groups import split_groups
    from gnmr_hf.planning.make import layout_of, make_plan, plan_gains, plan_prices, precision_plan
    from gnmr_hf.planning.planner import measure_plan

    todo = [(p, k) for p in POINTS for k in KINDS if not result_path(out, alias, "bf16", p, k).is_file()]
    if not todo:
        return
    t0 = time.perf_counter()
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, quantization_config=q)
    keep_reference_layout(model)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=model_path, units="linears", dtype=torch.float32)
    prices = plan_prices(model, ("bf16",), "nf4", model_path)
    nf4 = prices.low_model_bytes
    layout = layout_of(model, "vllm", prices)
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    profiled = time.perf_counter() - t0
    ref_path = out / alias / "bf16-reference.json"
    if ref_path.is_file():
        ref = json.loads(ref_path.read_text())
    else:
        h = measure_plan(model, [], held)
        ref = {"profile": {"loss_low": prof.losses["low"], "loss_high": prof.losses["high"]},
               "heldout": {"loss_low": h["loss_low"], "loss_high": h["loss_high"]}, "nf4_model_bytes": nf4,
               "profile_tokens": _tokens(batches), "heldout_tokens": _tokens(held), "units": len(prices.linears),
               "serving_groups": len(layout), "profile_seconds": round(profiled, 1)}
        _write(ref_path, ref)
    gains = plan_gains(model, batches, prices, "first_order", profile=prof)
    for pct, kind in todo:
        t1 = time.perf_counter()
        budget = int(pct / 100 * nf4)
        plan = make_plan(model, batches, budget, ("bf16",), None if kind == "free" else "vllm", prices=prices,
                         gains=gains)
        p = precision_plan(plan, prof, model, batches)
        p.measured["heldout"] = measure_plan(model, p.indices, held,
                                             reference=(ref["heldout"]["loss_low"], ref["heldout"]["loss_high"]))
        price = plan.price_bytes
        assert price <= budget, (price, budget)
        _write(result_path(out, alias, "bf16", pct, kind), {
            "model": alias, "route": "bf16", "memory_over_nf4_budget": pct / 100, "kind": kind, "budget_bytes": budget,
            "price_over_nf4_bytes": price, "memory_over_nf4": price / nf4, "bf16_linears": len(p.modules),
            "int8_linears": 0, "split_groups": len(split_groups(p.modules, layout)),
            "predicted_gap_closed": p.predicted_gap_closed,
            "gap_closed": {w: m["gap_closed"] for w, m in p.measured.items()},
            "loss": {w: m["loss_plan"] for w, m in p.measured.items()}, "kept": sorted(p.modules),
            "seconds": round(time.perf_counter() - t1, 1)})
        print(f"[group_price] {alias} bf16 +{pct}% {kind}: {len(p.modules)} linears, gap closed "
              f"{p.measured['profile']['gap_closed']:.3f} / {p.measured['heldout']['gap_closed']:.3f}", flush=True)


def ladder_route(alias: str, out: Path, model_path: str, batches, held) -> None:
    """The ladder's plans (INT8 and BF16 rungs), free and grouped, at each point."""
    import gc

    import torch

    from gnmr_hf.planning import ladder
    from gnmr_hf.planning.budget import over_low_prices
    from gnmr_hf.planning.groups import split_groups
    from gnmr_hf.planning.make import PlanGains, PlanPrices, make_plan
    from gnmr_hf.planning.planner import serving_layout

    todo = [(p, k) for p in POINTS for k in KINDS if not result_path(out, alias, "ladder", p, k).is_file()]
    if not todo:
        return
    t0 = time.perf_counter()
    stock = ladder._stock_low(model_path, "nf4", torch.float32)
    units = ladder.rung_gains(stock, model_path, batches)
    layout = serving_layout("vllm", model=stock, linears=[u.name for u in units])
    nf4 = over_low_prices(model_path, [u.name for u in units], "nf4")["low_model_bytes"]
    ref_path = out / alias / "ladder-reference.json"
    if ref_path.is_file():
        ref = json.loads(ref_path.read_text())
    else:
        low = {"profile": ladder._loss(stock, batches), "heldout": ladder._loss(stock, held)}
        del stock
        gc.collect()
        high_model = ladder._all_bf16(model_path, torch.float32)
        high = {"profile": ladder._loss(high_model, batches), "heldout": ladder._loss(high_model, held)}
        del high_model
        ref = {w: {"loss_low": low[w], "loss_high": high[w]} for w in ("profile", "heldout")}
        ref.update(nf4_model_bytes=nf4, profile_tokens=_tokens(batches), heldout_tokens=_tokens(held),
                   units=len(units), serving_groups=len(layout), profile_seconds=round(time.perf_counter() - t0, 1))
        _write(ref_path, ref)
    stock = None
    gc.collect()
    prices = PlanPrices([u.name for u in units], {u.name: (u.rows, u.numel // u.rows) for u in units},
                        {u.name: dict(u.prices) for u in units}, "nf4", nf4, ("int8", "bf16"))
    gains = PlanGains(units, "first_order", len(batches), _tokens(batches))
    for pct, kind in todo:
        t1 = time.perf_counter()
        budget = int(pct / 100 * nf4)
        plan = make_plan(None, batches, budget, ("int8", "bf16"), None if kind == "free" else "vllm", prices=prices,
                         gains=gains, layout=layout)
        chosen, gain, price = plan.rungs, plan.chosen_by["predicted_gain"], plan.price_bytes
        assert price <= budget, (price, budget)
        mixed = ladder.load_planned(model_path, chosen, "nf4", dtype=torch.float32, compute_dtype=torch.float32)
        ladder._reference_layout(mixed)
        loss = {"profile": ladder._loss(mixed.eval(), batches), "heldout": ladder._loss(mixed, held)}
        del mixed
        gc.collect()
        gaps = {w: _gap(ref[w]["loss_low"], ref[w]["loss_high"], loss[w]) for w in loss}
        gap_all = ref["profile"]["loss_low"] - ref["profile"]["loss_high"]
        _write(result_path(out, alias, "ladder", pct, kind), {
            "model": alias, "route": "ladder", "memory_over_nf4_budget": pct / 100, "kind": kind,
            "budget_bytes": budget, "price_over_nf4_bytes": price, "memory_over_nf4": price / nf4,
            "bf16_linears": sum(r == "bf16" for r in chosen.values()),
            "int8_linears": sum(r == "int8" for r in chosen.values()),
            "split_groups": len(split_groups(chosen, layout)),
            # rung_gains sums each batch's gain on its mean loss: per batch, over the batches (equal tokens here)
            "predicted_gain": gain, "predicted_gap_closed": gain / len(batches) / gap_all if gap_all else None,
            "gap_closed": gaps, "loss": loss,
            "rungs": dict(sorted(chosen.items())), "seconds": round(time.perf_counter() - t1, 1)})
        print(f"[group_price] {alias} ladder +{pct}% {kind}: {len(chosen)} linears, gap closed "
              f"{gaps['profile']:.3f} / {gaps['heldout']:.3f}", flush=True)


def run(args: argparse.Namespace) -> None:
    import tempfile

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # the "Loading weights" bar at each of the ladder's loads
    out = Path(args.out)
    if len(args.model) * len(args.routes) > 1:  # one process per model and route: each frees all it held
        import subprocess

        for alias in args.model:
            for route in args.routes:
                for attempt in range(args.retries + 1):
                    code = subprocess.run([sys.executable, __file__, "run", "--model", alias, "--routes", route,
                                           "--out", str(out), "--profile-batches", str(args.profile_batches),
                                           "--heldout", str(args.heldout), "--threads", str(args.threads)]).returncode
                    if code == 0:
                        break
                    # -9: killed (the kernel's OOM killer on a shared machine): the results so far are kept, retry
                    print(f"[group_price] {alias} {route}: exit {code} (attempt {attempt + 1}); "
                          f"{'retrying in 120 s' if attempt < args.retries else 'giving up'}", flush=True)
                    if code != -9 or attempt == args.retries:
                        raise SystemExit(f"{alias} {route} failed (exit {code})")
                    time.sleep(120)
        report(out)
        return
    for alias in args.model:
        if all(result_path(out, alias, r, p, k).is_file() for r in args.routes for p in POINTS for k in KINDS):
            print(f"[group_price] {alias}: done", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="group_price-") as scratch:
            model_path, batches, held = _data(alias, args.profile_batches, args.heldout, Path(scratch))
            _write(out / alias / "setting.json", {
                "model": alias, "task": "pydocs", "profile_batches": len(batches), "heldout_blocks": args.heldout,
                "heldout_batches": len(held), "points_memory_over_nf4": [p / 100 for p in POINTS],
                "threads": args.threads, "compute": "float32, CPU"})
            if "bf16" in args.routes:
                bf16_route(alias, out, model_path, batches, held)
            if "ladder" in args.routes:
                ladder_route(alias, out, model_path, batches, held)
    report(out)


def report(out: Path) -> str:
    """summary.md and summary.json from the per-plan results."""
    rows = []
    for path in sorted(out.glob("*/*-*-*.json")):
        r = json.loads(path.read_text())
        if "kind" in r:
            rows.append(r)
    order = {m: i for i, m in enumerate(MODELS)}
    rows.sort(key=lambda r: (order.get(r["model"], 9), ROUTES.index(r["route"]), r["memory_over_nf4_budget"],
                             KINDS.index(r["kind"])))
    lines = ["| model | route | budget over NF4 | plan | INT8 | BF16 | split groups | served over NF4 | "
             "predicted | gap closed (profile, in-sample) | gap closed (held-out) | grouped - free (profile) | "
             "grouped - free (held-out) |", "|" + "---|" * 13]

    def f3(v):
        return "-" if v is None else f"{v:.3f}"

    free_of = {(r["model"], r["route"], r["memory_over_nf4_budget"]): r for r in rows if r["kind"] == "free"}
    summary = []
    for r in rows:
        f = free_of.get((r["model"], r["route"], r["memory_over_nf4_budget"])) if r["kind"] == "grouped" else None
        d = {w: (r["gap_closed"][w] - f["gap_closed"][w]) if f and r["gap_closed"].get(w) is not None
             and f["gap_closed"].get(w) is not None else None for w in ("profile", "heldout")}
        lines.append(f"| {r['model']} | {'BF16-only' if r['route'] == 'bf16' else 'ladder'} | "
                     f"+{100 * r['memory_over_nf4_budget']:g} % | {r['kind']} | {r['int8_linears']} | "
                     f"{r['bf16_linears']} | {r['split_groups']} | +{100 * r['memory_over_nf4']:.1f} % | "
                     f"{f3(r['predicted_gap_closed'])} | {f3(r['gap_closed'].get('profile'))} | "
                     f"{f3(r['gap_closed'].get('heldout'))} | "
                     + " | ".join("" if f is None else "-" if d[w] is None else f"{d[w]:+.3f}"
                                  for w in ("profile", "heldout")) + " |")
        summary.append({k: v for k, v in r.items() if k not in ("kept", "rungs")} | {"grouped_minus_free": d})
    refs = {}
    for path in sorted(out.glob("*/*-reference.json")):
        refs[f"{path.parent.name}/{path.stem}"] = json.loads(path.read_text())
    text = ("Free against grouped plans (grouped: whole serving groups, q/k/v and gate/up of a layer together), "
            "forward only, no training; gap closed = (L_nf4 - L) / (L_nf4 - L_bf16). Command: "
            "`python bench/value/group_price.py run --out bench/results/group_price`.\n\n" + "\n".join(lines) + "\n")
    (out / "summary.md").write_text(text)
    _write(out / "summary.json", {"rows": summary, "references": refs})
    print(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (resumable), then write the summary")
    r.add_argument("--model", default=",".join(MODELS), type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                   help=f"comma-separated offline aliases (default {','.join(MODELS)}; resolved by resolve_model)")
    r.add_argument("--out", default="bench/results/group_price")
    r.add_argument("--routes", default=",".join(ROUTES), type=lambda s: s.split(","))
    r.add_argument("--profile-batches", type=int, default=2)
    r.add_argument("--heldout", type=int, default=24, help="held-out 256-token blocks (batches of 4)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--retries", type=int, default=5, help="reruns of a model and route killed by the OOM killer")
    s = sub.add_parser("report", help="write summary.md / summary.json from the results")
    s.add_argument("--out", default="bench/results/group_price")
    args = p.parse_args(argv)
    if args.cmd == "run":
        bad = [m for m in args.model if m not in MODELS] + [x for x in args.routes if x not in ROUTES]
        if bad:
            p.error(f"unknown model or route: {', '.join(bad)} (models: {', '.join(MODELS)}; routes: {', '.join(ROUTES)})")
        run(args)
    else:
        report(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
