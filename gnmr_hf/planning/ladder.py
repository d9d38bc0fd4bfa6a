"""The precision ladder: each quantised linear on its 4-bit path, on INT8 or on BF16, planned under one
memory budget over the 4-bit model, and loaded from stock bitsandbytes modules.

Keeping a linear on BF16 costs ~1.44 bytes a weight over NF4 (2 against ~0.56 with its block scales);
on INT8 (LLM.int8, row-wise, ``Linear8bitLt(has_fp16_weights=False)``) ~0.44, a third. Where the 4-bit
error is spread over many linears, INT8 on three may buy more than BF16 on one.

- :func:`rung_gains`: for every decoder linear of a stock-loaded 4-bit model and every rung, the
  first-order gain ``-<dL/dy, y_rung - y_low>`` summed over the batches' tokens (``y_rung`` computed as
  that rung computes: the BF16 checkpoint weight, or a real ``Linear8bitLt`` over it), from one forward
  and backward at the all-low point; and each rung's price over the low path (``gnmr_hf.memory``).
- :func:`choose_rungs`: the multiple-choice knapsack (at most one rung per linear) under a byte budget:
  greedy by gain per byte over each linear's upper convex hull of (price, gain), upgrades included;
  :func:`choose_rungs_exact` solves small instances exhaustively (the tests compare the two);
  ``fill=True`` spends what it leaves unspent on INT8 -> BF16 upgrades (:func:`fill_upgrades`).
- :func:`load_planned`: the mixed model from stock modules: ``Linear4bit`` (or ``Linear8bitLt``) for
  the low linears, ``Linear8bitLt`` for the INT8 rungs, plain BF16 ``nn.Linear`` for the BF16 rungs.
- :func:`ladder_table`: each rung set's plan at each budget and its measured loss, every plan swapped into one
  loaded low model in place (:func:`gnmr_hf.planning.rung_swap.swap_rungs`, the modules :func:`load_planned`
  loads) instead of a load per plan.

Serving: a checkpoint with both 4-bit and 8-bit linears is not something stock transformers loads from
one ``quantization_config`` (one ``load_in_4bit`` / ``load_in_8bit`` per model), so ``gnmr-hf export``
writes BF16 rungs only; for a ladder plan ``load_planned`` is the loader, and the merged route (the
adapter folded into BF16) the portable one.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gnmr_hf.backends.recovery import LADDER_SERVING, RUNGS, check_rungs, int8_linear  # noqa: F401
from gnmr_hf.memory import model_bytes
from gnmr_hf.planning.budget import over_low_prices
from gnmr_hf.planning.groups import ServingGroup, expand_rungs, grouped_ladder_units
from gnmr_hf.planning.passes import _loss as _batch_loss
from gnmr_hf.planning.plan import Plan, recorded_identity
from gnmr_hf.planning.profiler import identity_mismatch
from gnmr_hf.planning.rung_swap import CheckpointLinears as _CheckpointLinears
from gnmr_hf.planning.rung_swap import rung_module, swap_rungs
from gnmr_hf.rungs import get_rung, planned_rungs
from gnmr_hf.units import find_decoder_layers


@dataclass
class LadderUnit:
    name: str  # the linear's full name in the stock-loaded model (model.layers.3.self_attn.v_proj)
    numel: int
    rows: int
    gains: dict[str, float] = field(default_factory=dict)  # rung -> first-order gain (loss units)
    prices: dict[str, int] = field(default_factory=dict)  # rung -> bytes over the low path


def rung_prices(numel: int, rows: int, low: str = "nf4", double_quant: bool = False) -> dict[str, int]:
    """Bytes each registered planned rung costs over ``low`` (the whole stored state counted: each rung's own
    ``bytes``, :mod:`gnmr_hf.rungs`)."""
    return {r: get_rung(r).price(numel, rows, low, double_quant=double_quant) for r in planned_rungs()}


def decoder_low_linears(model) -> list[str]:
    """The 4-bit / 8-bit linears inside the decoder layers of a stock-loaded model, in module order."""
    import bitsandbytes as bnb

    return [n for n, m in model.named_modules()
            if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and ".layers." in n]


def rung_gains(model, model_path: str | os.PathLike, batches, low: str = "nf4", double_quant: bool = False,
               int8_threshold: float = 6.0, rungs: tuple[str, ...] | None = None,
               progress: bool = False) -> list[LadderUnit]:
    """Every decoder linear's first-order gain on each rung (see the module docstring).

    ``model`` is the stock-loaded low model (``BitsAndBytesConfig(load_in_4bit=True, ...)``), ``model_path``
    its BF16 checkpoint, ``batches`` dicts with ``input_ids`` and ``labels`` (any mapping). ``rungs``: the
    rungs to score (default the stock :data:`RUNGS`; any registered planned rung, :mod:`gnmr_hf.rungs`: its
    output is its ``module``'s over the checkpoint weight, or the linear over its ``fake_quant`` weight).
    ``progress``: a bar with one tick per batch.

    Memory: the forward keeps only each linear's input (which a LoRA training step saves too); the linear's
    low-path output and its rungs' outputs are computed again from it when its output gradient arrives, one
    rung at a time, and each rung's weight is read from the checkpoint (and quantised, for INT8) there and
    freed after. The gains are those of computing the differences in the forward (the same operations on the
    same tensors), without holding two output-sized differences per linear for the whole backward, nor every
    linear's BF16 and INT8 weights for the whole call.
    """
    names = decoder_low_linears(model)
    if not names:
        raise ValueError("rung_gains needs a bitsandbytes-quantised model: no 4-bit/8-bit linear in its decoder layers")
    weights = _CheckpointLinears(model_path, names)
    modules = dict(model.named_modules())
    units = []
    for n in names:
        numel, rows = math.prod(weights.shapes[n]), weights.shapes[n][0]
        units.append(LadderUnit(n, numel, rows, prices=rung_prices(numel, rows, low, double_quant)))
    scored = tuple(rungs or RUNGS)
    specs = {r: get_rung(r) for r in scored}
    acc = {n: {r: 0.0 for r in scored} for n in names}

    def rung_output(name: str, rung: str, x, w):
        spec = specs[rung]
        if spec.module is None:  # BF16: the checkpoint weight itself; a registered rung: its fake quantisation
            return torch.nn.functional.linear(x, spec.fake_quant(w).to(device=x.device, dtype=x.dtype))
        # the rung's module on the linear's device (a GPU-loaded model's hooks see CUDA inputs): INT8 quantises
        # the checkpoint weight as load_in_8bit does
        return spec.module(w.to(device=modules[name].weight.device), int8_threshold=int8_threshold)(x)

    def hook(name):
        def fn(mod, inp, out):
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                return
            x = inp[0].detach()
            version = x._version

            def on_grad(g, x=x, version=version):
                if x._version != version:
                    raise RuntimeError(f"rung_gains: the input of {name} was changed in place after its forward")
                with torch.enable_grad():
                    # the low path's output again: the same module on the same input, with the input requiring
                    # grad as in the forward (bitsandbytes takes another kernel for an input that needs none)
                    low_out = mod.forward(x.detach().requires_grad_(True)).detach()
                with torch.no_grad():
                    w = weights[name]  # read once for both rungs, freed with this call
                    for r in scored:
                        y = rung_output(name, r, x, w)
                        d = y.to(low_out.dtype) - low_out
                        del y
                        acc[name][r] -= float((g * d).sum(dtype=torch.float64))
                        del d

            out.register_hook(on_grad)
        return fn

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = base.get_input_embeddings()
    flags = [(p, p.requires_grad) for p in model.parameters()]
    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    handles.append(emb.register_forward_hook(lambda m, i, o: o.requires_grad_(True)))
    was_training = model.training
    model.eval()
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad():
            for b in tqdm(batches, desc="ladder gains", disable=not progress):
                b = dict(b)
                # the loss without the batch's full-vocabulary logits (the profile's own, passes._loss): the
                # hooks sit on the decoder linears, which the decoder-only forward runs all the same
                batch = {"input_ids": b["input_ids"], "labels": b["labels"]}
                if b.get("attention_mask") is not None:
                    batch["attention_mask"] = b["attention_mask"]
                _batch_loss(model, batch).backward()
    finally:
        for h in handles:
            h.remove()
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)
    for u in units:
        u.gains = dict(acc[u.name])
    return units


def _hull(options: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The upper convex hull of (price, gain, rung) from (0, 0, 'low'), gains strictly increasing."""
    pts = sorted((p, g, r) for p, g, r in options if g > 0 and p > 0)
    hull = [(0, 0.0, "low")]
    for p, g, r in pts:
        if g <= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (p1, g1, _), (p2, g2, _) = hull[-2], hull[-1]
            # drop the middle point if it lies on or below the line from hull[-2] to (p, g)
            if (g2 - g1) * (p - p1) <= (g - g1) * (p2 - p1):
                hull.pop()
            else:
                break
        hull.append((p, g, r))
    return hull


def choose_rungs(units: list[LadderUnit], budget: int, rungs: tuple[str, ...] = RUNGS,
                 fill: bool = False, groups=None) -> dict[str, str]:
    """``{linear: rung}`` for the linears not left low, greedy by gain per byte with upgrades (each
    linear's convex hull of rungs; an upgrade is taken only after the step below it).

    ``fill``: spend what the knapsack leaves of ``budget`` on INT8 -> BF16 upgrades of its INT8 picks
    (those with a positive BF16 gain, largest BF16 gain per upgrade byte first), see :func:`fill_upgrades`.

    ``groups``: None (the default: each linear on its own rung) or the serving groups of the model
    (:func:`gnmr_hf.planning.groups.serving_groups`, e.g. ``serving_groups(model)`` or
    ``gnmr_hf.planning.planner.serving_layout("vllm", model)``): one rung per group, every member on it, so
    the plan never splits a group vLLM fuses into one module; a group's price and gain on a rung are the
    sums of its members' (:func:`gnmr_hf.planning.groups.grouped_ladder_units`), and the result is still
    ``{linear: rung}``. ``units`` must be exactly the groups' linears.
    """
    if groups is not None:
        if isinstance(groups, str) or not all(isinstance(g, ServingGroup) for g in groups):
            given = repr(groups) if isinstance(groups, str) else f"a {type(groups).__name__} of other things"
            raise ValueError(f"choose_rungs(groups=...) takes the model's serving groups (gnmr_hf.planning.groups."
                             f"serving_groups(model)), not {given}")
        return expand_rungs(choose_rungs(grouped_ladder_units(units, groups), budget, rungs, fill), groups)
    steps = []
    for i, u in enumerate(units):
        hull = _hull([(u.prices[r], u.gains[r], r) for r in rungs])
        for k in range(1, len(hull)):
            dp, dg = hull[k][0] - hull[k - 1][0], hull[k][1] - hull[k - 1][1]
            steps.append((dg / dp, i, k, dp, hull[k][2]))
    steps.sort(key=lambda s: (-s[0], s[1], s[2]))
    used, level, chosen, blocked = 0, {}, {}, set()
    for _, i, k, dp, rung in steps:
        if i in blocked or level.get(i, 0) != k - 1:
            continue
        if used + dp <= budget:
            used += dp
            level[i] = k
            chosen[units[i].name] = rung
        else:
            blocked.add(i)  # its later upgrades would skip this one
    if fill and "int8" in rungs and "bf16" in rungs:
        chosen = fill_upgrades(units, chosen, budget)
    return chosen


def fill_upgrades(units: list[LadderUnit], chosen: dict[str, str], budget: int) -> dict[str, str]:
    """``chosen`` with the bytes it leaves of ``budget`` spent on INT8 -> BF16 upgrades.

    Why: INT8's weight error is about a tenth of NF4's and uncorrelated with the gradient, so a
    first-order estimate scores a linear's INT8 and BF16 rungs alike (their difference is the gradient
    against INT8's small residual: noise); where the two tie, the knapsack buys INT8 and no upgrade,
    and a budget with more room than the positive-gain linears need on INT8 is left partly unspent. BF16
    removes the residual that INT8 keeps, so the bytes the user allowed go to upgrades: the INT8 picks
    whose BF16 gain is positive, largest BF16 gain per upgrade byte first, each while it fits.
    """
    by = {u.name: u for u in units}
    used = plan_gain(units, chosen)[1]
    out = dict(chosen)

    def extra(n):
        return by[n].prices["bf16"] - by[n].prices["int8"]

    todo = [n for n, r in chosen.items() if r == "int8" and by[n].gains["bf16"] > 0 and extra(n) > 0]
    for n in sorted(todo, key=lambda n: (-by[n].gains["bf16"] / extra(n), n)):
        if used + extra(n) <= budget:
            used += extra(n)
            out[n] = "bf16"
    return out


def choose_rungs_exact(units: list[LadderUnit], budget: int, rungs: tuple[str, ...] = RUNGS) -> dict[str, str]:
    """The optimum by exhaustive search (small instances: (len(rungs) + 1) ** len(units) choices)."""
    best, best_gain = {}, 0.0
    for combo in itertools.product(("low",) + tuple(rungs), repeat=len(units)):
        price = sum(u.prices[r] for u, r in zip(units, combo) if r != "low")
        if price > budget:
            continue
        gain = sum(u.gains[r] for u, r in zip(units, combo) if r != "low")
        if gain > best_gain + 1e-15:
            best_gain, best = gain, {u.name: r for u, r in zip(units, combo) if r != "low"}
    return best


def plan_gain(units: list[LadderUnit], chosen: dict[str, str]) -> tuple[float, int]:
    by = {u.name: u for u in units}
    return (sum(by[n].gains[r] for n, r in chosen.items()), sum(by[n].prices[r] for n, r in chosen.items()))


#: the low paths :func:`load_planned` loads the other decoder linears in
LOW_PATHS = ("nf4", "fp4", "int8")


def load_planned(model_path: str | os.PathLike, rungs: dict[str, str] | str | os.PathLike, low: str = "nf4",
                 dtype=None, compute_dtype=None, double_quant: bool = False, int8_threshold: float = 6.0,
                 device_map=None):
    """The mixed model from stock modules: ``rungs`` maps full linear names to ``"bf16"`` or ``"int8"``; every
    other decoder linear is ``low`` (``nf4``, ``fp4`` or ``int8``), ``lm_head`` stays unquantised.
    ``device_map`` is ``from_pretrained``'s (e.g. ``{"": 0}``).

    ``rungs`` may also be a plan file, or the folder holding its ``profile.json``: a recipe's ``profile.json``
    with a ``rungs`` mapping (``profile.rungs: [int8, bf16]``), or a BF16-only one (``gnmr-hf profile
    --budget``, a ``planned-*`` recipe), whose planned linears (its ``skip_modules`` less the modules it keeps
    by default) are loaded as BF16 rungs. A file is checked against ``model_path`` before anything is loaded:
    its ``model_identity`` (:func:`gnmr_hf.planning.profiler.model_identity`: a hash of the config and a
    fingerprint of the weights) when it records one, else the shapes it records (a file written before
    identities were recorded: another model with the same layer names and shapes is not detected then).

    The 4-bit linears compute with bitsandbytes' reference de-quantise + matmul
    (:func:`gnmr_hf.backends.bnb_4bit.keep_reference_layout`), as the dual path trains them: on a CPU with
    AVX512-BF16 bitsandbytes would otherwise repack them at the first eval-mode forward and compute other
    logits than the trained model.

    Raises:
        TypeError: ``rungs`` neither a mapping nor a path (a list of names: give ``{name: "bf16"}``).
        ValueError: a ``low`` not in :data:`LOW_PATHS`, an unknown rung, a name that is not a linear inside the
            decoder layers (``lm_head``: training puts only those on a rung), a plan file that is not one, or
            one made for another model (all before any load).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if low not in LOW_PATHS:
        raise ValueError(f"low={low!r} is not a low path load_planned loads: one of {', '.join(LOW_PATHS)}")
    keep: list[str] = []
    if isinstance(rungs, Mapping):
        rungs = dict(rungs)
    elif isinstance(rungs, (str, os.PathLike)):
        rungs, keep = _read_plan_file(model_path, rungs)
    else:
        shown = f"a {type(rungs).__name__}" + (f" of {len(rungs)} names" if isinstance(rungs, (list, tuple, set)) else "")
        raise TypeError(f"load_planned's rungs takes a mapping of linear names to rungs ({', '.join(RUNGS)}), e.g. "
                        "{'model.layers.3.self_attn.v_proj': 'bf16'}, or a plan file (profile.json) or the folder "
                        f"holding it; got {shown} (names to keep on BF16: {{name: 'bf16' for name in names}})")
    check_rungs(rungs)
    _check_decoder_linears(model_path, rungs)
    dtype = dtype or torch.bfloat16
    skip = ["lm_head"] + [k for k in keep if k != "lm_head"] + sorted(rungs)
    if low == "int8":
        q = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip, llm_int8_threshold=int8_threshold)
    else:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=low, bnb_4bit_use_double_quant=double_quant,
                               bnb_4bit_compute_dtype=compute_dtype or dtype, llm_int8_skip_modules=skip)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=q, device_map=device_map)
    if low != "int8":
        _reference_layout(model)  # as the dual path computes (see the docstring)
    modules = dict(model.named_modules())
    missing = [n for n in rungs if n not in modules or not isinstance(modules[n], torch.nn.Linear)]
    if missing:
        raise ValueError(f"{len(missing)} planned name(s) are not linears of {model_path}, e.g. {missing[0]}")
    # every rung with a module of its own (INT8, a registered one) is swapped in over the checkpoint weight;
    # BF16 stays the checkpoint's nn.Linear (in the skip list)
    swapped = {n: r for n, r in rungs.items() if get_rung(r).module is not None}
    weights = _CheckpointLinears(model_path, sorted(swapped))
    for name, rung in swapped.items():  # the module the ladder table swaps in for the rung (rung_swap.rung_module)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, rung_module(modules[name], rung, weights[name], dtype, int8_threshold))
    return model


def _meta_model(model_path: str | os.PathLike):
    """``model_path``'s architecture on the meta device (shapes only, nothing read but config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _check_decoder_linears(model_path: str | os.PathLike, rungs: dict[str, str]) -> None:
    """Every planned name must be a linear inside the decoder layers of ``model_path``'s architecture."""
    meta = _meta_model(model_path)
    modules = dict(meta.named_modules())
    missing = [n for n in rungs if not isinstance(modules.get(n), torch.nn.Linear)]
    if missing:
        raise ValueError(f"{len(missing)} planned name(s) are not linears of {model_path}, e.g. {missing[0]}")
    inside = {id(m) for _, layer in find_decoder_layers(meta) for m in layer.modules()}
    outside = sorted(n for n in rungs if id(modules[n]) not in inside)
    if outside:
        raise ValueError(f"{outside[0]} ({rungs[outside[0]]}) is not a linear inside the decoder layers: training puts "
                         "only those on a rung (prepare_dual_path(..., units='linears', rungs=...)), so a plan cannot "
                         f"name {'it' if len(outside) == 1 else f'it or {len(outside) - 1} more'}")


def _read_plan_file(model_path: str | os.PathLike, path: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """``(rungs, keep_modules)`` of a plan file (or ``DIR/profile.json``), read by
    :meth:`gnmr_hf.planning.plan.Plan.load` (every schema) and checked against ``model_path``."""
    plan = Plan.load(path).require_bnb_low("load_planned loads bitsandbytes low paths").require_planned()
    _check_same_model(plan.source, plan.data, model_path)
    return dict(plan.rungs), list(plan.keep_modules)


def _check_same_model(path: Path, data: dict[str, Any], model_path: str | os.PathLike,
                      fix: str = "pass the rungs as a dict to load another model on purpose") -> None:
    """The plan file's model is ``model_path``'s: by the ``model_identity`` it records, else by the shapes of the
    units it records (a ladder plan's ``numel`` / ``rows``, a profile's BF16 ``bytes`` per unit). ``fix``: what
    the one-line ``ValueError`` tells the user to do (the exports check with it too:
    :func:`gnmr_hf.export_folder.check_sources`)."""
    other = f"{path} was made for another model than {model_path}: {{}} ({fix})"
    recorded = recorded_identity(data)
    if recorded is not None:
        why = identity_mismatch(recorded, model_path)
        if why:
            raise ValueError(other.format(why))
    units = data.get("units")
    if not isinstance(units, list):
        return
    mods = dict(_meta_model(model_path).named_modules())

    def weight(name):
        m = mods.get(name)
        return getattr(m, "weight", None) if m is not None else None

    for u in units:
        if not isinstance(u, dict):
            continue
        if "numel" in u and "rows" in u:  # a ladder plan's unit: one linear
            w = weight(u.get("name"))
            if w is None:
                raise ValueError(other.format(f"it plans {u.get('name')!r}, which the model has no linear for"))
            if (w.numel(), w.shape[0]) != (u["numel"], u["rows"]):
                raise ValueError(other.format(f"{u['name']} has {u['numel']} weights in {u['rows']} rows in the plan, "
                                              f"{w.numel()} in {w.shape[0]} rows in the model"))
        elif isinstance(u.get("modules"), list) and "bytes" in u:  # a profile's unit: its linears' BF16 bytes
            ws = [weight(n) for n in u["modules"]]
            if any(w is None for w in ws):
                gone = next(n for n, w in zip(u["modules"], ws) if w is None)
                raise ValueError(other.format(f"it profiled {gone!r}, which the model has no linear for"))
            held = sum(get_rung("bf16").bytes(w.numel(), w.shape[0]).total for w in ws)
            if held != u["bytes"]:
                raise ValueError(other.format(f"unit {u.get('name')} is {u['bytes']} B (BF16) in the plan, {held} B in "
                                              "the model"))


#: the ladder table's budgets: memory over the all-low model (weights and quant states, as loaded)
MEMORY_POINTS = (0.05, 0.10, 0.25)
#: the rung sets each budget is planned with: BF16 only (today's plan), INT8 only, the ladder
RUNG_SETS = (("bf16",), ("int8",), ("int8", "bf16"))


def _stock_low(model_path, low: str, dtype, double_quant: bool = False, skip: list[str] | None = None,
               device_map=None):
    """The stock-loaded ``low`` model with ``skip`` on BF16 (:func:`load_planned` with BF16 rungs), in
    bitsandbytes' reference layout, in eval mode."""
    model = load_planned(model_path, {n: "bf16" for n in skip or []}, low, dtype=dtype, compute_dtype=dtype,
                         double_quant=double_quant, device_map=device_map)
    if low != "int8":
        _reference_layout(model)
    return model.eval()


def _all_bf16(model_path, dtype):
    """The all-BF16 reference (every decoder linear on BF16, ``lm_head`` as loaded), loaded without a
    quantiser: equal, tensor for tensor, to :func:`_stock_low` with every decoder linear skipped, which would
    have bitsandbytes replace no module and transformers log "no linear modules were found"."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def _reference_layout(model) -> None:
    """bitsandbytes' reference de-quantise + matmul (as the dual path and the recipes compute), so the
    table's losses equal the profile's on CPUs whose bitsandbytes would repack 4-bit weights."""
    from gnmr_hf.backends.bnb_4bit import keep_reference_layout

    keep_reference_layout(model)


def _loss(model, batches) -> float:
    """Token-weighted mean loss over ``batches`` (the labels' non-ignored shifted targets)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][..., 1:] != -100).sum())
            out = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"])
            total += float(out.loss) * n
            count += n
    return total / max(count, 1)


def ladder_table(model_path, batches, low: str = "nf4", dtype=None, points=MEMORY_POINTS,
                 rung_sets=RUNG_SETS, double_quant: bool = False, progress: bool = True) -> dict[str, Any]:
    """At each budget of memory over the all-``low`` model, the plan of each rung set (BF16 only, INT8
    only, the ladder), its first-order predicted gain and its measured loss on ``batches``, with the gap closed
    ``(L_low - L) / (L_low - L_high)``.

    The model is loaded once (the stock ``low`` load :func:`_stock_low` makes); each row's plan is put on it in
    place and taken off after (:func:`gnmr_hf.planning.rung_swap.swap_rungs`: each planned linear becomes the
    module :func:`load_planned` loads for its rung, from the same checkpoint weight), so its loss is what a load of
    the plan measures (tests/test_ladder.py compares the two); ``L_high`` is every low linear on BF16 the same
    way. A plan equal to an earlier row's is not measured again: its figures are that row's. ``progress``: a bar
    with a tick for ``L_low``, one for ``L_high`` and one per row (beside the load's and the gains' own)."""
    from transformers.utils import logging as hf_logging

    dtype = dtype or torch.float32
    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar at the load
    try:
        return _ladder_table(model_path, batches, low, dtype, points, rung_sets, double_quant, progress)
    finally:
        if bars and not progress:
            hf_logging.enable_progress_bar()


def _low_linears(model) -> list[str]:
    """Every 4-bit / 8-bit linear of a stock-loaded model (the decoder's and any other the quantiser took)."""
    import bitsandbytes as bnb  # an optional dependency: the [bnb] extra

    return [n for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def _ladder_table(model_path, batches, low, dtype, points, rung_sets, double_quant, progress) -> dict[str, Any]:
    stock = _stock_low(model_path, low, dtype, double_quant)
    units = rung_gains(stock, model_path, batches, low, double_quant, progress=progress)
    # the all-low model as a stock load stores it (non-quantised parameters in BF16), whatever dtype the
    # table computes in: the currency of memory_budget ("+10%nf4"); an FP32 load's own bytes would count its
    # embeddings twice over and inflate every budget
    low_bytes = over_low_prices(model_path, [u.name for u in units], low, double_quant)["low_model_bytes"]
    loaded = model_bytes(stock)["total"]  # what this load holds (FP32 compute: its BF16 parts in FP32)
    if dtype == torch.bfloat16 and abs(loaded - low_bytes) > 0.01 * low_bytes:
        raise RuntimeError(f"the stock {low} load holds {loaded} bytes, {low_bytes} predicted: the byte accounting "
                           "is off by more than 1 %")
    every = _low_linears(stock)
    weights = _CheckpointLinears(model_path, every)
    grid = [(f, rs) for f in points for rs in rung_sets]
    bar = tqdm(total=2 + len(grid), desc="ladder table", disable=not progress)  # L_low, L_high, then a tick a row
    l_low = _loss(stock, batches)
    bar.update()
    # every quantised linear on BF16: the unquantised model, tensor for tensor (a plain load, _all_bf16, equals it)
    with swap_rungs(stock, weights, {n: "bf16" for n in every}, dtype):
        l_high = _loss(stock, batches)
    bar.update()
    rows = []
    measured: dict[tuple, tuple] = {}  # a plan already measured (e.g. INT8 only = the ladder at 5 %)
    for f, rs in grid:
        budget = int(f * low_bytes)
        chosen = choose_rungs(units, budget, rs)
        gain, price = plan_gain(units, chosen)
        key = tuple(sorted(chosen.items()))
        if key not in measured:
            with swap_rungs(stock, weights, chosen, dtype, int8_threshold=6.0) as mixed:
                # what the mixed model holds over the all-low one; with FP32 compute its BF16 rungs are held in
                # FP32, so the served figure is the price (BF16 rungs, tests/test_ladder.py)
                held = model_bytes(mixed)["total"] - loaded if dtype == torch.bfloat16 else None
                measured[key] = (held, _loss(mixed, batches))
        held, loss = measured[key]
        rows.append({"memory_over_low": f, "budget_bytes": budget, "rungs": "+".join(rs),
                     "int8": sum(r == "int8" for r in chosen.values()),
                     "bf16": sum(r == "bf16" for r in chosen.values()), "price_bytes": price, "held_bytes": held,
                     "predicted_gain": gain, "loss": loss,
                     "gap_closed": (l_low - loss) / (l_low - l_high) if l_low != l_high else None,
                     "rung_of": chosen})
        bar.update()
    bar.close()
    return {"low": low, "low_model_bytes": low_bytes, "loss_low": l_low, "loss_high": l_high, "rows": rows}


def format_ladder_table(table: dict[str, Any], floor: float = 0.0) -> str:
    """The ladder's rows in markdown; ``floor``: the smallest ``|L_low - L_high|`` (nats) a gap-closed ratio is
    printed over (below it each row's gap closed reads ``noise``: the denominator is within the data's noise)."""
    low = table["low"].upper()
    noisy = abs(table["loss_low"] - table["loss_high"]) < floor
    lines = [f"| memory over {low} | rungs | INT8 linears | BF16 linears | served over {low} (MiB) | "
             "predicted gain | loss | gap closed |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in table["rows"]:
        gap = "-" if r["gap_closed"] is None else "noise" if noisy else f"{r['gap_closed']:.3f}"
        gain = f"{r['predicted_gain']:.4f}".replace("-0.0000", "0.0000")  # no -0.0000
        lines.append(f"| +{100 * r['memory_over_low']:g} % | {r['rungs']} | {r['int8']} | {r['bf16']} | "
                     f"{r['price_bytes'] / 2**20:.2f} | {gain} | {r['loss']:.4f} | {gap} |")
    return "\n".join(lines)
