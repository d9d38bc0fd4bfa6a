"""``gnmr-hf profile --low int4 --choose-int4``: the INT4 setting the plan is made over, chosen by measurement.

A W4A16 folder can be written at group 32, 64 or 128 and, where its server takes zero points (vLLM:
:data:`gnmr_hf.serving.TARGETS`), asymmetric (``int4-asym``, W4A16_ASYM). Finer groups and zero points cost bytes
that the plan could spend on BF16 or INT8 linears instead, and which pays depends on the checkpoint (docs/serving.md,
"which INT4 settings"). So each setting the target serves is planned at the *same folder bytes* (the reference:
symmetric INT4 at the coarsest group that divides every decoder linear's input, plus ``--budget`` over it), each
plan's loss measured with that setting's quantiser applied in torch, and the setting whose plan has the lowest
held-out loss (the profile batches' loss without ``--heldout-batches``) is the one the run plans over and writes.
Cost: one gains pass (first-order: a forward and backward per profile batch) and two loss passes per setting; the
winner's prices and gains are returned for the run to plan with, not measured again.
"""

from __future__ import annotations

import argparse
from typing import Any

from gnmr_hf.planning.groups import decoder_linears
from gnmr_hf.planning.make import layout_of, make_plan, plan_budget, plan_gains, plan_prices
from gnmr_hf.planning.plan import PlanError
from gnmr_hf.planning.profile_run import ProfileError
from gnmr_hf.rungs import get_rung
from gnmr_hf.serving import serve_target

#: the rungs every setting is priced and profiled on, as ``gnmr-hf profile --low int4`` prices them (its plans then
#: buy ``--serve``'s rungs among them)
PRICED = ("int8", "bf16")
#: the INT4 groups tried (vLLM's and compressed-tensors' presets use 128; 32 and 64 where a checkpoint pays for them)
GROUPS = (128, 64, 32)


def candidates(model, serve: str | None) -> tuple[list[tuple[str, int]], int]:
    """``([(low, group), ...], reference group)``: every group of :data:`GROUPS` that divides each decoder linear's
    input, symmetric, and asymmetric too where ``serve`` (a vLLM target) takes it; the reference group is the
    coarsest of them. ProfileError in one line when none divides."""
    mods = dict(model.named_modules())
    ins = [mods[n].in_features for n in decoder_linears(model)]
    groups = [g for g in GROUPS if all(i % g == 0 for i in ins)]
    if not groups:
        raise ProfileError(f"--choose-int4: no group of {', '.join(map(str, GROUPS))} divides every decoder linear's "
                           "input size; give --group-size")
    lows = [low for low in ("int4", "int4-asym") if serve is not None and low in serve_target(serve).lows] \
        if serve is not None else ["int4"]
    return [(low, g) for low in lows for g in groups], groups[0]


def choose(args: argparse.Namespace, model, profile_b, heldout_b, swapper, rungs: tuple[str, ...],
           grouped: bool, criterion: str | None = None) -> tuple[str, int, str, list[dict[str, Any]], tuple]:
    """Plan every candidate setting at the reference's bytes plus ``args.budget`` (gains by ``criterion``, the
    run's); returns ``(low, group, budget over the winner's uniform folder as "NB", the table rows, (the winner's
    PlanPrices, its PlanGains))`` and prints the table. ``swapper(spec_args)`` builds the loss measurer of a setting
    (:class:`gnmr_hf.planning.profile_int4._Swapper`)."""
    cands, ref_group = candidates(model, getattr(args, "serve", None))
    ref = plan_prices(model, PRICED, "int4", group_size=ref_group)
    layout = layout_of(model, "vllm", ref) if grouped else None
    try:
        budget = plan_budget(args.budget, ref, layout=layout)
    except PlanError as e:
        raise ProfileError(f"--choose-int4: --budget {args.budget} over uniform W4A16 (group {ref_group}): {e}") from None
    total = ref.low_model_bytes + budget
    rows, measured = [], {}
    for low, g in cands:
        prices = plan_prices(model, PRICED, low, group_size=g)
        row = {"low": low, "group_size": g, "scheme": get_rung(low).exports["compressed-tensors"],
               "uniform_bytes": prices.low_model_bytes, "budget_bytes": total - prices.low_model_bytes}
        rows.append(row)
        if row["budget_bytes"] <= 0:
            row["skipped"] = "its uniform folder alone is over the bytes"
            continue
        try:  # the gains first: they are taken at the model's own (BF16) weights, which the losses swap out
            gains = plan_gains(model, profile_b, prices, criterion)
            measured[low, g] = (prices, gains)
            plan = make_plan(model, profile_b, row["budget_bytes"], rungs, "vllm" if grouped else None, low=low,
                             group_size=g, prices=prices, gains=gains)
        except PlanError as e:
            row["skipped"] = str(e)
            continue
        swap = swapper(argparse.Namespace(low=low, group_size=g), profile_b, heldout_b)
        try:
            row.update(uniform_loss=swap.loss({}), int8=len(plan.on("int8")), bf16=len(plan.on("bf16")),
                       price_bytes=plan.price_bytes, loss=swap.loss(plan.rungs))
        finally:
            swap.restore()
    key = "heldout" if heldout_b else "profile"
    done = [r for r in rows if "loss" in r]
    if not done:
        raise ProfileError(f"--choose-int4: no INT4 setting fits --budget {args.budget}: "
                           + "; ".join(f"{r['scheme']} g{r['group_size']}: {r['skipped']}" for r in rows))
    best = min(done, key=lambda r: r["loss"][key])
    for r in rows:
        r["chosen"] = r is best
    _print(rows, total, key, ref_group)
    return (best["low"], best["group_size"], f"{best['budget_bytes']}B", rows,
            measured[best["low"], best["group_size"]])


def _print(rows: list[dict[str, Any]], total: int, key: str, ref_group: int) -> None:
    where = "held-out" if key == "heldout" else "profile, in-sample"
    print(f"\nINT4 settings at the same folder bytes ({total / 2**20:.2f} MiB of tensors: uniform W4A16 group "
          f"{ref_group} plus the budget), each planned against its own quantiser; loss {where}:")
    print("| setting | uniform folder (MiB) | uniform loss | INT8 / BF16 linears | plan loss | |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        name = f"{r['scheme']} group {r['group_size']}"
        if "loss" not in r:
            print(f"| {name} | {r['uniform_bytes'] / 2**20:.2f} | - | - | - | {r['skipped']} |")
            continue
        print(f"| {name} | {r['uniform_bytes'] / 2**20:.2f} | {r['uniform_loss'][key]:.4f} | {r['int8']} / "
              f"{r['bf16']} | {r['loss'][key]:.4f} | {'**chosen**' if r['chosen'] else ''} |")
