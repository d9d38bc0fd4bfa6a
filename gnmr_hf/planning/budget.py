"""Budget currencies: extra BF16 bytes (``10%``, ``0.1``, ``300MB``) and memory over the all-low model
(``+10%nf4``), and the price table in both.

The one currency (:func:`served_budget`, docs/profile.md "The one budget currency"): every budget is what the
plan adds to the served model over the all-low one, BF16 rungs at BF16 bytes, INT8 rungs as bitsandbytes stores
them, less the low bytes they replace, whatever dtype training computes in; :func:`budget_refusal` says in one
line why a budget cannot be planned. :func:`gnmr_hf.planning.make.make_plan` plans in it directly (no
conversion into BF16 bytes)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# parse_budget lives in gnmr_hf.memory (no torch there): gnmr-hf profile checks --budget before its heavy imports
from gnmr_hf.memory import (
    extra_bytes_over_low,
    parse_budget,  # noqa: F401  (re-exported: gnmr_hf.planning.parse_budget)
    parse_memory_budget,
    predict_model_bytes,
    weight_bytes,
)
from gnmr_hf.planning.plan import LOWS
from gnmr_hf.planning.results import _fmt, _pct

if TYPE_CHECKING:
    from gnmr_hf.planning.planner import PrecisionPlan


def memory_budget(text: str, model_path: str | os.PathLike, modules: Sequence[str], low: str,
                  double_quant: bool = False) -> dict[str, Any] | None:
    """A budget written as memory over the all-low model (``"+10%nf4"``, :func:`gnmr_hf.memory.parse_memory_budget`)
    in bytes over that model as served; ``None`` for a budget in another form.

    The all-low model is ``model_path``'s checkpoint as a stock load stores it (``modules``, the quantised
    linears, in ``low`` with their quant states; everything else in BF16), priced from its config on the
    meta device (:func:`gnmr_hf.memory.predict_model_bytes`).

    Returns ``{"fraction", "low", "low_model_bytes", "over_low_bytes", "bf16_per_over_byte"}``.

    Raises:
        ValueError: the budget names another low path than ``low`` (one line).
    """
    parsed = parse_memory_budget(str(text))
    if parsed is None:
        return None
    fraction, cur = parsed
    if cur != low:
        raise ValueError(f"budget {text!r} is memory over the {cur} model, but this model's low path is {low}")
    out = over_low_prices(model_path, modules, low, double_quant)
    return {"fraction": fraction, **out, "over_low_bytes": int(fraction * out["low_model_bytes"])}


def over_low_prices(model_path: str | os.PathLike, modules: Sequence[str], low: str,
                    double_quant: bool = False) -> dict[str, Any]:
    """``{"low", "low_model_bytes", "bf16_per_over_byte"}``: the all-low model's bytes as a stock load stores it,
    and the quantised linears' BF16 bytes per byte they cost over ``low``, all of them together (a display ratio
    for tables and plots of plans priced in BF16 bytes; no plan is chosen by it)."""
    meta = _meta_model(model_path)
    mods = dict(meta.named_modules())
    missing = [m for m in modules if m not in mods]
    if missing:
        raise ValueError(f"{len(missing)} quantised linear(s) not in {model_path}'s config, e.g. {missing[0]}")
    low_total = predict_model_bytes(meta, list(modules), low, double_quant=double_quant)["total"]
    bf16 = {m: weight_bytes(mods[m].weight.numel(), mods[m].weight.shape[0], "bf16").total for m in modules}
    price = {m: extra_bytes_over_low(mods[m].weight.numel(), mods[m].weight.shape[0], low, double_quant=double_quant)
             for m in modules}
    return {"low": low, "low_model_bytes": low_total, "bf16_per_over_byte": sum(bf16.values()) / sum(price.values())}


def _meta_model(model_path: str | os.PathLike):
    """``model_path``'s model built from its config on the meta device (shapes only, no weight read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def rung_price(numel: int, rows: int, rung: str, low: str = "nf4", double_quant: bool = False) -> int:
    """What a linear of ``numel`` weights and ``rows`` output rows adds to the served model on ``rung`` (``bf16``:
    its BF16 weight; ``int8``: bitsandbytes' int8 weight and FP32 row scales) over storing it in ``low``, quant
    states counted (``gnmr_hf.memory.weight_bytes``)."""
    return (weight_bytes(numel, rows, rung).total
            - weight_bytes(numel, rows, low, double_quant=double_quant).total)


def served_budget(text: str, low_model_bytes: int, all_bf16_price: int, low: str = "nf4") -> int:
    """The budget ``text`` in the one currency: bytes the plan may add to the served all-``low`` model.

    ``+N%nf4``: N % of ``low_model_bytes`` (the all-low model as a stock load stores it); a size (``300MB``):
    that many bytes; a percentage or fraction (``10%``, ``0.1``): that share of ``all_bf16_price``, what keeping
    every quantised linear on BF16 adds (every linear's price is 1.4375 / 2 of its BF16 bytes less its
    64-byte code table, so this is the same share of their BF16 bytes to within the code tables).

    Raises:
        ValueError: a budget that is not one of these forms, or memory over another low path (one line).
    """
    memory = parse_memory_budget(str(text), lows=LOWS)
    if memory is not None:
        fraction, cur = memory
        if cur != low:
            raise ValueError(f"budget {text!r} is memory over the {cur} model, but this model's low path is {low}")
        return int(fraction * low_model_bytes)
    size, fraction = parse_budget(text)
    return size if size is not None else int(fraction * all_bf16_price)


def _bytes(n: float) -> str:
    return f"{int(n)} B ({n / 2**20:.3g} MiB)" if n >= 2**20 else f"{int(n)} B ({n / 2**10:.3g} KiB)" if n >= 2**10 \
        else f"{int(n)} B"


def budget_refusal(text: str, budget: int, cheapest: Sequence[tuple[int, str]], dearest: Sequence[int],
                   names: Sequence[str], low: str = "nf4") -> str | None:
    """Why ``budget`` (``text`` in the one currency, bytes over the all-``low`` model) cannot be planned, in one
    line; None when it can. ``cheapest``: each unit's cheapest rung as ``(price, rung)``; ``dearest``: each unit's
    price on its dearest rung. The budget buys no unit (below every unit's cheapest rung), or exceeds what
    keeping every unit on its dearest rung adds (the BF16 planner's two refusals, in the served currency)."""
    if not cheapest:
        return "the model has no quantised linear to plan"
    price, i = min((c[0], i) for i, c in enumerate(cheapest))
    lo = low.upper()
    head = f"budget {text} = {_bytes(budget)} over the {lo} model"
    if budget < price:
        return (f"{head} buys no unit: the cheapest is {names[i]} on {cheapest[i][1].upper()} at {_bytes(price)} "
                f"over {lo} (give a larger budget, or plan without one: precision nf4)")
    total = sum(dearest)
    if budget > total:
        return (f"{head} exceeds what there is to keep: all {len(dearest)} linears on their dearest rung add "
                f"{_bytes(total)} over {lo} (precision bf16 trains without quantisation)")
    return None


def format_price_table(plans: Sequence[PrecisionPlan], over_low: dict[str, Any] | None = None) -> str:
    """The price table: per budget, predicted and measured gap closed, bytes and modules; with
    ``over_low`` (:func:`memory_budget`'s record) also each plan's memory over the all-low model."""
    wheres = sorted({w for p in plans for w in p.measured}, key=lambda w: (w != "profile", w))
    head = ["budget", "criterion", "predicted gap closed"] + [f"measured gap closed ({w})" for w in wheres] + [
        "extra MiB (BF16)", "% of quantised"] + (
        [f"memory over {over_low['low'].upper()}"] if over_low else []) + ["modules"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        row = [f"{_pct(p.budget_fraction)} %", p.criterion, _fmt(p.predicted_gap_closed, ".3f")]
        row += [_fmt(p.measured.get(w, {}).get("gap_closed"), ".3f") for w in wheres]
        row += [f"{p.bytes / 2**20:.1f}", f"{100 * p.fraction:.1f}"]
        if over_low:
            row.append(f"+{100 * p.bytes / over_low['bf16_per_over_byte'] / over_low['low_model_bytes']:.1f} %")
        row.append(str(len(p.indices)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


