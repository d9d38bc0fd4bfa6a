"""``gnmr-hf profile`` over a bitsandbytes low format (``nf4``, ``fp4``, ``int8``): load the dual-path model,
price the plan in the one currency, profile, choose every plan with :func:`gnmr_hf.planning.make.make_plan`,
print the tables (memory over the low model; held-out figures first, in-sample ones labelled; no gap-closed
ratio whose denominator is within noise), run the ladder table and write ``profile.json`` / ``profile.png``."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gnmr_hf.backends.dispatch import prepare_dual_path
from gnmr_hf.memory import parse_memory_budget
from gnmr_hf.planning.budget import over_low_prices
from gnmr_hf.planning.ladder import MEMORY_POINTS, format_ladder_table, ladder_table
from gnmr_hf.planning.make import (
    PlanPrices,
    layout_of,
    make_plan,
    plan_budget,
    plan_gains,
    plan_prices,
    precision_plan,
)
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.planner import PrecisionPlan, measure_plan
from gnmr_hf.planning.profiler import profile_sensitivity
from gnmr_hf.planning.results import SensitivityProfile
from gnmr_hf.reporting.profile_plot import plot_profile


class ProfileError(Exception):
    """Bad input to ``gnmr-hf profile``: printed as one line, exit code 2."""


#: the price points every profile plans beside its own budget: shares of what every quantised linear on BF16
#: adds over the low model (``"10%"``), in the one currency
PRICE_POINTS = (0.05, 0.10, 0.25)


def examples(batches) -> tuple[int, int]:
    """Examples and target tokens in prepared-or-collated batches."""
    rows = sum(int(b["input_ids"].shape[0]) for b in batches)
    tokens = sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)
    return rows, tokens


def noise_floor(tokens: int) -> float:
    """The smallest loss gap (nats) a gap-closed ratio is printed over: ``1 / sqrt(tokens)``, the standard error
    of a mean over ``tokens`` target tokens of a per-token loss difference with a standard deviation of 1 nat. A
    gap below it is within the noise of the data: the ratio's denominator could be of either sign on other text."""
    return 1.0 / math.sqrt(max(tokens, 1))


def load_dual(args: argparse.Namespace, model_path: Path, dtype):
    """The stock-quantised model with a dual path per linear (``units="linears"``)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if args.low == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.low, bnb_4bit_compute_dtype=dtype)
    print(f"[profile] loading {model_path} in {args.low} ({dtype}) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=qconfig,
                                                 device_map={"": 0} if torch.cuda.is_available() else None)
    if args.low != "int8":
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        keep_reference_layout(model)
    return prepare_dual_path(model, recovery_source=model_path, storage=args.storage, units="linears", dtype=dtype)


def _priced(args: argparse.Namespace, model, model_path: Path) -> tuple[PlanPrices, int, Any, str | None]:
    """The prices, the budget in the one currency (refused before the profile costs anything) and the serving
    groups (None with the reason when the architecture's layout is not known)."""
    prices = plan_prices(model, ("bf16",), args.low, model_path)
    try:
        budget = plan_budget(args.budget, prices)
    except PlanError as e:
        raise ProfileError(f"--budget {args.budget}: {e}") from None
    print(f"[profile] budget {args.budget}: {budget / 2**20:.2f} MiB over the {prices.low_model_bytes / 2**20:.1f} MiB "
          f"{args.low} model as served", flush=True)
    try:
        layout, no_layout = layout_of(model, "vllm", prices), None
    except PlanError as e:
        if args.groups:
            raise ProfileError(f"--groups {args.groups}: {e}") from None
        layout, no_layout = None, str(e)
    if args.groups:
        try:  # the grouped plan's own refusal: a budget below the cheapest whole group
            plan_budget(args.budget, prices, layout=layout)
        except PlanError as e:
            raise ProfileError(f"--budget {args.budget} with --groups {args.groups}: {e}") from None
    return prices, budget, layout, no_layout


class _Plans:
    """Every plan a profile prints, chosen by make_plan from one profile, and their controller views."""

    def __init__(self, args, model, model_path, prof: SensitivityProfile, name: str, prices: PlanPrices,
                 batches, heldout):
        self.args, self.model, self.model_path, self.prices = args, model, model_path, prices
        self.batches, self.heldout = batches, heldout
        self.prof = prof
        self.gains = plan_gains(model, batches, prices, name, profile=prof)
        self.ref = None
        if heldout:
            m = measure_plan(model, [], heldout)
            self.ref = (m["loss_low"], m["loss_high"])

    def make(self, budget, groups, text: str | None = None) -> tuple[Plan, PrecisionPlan]:
        plan = make_plan(self.model, self.batches, budget, ("bf16",), groups, self.gains.criterion, low=self.args.low,
                         model_path=self.model_path, prices=self.prices, gains=self.gains, budget_text=text)
        view = precision_plan(plan, self.prof, self.model, self.batches)
        # the plan's price as the table prints it (memory over the all-low model as served): the picture's x
        view.over_low_pct = 100 * plan.price_bytes / plan.chosen_by["low_model_bytes"]
        if self.heldout:
            view.measured["heldout"] = measure_plan(self.model, view.indices, self.heldout, reference=self.ref)
        return plan, view

    def points(self, main_budget: int, groups) -> list[tuple[Plan, PrecisionPlan]]:
        """The plan at each price point that buys something, and the main one, by budget."""
        out = []
        for f in tqdm(PRICE_POINTS, desc="plans", disable=self.args.quiet):
            b = int(f * self.prices.dearest)
            if b == main_budget:
                continue
            try:
                out.append(self.make(b, groups, f"{100 * f:g} %"))
            except PlanError:  # a tiny model's smallest budgets buy no linear
                continue
        out.append(self.make(main_budget, groups, self.args.budget))
        return sorted(out, key=lambda pv: pv[0].budget_bytes)


def _gap(view: PrecisionPlan, where: str, floor: float) -> str:
    m = view.measured.get(where)
    if not m:
        return "-"
    if abs(m["loss_low"] - m["loss_high"]) < floor:
        return "noise"
    return f"{m['gap_closed']:.3f}"


def format_plans(rows: list[tuple[str, Plan, PrecisionPlan]], low: str, floors: dict[str, float],
                 paired: bool = False) -> str:
    """The plans in one currency: budget and price as memory over the all-low model as served, held-out gap
    closed first, in-sample labelled; ``noise`` where the gap's denominator is below :func:`noise_floor`.
    ``paired``: rows come as (free, grouped) at each budget, and each grouped row says what the constraint cost
    (grouped - free gap closed)."""
    wheres = [w for w in ("heldout", "profile") if any(w in v.measured for _, _, v in rows)]
    label = {"heldout": "held-out", "profile": "profile, in-sample"}
    lo = low.upper()
    head = (["budget", "plan", f"memory over {lo} (budget)", f"memory over {lo} (plan)", "linears", "predicted gain"]
            + [f"gap closed ({label[w]})" for w in wheres] + ([f"grouped - free ({w})" for w in wheres] if paired else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    previous = None
    for kind, plan, view in rows:
        low_bytes = plan.chosen_by["low_model_bytes"]
        row = [plan.budget or "", kind, f"+{100 * plan.budget_bytes / low_bytes:.2f} %",
               f"+{100 * plan.price_bytes / low_bytes:.2f} %", str(len(plan.rungs)),
               f"{plan.chosen_by['predicted_gain']:.4g}"]
        row += [_gap(view, w, floors.get(w, 0.0)) for w in wheres]
        if paired:
            if plan.groups and previous is not None:
                a, b = ([_gap(v, w, floors.get(w, 0.0)) for w in wheres] for v in (view, previous))
                row += [f"{float(x) - float(y):+.3f}" if x not in ("-", "noise") and y not in ("-", "noise") else x
                        for x, y in zip(a, b)]
            else:
                row += [""] * len(wheres)
        previous = view
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _noise_note(prof: SensitivityProfile, views, floors: dict[str, float]) -> str | None:
    gaps = {"profile": prof.losses["low"] - prof.losses["high"]}
    for v in views:
        for w, m in v.measured.items():
            gaps[w] = m["loss_low"] - m["loss_high"]
    noisy = [w for w, g in gaps.items() if abs(g) < floors.get(w, 0.0)]
    if not noisy:
        return None
    return (f"[profile] no gap closed printed on {', '.join(noisy)}: L_low - L_high = "
            f"{', '.join(f'{gaps[w]:.4f}' for w in noisy)} nats, within noise (below 1/sqrt(target tokens) = "
            f"{', '.join(f'{floors[w]:.4f}' for w in noisy)}): profile on more of the text the model will train on "
            "(--data FILE, more --batches / --heldout-batches)")


def run_bnb(args: argparse.Namespace, model_path: Path, recipe, batches, heldout, dtype, out: Path,
            started: float, criteria: tuple[str, ...]) -> int:
    """The bitsandbytes low formats' profile (see the module docstring)."""
    model = load_dual(args, model_path, dtype)
    prices, budget, layout, no_layout = _priced(args, model, model_path)
    if "lora_grad" in criteria:
        import peft

        lora = recipe.lora
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha,
                                                           lora_dropout=lora.lora_dropout,
                                                           target_modules=lora.lora_target_modules,
                                                           task_type="CAUSAL_LM"))
    prof = profile_sensitivity(model, batches, criteria=criteria, progress=not args.quiet)
    name = prof._score_name(criteria[0]) if criteria[0] not in prof.skipped else None
    if name is None:
        raise ProfileError(f"criterion {criteria[0]} was skipped: {prof.skipped[criteria[0]]}")
    plans = _Plans(args, model, model_path, prof, name, prices, batches, heldout)
    print(f"[profile] choosing and measuring the plans at {len(PRICE_POINTS) + 1} budgets ...", flush=True)
    chosen = plans.points(budget, args.groups)
    main_plan, main_view = next(pv for pv in chosen if pv[0].budget_bytes == budget)
    floors = {"profile": noise_floor(prof.tokens)}
    if heldout:
        floors["heldout"] = noise_floor(examples(heldout)[1])
    print()
    print(prof.table(name, top=15))
    print()
    print(prof.cost_table())
    grouping = _print_plans(args, prof, plans, chosen, layout, no_layout, floors)
    ladder_rows = _ladder(args, model_path, batches, dtype, floors["profile"])
    _write(args, out, model_path, prof, name, main_plan, main_view, [v for _, v in chosen], grouping, ladder_rows,
           prices, started, floors)
    return 0


def _print_plans(args, prof, plans: _Plans, chosen, layout, no_layout, floors) -> dict[str, Any] | None:
    """The plan table (free and grouped side by side when the serving layout is known); returns the grouping
    record for profile.json."""
    rows, grouping = [], None
    if layout is not None:
        grouping = {"groups": "vllm", "plans": []}
        for plan, view in tqdm(chosen, desc="grouped plans" if not args.groups else "free plans", disable=args.quiet):
            other = None if args.groups else "vllm"
            try:
                pair = [(plan, view), plans.make(plan.budget_bytes, other, plan.budget)]
            except PlanError:  # the budget buys no whole group
                continue
            pair.sort(key=lambda pv: pv[0].groups is not None)
            for p, v in pair:
                kind = "grouped (vllm)" if p.groups else "free"
                rows.append((kind, p, v))
                grouping["plans"].append({"kind": "grouped" if p.groups else "free", "budget_bytes": p.budget_bytes,
                                          "price_bytes": p.price_bytes, "bytes": v.bytes, "linears": len(p.rungs),
                                          "predicted_gap_closed": v.predicted_gap_closed, "measured": v.measured})
    else:
        rows = [("grouped (vllm)" if p.groups else "free", p, v) for p, v in chosen]
    print(f"\nprice table (plans chosen by {plans.gains.criterion} per byte as served; budget and price in memory over the all-"
          f"{args.low} model, {plans.prices.low_model_bytes / 2**20:.1f} MiB; gap closed = (L_low - L_plan) / "
          f"(L_low - L_high), held-out first, then in-sample on the {len(plans.batches)} profile batch(es) the plans "
          f"were chosen on; the plan written is the {'grouped' if args.groups else 'free'} one at {args.budget}):")
    print(format_plans(rows, args.low, floors, paired=layout is not None))
    note = _noise_note(prof, [v for _, _, v in rows], floors)
    if note:
        print(note)
    if layout is None:
        print(f"\n[profile] no grouped plans: {no_layout}")
    return grouping


def _ladder(args, model_path: Path, batches, dtype, floor: float) -> dict[str, Any] | None:
    if args.low == "int8" or args.no_ladder:
        return None
    print(f"\n[profile] the precision ladder: each linear on {args.low}, INT8 or BF16, planned under memory over "
          f"the {args.low} model (one load, each row's plan swapped in) ...", flush=True)
    started = time.time()
    # a budget written as memory over the low model gets its own rows: their ladder plan is the file's ladder
    # plan (gnmr_hf.planning.plan.Plan.load(..., rung_set=("int8", "bf16")); a recipe's --profile.plan)
    memory = parse_memory_budget(args.budget)
    points = MEMORY_POINTS if memory is None or memory[1] != args.low else \
        tuple(sorted(set(MEMORY_POINTS) | {memory[0]}))
    rows = ladder_table(model_path, batches, args.low, dtype=dtype, points=points, progress=not args.quiet)
    print(f"[profile] ladder table: {len(rows['rows'])} rows in {time.time() - started:.0f} s", flush=True)
    print(f"ladder price table (gap closed on the profile batches, in-sample; L_low {rows['loss_low']:.4f}, "
          f"L_high {rows['loss_high']:.4f} as stock-loaded; served over {args.low} = the rungs' exact bytes with BF16 "
          "rungs in BF16):")
    print(format_ladder_table(rows, floor))  # floor: the profile batches' noise floor
    if abs(rows["loss_low"] - rows["loss_high"]) < floor:
        print(f"[profile] the ladder's gap closed is not printed: L_low - L_high = "
              f"{rows['loss_low'] - rows['loss_high']:.4f} nats, below 1/sqrt(target tokens) = {floor:.4f} (--data "
              "FILE, more --batches)")
    if args.groups:
        print("(the ladder's rows are free plans; a grouped ladder: make_plan(..., rungs=('int8', 'bf16'), "
              "groups='vllm') or a recipe's profile.rungs with profile.groups: vllm)")
    return rows


def summary(plan: Plan, view: PrecisionPlan, floors: dict[str, float]) -> str:
    """The plan written, in the one currency: its linears, its price and budget over the all-low model as served,
    what its recovery path holds while profiling, its predicted gain and its measured gap closed (held-out
    first; ``noise`` as in the table)."""
    low_bytes, lo = plan.chosen_by["low_model_bytes"], plan.low.upper()
    lines = [f"the plan written ({plan.describe()}, by {plan.chosen_by['criterion']}): {len(plan.rungs)} linear(s) "
             f"on BF16, +{100 * plan.price_bytes / low_bytes:.2f} % over the all-{lo} model as served "
             f"({plan.price_bytes / 2**20:.2f} MiB; budget {plan.budget} = +{100 * plan.budget_bytes / low_bytes:.2f} "
             f"%), predicted gain {plan.chosen_by['predicted_gain']:.4g}"]
    if view.held_bytes is not None:
        lines.append(f"  held on the profiled model's recovery path: {view.held_bytes / 2**20:.2f} MiB")
    for where in ("heldout", "profile"):
        m = view.measured.get(where)
        if m:
            label = "held-out" if where == "heldout" else "the profile batches (in-sample)"
            lines.append(f"  measured on {label}: L_low {m['loss_low']:.4f}, L_plan {m['loss_plan']:.4f}, L_high "
                         f"{m['loss_high']:.4f}, gap closed {_gap(view, where, floors.get(where, 0.0))}")
    if view.names:
        lines.append("  linears: " + ", ".join(view.names))
    return "\n".join(lines)


def _write(args, out: Path, model_path: Path, prof, name, main_plan: Plan, main_view: PrecisionPlan, views,
           grouping, ladder_rows, prices: PlanPrices, started: float, floors: dict[str, float]) -> None:
    print()
    print(summary(main_plan, main_view, floors))
    skips = main_view.skip_modules()
    units_json = [{"index": u.index, "name": u.name, "bytes": u.bytes, "score": u.scores[name],
                   "modules": u.modules, "layer": u.layer, "op": u.op, "scores": u.scores} for u in prof.units]
    out.mkdir(parents=True, exist_ok=True)
    record = {**main_view.to_dict(), "budget": args.budget, "budget_bytes": main_plan.budget_bytes,
              "price_bytes": main_plan.price_bytes, "low_model_bytes": prices.low_model_bytes,
              "currency": main_plan.chosen_by["currency"], "criterion": name,
              "serve": getattr(args, "serve", None)}
    if args.low == "nf4":  # the key Plan.load reads a plan's price in the one currency from
        record["price_over_nf4_bytes"] = main_plan.price_bytes
    path = prof.to_json(out / "profile.json", skip_modules=skips, criterion=name, budget=args.budget,
                        low=args.low, plan=record, price=[v.to_dict() for v in views], units=units_json,
                        **({} if ladder_rows is None else {"ladder": ladder_rows}),
                        **({} if grouping is None else {"grouping": grouping}),
                        command="gnmr-hf profile " + shlex.join(args.argv))
    written = [str(path)]
    if not args.no_plot:
        print(f"[profile] drawing {out / 'profile.png'} ...", flush=True)
        try:
            over_low = over_low_prices(model_path, prices.linears, args.low)
            title = f"{Path(str(model_path)).name}, {args.low}: profiled on {prof.tokens} target tokens"
            written.append(str(plot_profile(prof, views, out / "profile.png", name, title=title, over_low=over_low,
                                            ladder=ladder_rows)))
        except ImportError:
            print("[profile] matplotlib is not installed: no profile.png (pip install matplotlib)", file=sys.stderr)
    print()
    print("load with these linears unquantised:\n"
          f"  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={args.low!r}, llm_int8_skip_modules=json.load("
          f"open({str(path)!r}))['skip_modules'])" if args.low != "int8" else
          f"  BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=json.load(open({str(path)!r}))['skip_modules'])")
    print(f"[profile] wrote {', '.join(written)} in {time.time() - started:.0f} s")
