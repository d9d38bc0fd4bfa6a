""":func:`make_plan`: the one way this project chooses a plan, in one currency per low format.

Every plan (BF16-only, the INT8 + BF16 ladder, the ladder over the compressed-tensors export's INT4) is chosen
the same way, in three steps a caller may also take one by one:

==================  ========================================================================================
:func:`plan_prices` each planned linear's price on each rung in the one currency: what it adds to the *served*
                    model over storing it in the low format (bitsandbytes' bytes for ``nf4``/``fp4``/``int8``
                    with their quant states, :func:`gnmr_hf.planning.budget.rung_price`; the
                    compressed-tensors folder's bytes for ``int4``, :func:`gnmr_hf.planning.int4.ct_rung_prices`;
                    the GGUF file's tensor bytes for ``q4_0`` ..., :func:`gnmr_hf.planning.gguf_plan.gguf_rung_prices`),
                    and the all-low model's bytes; read from the shapes, nothing measured
:func:`plan_budget` the budget in that currency (``+10%nf4``: 10 % of the all-low model's bytes; ``300MB``: that
                    many bytes; ``10%``: a tenth of what every planned linear on its dearest rung adds), refused
                    in one line (:class:`~gnmr_hf.planning.plan.PlanError`) before anything is measured when it
                    buys nothing or exceeds what there is to keep
:func:`plan_gains`  each linear's gain on each rung from the batches: the sensitivity profile's criterion for a
                    BF16-only plan (:func:`gnmr_hf.planning.profiler.profile_sensitivity`, a dual-path model);
                    by default the first-order rung gains for the ladder (:func:`gnmr_hf.planning.ladder.rung_gains`,
                    on a stock low model it loads and frees), over INT4
                    (:func:`gnmr_hf.planning.int4.ct_rung_gains`) or over a GGUF type
                    (:func:`gnmr_hf.planning.gguf_plan.gguf_rung_gains`), and any other registered criterion once per
                    rung, the rung's weight standing in for the high path
                    (:func:`gnmr_hf.planning.rung_criteria.criterion_rung_gains`)
==================  ========================================================================================

(called through their modules, so that a test can count the passes) and one greedy planner,
:func:`gnmr_hf.planning.ladder.choose_rungs`: gain per served byte over each linear's
convex hull of rungs (a BF16-only plan is the ladder with ``rungs=("bf16",)``), whole serving groups when
``groups="vllm"``. ``gnmr-hf profile``, the planned recipes and the benches call :func:`make_plan`; the paper
controller's :func:`gnmr_hf.planning.planner.plan` keeps its own API (extra BF16 bytes over a profile).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gnmr_hf.planning import gguf_plan, int4, ladder, profiler, rung_criteria
from gnmr_hf.planning.budget import budget_refusal, over_low_prices, rung_price, served_budget
from gnmr_hf.planning.criteria import DEFAULT_CRITERION, gain_score, unknown_criterion
from gnmr_hf.planning.gguf_plan import gguf_model_bytes, gguf_rung_prices
from gnmr_hf.planning.groups import ServingLayoutError, decoder_linears, serving_groups
from gnmr_hf.planning.int4 import ct_rung_prices, ct_shapes, ct_tensor_bytes
from gnmr_hf.planning.ladder import LadderUnit, _stock_low, choose_rungs
from gnmr_hf.planning.passes import _prepare_batches, _units
from gnmr_hf.planning.plan import GGUF_LOWS, LOWS, Plan, PlanError
from gnmr_hf.planning.planner import PrecisionPlan, measure_plan, serving_layout
from gnmr_hf.planning.profiler import model_identity
from gnmr_hf.planning.results import SensitivityProfile
from gnmr_hf.rungs.int4 import INT4_LOWS

#: the rungs a first-order rung gain is measured on (the ladder and INT4 plans)
LADDER_CRITERION = "first_order"


@dataclass
class PlanPrices:
    """What a plan costs, from the shapes alone (:func:`plan_prices`)."""

    linears: list[str]  # the planned linears, in model order (full names)
    shapes: dict[str, tuple[int, int]]  # linear -> (out_features, in_features)
    prices: dict[str, dict[str, int]]  # linear -> rung -> bytes it adds over the low format as served
    low: str
    low_model_bytes: int  # the all-low model as served (bitsandbytes' stock load, or the uniform W4A16 folder)
    rungs: tuple[str, ...]
    group_size: int | None = None
    unit_of: list[int] = field(default_factory=list)  # linear index -> the dual-path unit holding it (BF16-only)

    @property
    def dearest(self) -> int:
        """What every planned linear on its dearest rung adds: the total a share budget (``10%``) is a share of."""
        return sum(max(p.values()) for p in self.prices.values())


def plan_prices(model, rungs: Sequence[str] = ("bf16",), low: str = "nf4", model_path: str | os.PathLike | None = None,
                double_quant: bool = False, group_size: int | None = None) -> PlanPrices:
    """Each planned linear's price on each of ``rungs`` and the all-low model's bytes (see the module docstring).

    ``model``: a dual-path model (``prepare_dual_path(..., units="linears")``) for a bitsandbytes low format, its
    planned linears the dual-path linears; the BF16 model (no quantiser) for an INT4 ``low``, its planned linears
    the decoder linears. ``model_path`` (bitsandbytes formats): the checkpoint whose all-low model is priced
    from its config (:func:`gnmr_hf.planning.budget.over_low_prices`)."""
    rungs = tuple(rungs)
    if low not in LOWS:
        raise PlanError(f"low {low!r}: one of {', '.join(LOWS)}")
    if low in GGUF_LOWS:
        linears = decoder_linears(model)
        mods = dict(model.named_modules())
        shapes = {n: (mods[n].out_features, mods[n].in_features) for n in linears}
        prices = {n: {r: p for r, p in gguf_rung_prices(*shapes[n], low).items() if r in rungs} for n in linears}
        return PlanPrices(linears, shapes, prices, low, gguf_model_bytes(model, linears, {}, low), rungs)
    if low in INT4_LOWS:
        gs = 128 if group_size is None else int(group_size)
        linears = decoder_linears(model)
        mods = dict(model.named_modules())
        shapes = {n: (mods[n].out_features, mods[n].in_features) for n in linears}
        prices = {n: {r: p for r, p in ct_rung_prices(*shapes[n], gs, low).items() if r in rungs} for n in linears}
        ct, other = ct_shapes(model, linears)
        return PlanPrices(linears, shapes, prices, low, ct_tensor_bytes(ct, {}, other, gs, low), rungs, gs)
    if model_path is None:
        raise PlanError(f"plan_prices(low={low!r}) prices the all-{low} model from its checkpoint: give model_path")
    units = _units(model, "linears")
    linears, shapes, unit_of = [], {}, []
    for i, u in enumerate(units):
        for name, m in zip(u.modules, u.dual):
            linears.append(name)
            shapes[name] = (m.out_features, m.in_features)
            unit_of.append(i)
    prices = {n: {r: rung_price(o * i, o, r, low, double_quant) for r in rungs} for n, (o, i) in shapes.items()}
    low_bytes = over_low_prices(model_path, linears, low, double_quant)["low_model_bytes"]
    return PlanPrices(linears, shapes, prices, low, low_bytes, rungs, None, unit_of)


def plan_budget(budget: str | int, prices: PlanPrices, share: float = 1.0, shown: str | None = None,
                layout=None) -> int:
    """``budget`` in the one currency (bytes over the all-low model as served), times ``share`` (a hybrid run's
    static part); one :class:`PlanError` line when it buys no purchase (a linear, or with ``layout`` a whole
    serving group) or exceeds what there is to keep."""
    text = shown or str(budget)
    if isinstance(budget, int) and not isinstance(budget, bool):
        total = budget
    else:
        try:
            total = served_budget(str(budget), prices.low_model_bytes, prices.dearest, prices.low)
        except ValueError as e:
            raise PlanError(str(e)) from None
    spent = int(total * share)
    buys = [(g.name, list(g.members)) for g in layout] if layout is not None else [(n, [n]) for n in prices.linears]
    rungs = prices.rungs
    cheapest = [min((sum(prices.prices[m][r] for m in members), r) for r in rungs) for _, members in buys]
    dearest = [max(sum(prices.prices[m][r] for m in members) for r in rungs) for _, members in buys]
    why = budget_refusal(text, spent, cheapest, dearest, [n for n, _ in buys], prices.low)
    if why:
        raise PlanError(why)
    return spent


@dataclass
class PlanGains:
    """What a plan is chosen from: each planned linear's gain and price on each rung (:func:`plan_gains`)."""

    units: list[LadderUnit]  # one per planned linear, gains in loss units, prices in the one currency
    criterion: str
    batches: int
    tokens: int
    profile: SensitivityProfile | None = None  # the BF16-only plan's sensitivity profile


def _tokens(batches) -> int:
    return sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)


def plan_gains(model, batches, prices: PlanPrices, criterion: str | None = None, *,
               model_path: str | os.PathLike | None = None, double_quant: bool = False, progress: bool = False,
               profile: SensitivityProfile | None = None, dtype=None) -> PlanGains:
    """Each of ``prices``' linears' gain on each rung from ``batches`` (the one sensitivity pass; see the module
    docstring). ``profile``: a BF16-only plan's profile already taken on these batches (nothing measured again);
    ``dtype``: the ladder's stock low model's compute dtype (default: the model's first floating parameter's).
    ``criterion`` other than None and ``"first_order"`` on the ladder's or INT4's rungs: that registered criterion
    on each rung (:func:`gnmr_hf.planning.rung_criteria.criterion_rung_gains`)."""
    batches = list(batches)
    why = unknown_criterion(criterion) if criterion is not None else None
    if why:
        raise PlanError(why)
    if prices.rungs == ("bf16",) and prices.low not in INT4_LOWS and prices.low not in GGUF_LOWS:
        criterion = criterion or DEFAULT_CRITERION
        if profile is None:
            owner = gain_score(criterion)[0]  # a score (output_rel) is its criterion's (output) to run
            profile = profiler.profile_sensitivity(model, batches, criteria=(owner,), progress=progress)
        name = profile._score_name(criterion)
        units = []
        for u in profile.units:
            if len(u.modules) != 1:
                raise PlanError(f"make_plan plans linears: unit {u.name} holds {len(u.modules)} (prepare the dual path "
                                "with units='linears')")
            n = u.modules[0]
            o, i = prices.shapes[n]
            units.append(LadderUnit(n, o * i, o, gains={"bf16": float(u.scores[name])}, prices=dict(prices.prices[n])))
        if [u.name for u in units] != prices.linears:
            raise PlanError(f"the profile's {len(units)} units are not the model's {len(prices.linears)} linears")
        return PlanGains(units, name, len(batches), profile.tokens, profile)
    if criterion not in (None, LADDER_CRITERION):  # a registered criterion, once per rung
        units, tokens = rung_criteria.criterion_rung_gains(model, batches, prices, criterion, progress=progress)
        return PlanGains(units, criterion, len(batches), tokens)
    if prices.low in INT4_LOWS:
        units = int4.ct_rung_gains(model, batches, prices.group_size, prices.linears, prices.low)
    elif prices.low in GGUF_LOWS:
        units = gguf_plan.gguf_rung_gains(model, batches, prices.low, prices.linears)
    else:
        units = _stock_rung_gains(model, batches, prices, model_path, double_quant, dtype)
    for u in units:
        u.gains = {r: g for r, g in u.gains.items() if r in prices.rungs}
        u.prices = dict(prices.prices[u.name])
    return PlanGains(units, LADDER_CRITERION, len(batches), _tokens(batches))


def _stock_rung_gains(model, batches, prices: PlanPrices, model_path, double_quant: bool, dtype=None) -> list[LadderUnit]:
    """The ladder's first-order rung gains on a stock-loaded low model (a second load, freed before returning)."""
    if model_path is None:
        raise PlanError("the ladder's rung gains are measured on a stock-loaded low model: give model_path")
    param = next(model.parameters())
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), param.dtype)
    device = param.device
    stock = _stock_low(model_path, prices.low, dtype, double_quant=double_quant,
                       device_map={"": device.index or 0} if device.type == "cuda" else None)
    try:
        units = ladder.rung_gains(stock, model_path, batches, prices.low, double_quant=double_quant)
    finally:
        del stock
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if sorted(u.name for u in units) != sorted(prices.linears):
        raise PlanError(f"the ladder profiled {len(units)} linears, the model's dual path holds {len(prices.linears)}")
    order = {n: k for k, n in enumerate(prices.linears)}
    return sorted(units, key=lambda u: order[u.name])


def layout_of(model, groups: str | None, prices: PlanPrices):
    """The serving groups ``groups`` (``"vllm"``) names over the planned linears (None for a free plan); an unknown
    layout is one :class:`PlanError` line."""
    if groups is None:
        return None
    try:
        if prices.low in INT4_LOWS or prices.low in GGUF_LOWS:  # the BF16 model: its own modules
            return serving_groups(model, prices.linears)
        return serving_layout(groups, model=model, linears=prices.linears)
    except (ServingLayoutError, ValueError) as e:
        raise PlanError(f"groups {groups}: {e}") from None


def make_plan(model, batches, budget: str | int, rungs: Sequence[str] = ("bf16",), groups: str | None = None,
              criterion: str | None = None, *, low: str = "nf4", model_path: str | os.PathLike | None = None,
              double_quant: bool = False, group_size: int | None = None, share: float = 1.0,
              prices: PlanPrices | None = None, gains: PlanGains | None = None, progress: bool = False,
              budget_text: str | None = None, dtype=None, layout=None, serve: str | None = None) -> Plan:
    """Choose a plan: which of the model's planned linears go on which of ``rungs``, within ``budget``.

    Args:
        model: a dual-path model (``prepare_dual_path(..., units="linears")``) over a bitsandbytes ``low``; the
            BF16 model (no quantiser) for ``low="int4"``.
        batches: the profile batches (dicts with ``input_ids``, ``labels``, optionally ``attention_mask``).
        budget: memory over the all-low model as served (``"+10%nf4"``), a size (``"300MB"``, or bytes as an
            int), or a share of what every planned linear on its dearest rung adds (``"10%"``).
        rungs: ``("bf16",)`` (a BF16-only plan), ``("int8",)`` or ``("int8", "bf16")`` (the ladder).
        groups: None (free, linear by linear) or ``"vllm"`` (whole serving groups as vLLM fuses them).
        criterion: a registered criterion (:data:`~gnmr_hf.planning.criteria.REGISTRY`) or one of its scores: the
            BF16-only plan's score (default :data:`~gnmr_hf.planning.criteria.DEFAULT_CRITERION`); the ladder's and
            INT4's default (None or ``"first_order"``) is the rungs' first-order gains, any other criterion runs
            once per rung (docs/criteria.md: what each costs).
        low, model_path, double_quant, group_size: the low format, the checkpoint (bitsandbytes formats: the
            all-low model's bytes, the ladder's stock model) and the INT4 group (``low="int4"``, default 128).
        share: the part of the budget the plan may spend (a hybrid run leaves the rest to its controller).
        prices, gains: :func:`plan_prices` and :func:`plan_gains` already computed for these inputs.
        progress: progress bars for the sensitivity pass.
        dtype: the ladder's stock low model's compute dtype (default: the model's).
        layout: ``groups``' serving groups when already read (:func:`layout_of`; a bench that no longer holds the
            model).
        budget_text: how the budget is shown in refusals and recorded (default ``str(budget)``).
        serve: the serving target the plan is for (:data:`gnmr_hf.serving.TARGETS`), recorded on it; the plan is
            checked against it (its rungs and groups; :class:`~gnmr_hf.planning.plan.Plan`).

    Returns:
        A :class:`~gnmr_hf.planning.plan.Plan`: ``rungs`` the chosen linears, ``budget_bytes`` and ``price_bytes``
        in bytes over the all-low model as served, ``chosen_by`` the criterion, the batches and tokens, the
        plan's predicted gain and the all-low model's bytes.

    Raises:
        PlanError: a budget that buys nothing or exceeds what there is to keep (before anything is measured), a
            serving layout that is not known, an unknown criterion (naming the registered ones, before anything is
            priced): one line.
    """
    rungs = tuple(r for r in ("int8", "bf16") if r in rungs)
    if not rungs:
        raise PlanError("make_plan: rungs must name int8 and/or bf16")
    why = unknown_criterion(criterion) if criterion is not None and gains is None else None
    if why:  # before anything is priced or measured
        raise PlanError(why)
    prices = prices or plan_prices(model, rungs, low, model_path, double_quant, group_size)
    layout = layout if groups is not None and layout is not None else layout_of(model, groups, prices)
    spend = plan_budget(budget, prices, share, shown=budget_text, layout=layout)
    gains = gains or plan_gains(model, batches, prices, criterion, model_path=model_path, double_quant=double_quant,
                                progress=progress, dtype=dtype)
    chosen = choose_rungs(gains.units, spend, rungs, groups=layout)
    by = {u.name: u for u in gains.units}
    price = sum(by[n].prices[r] for n, r in chosen.items())
    gain = sum(by[n].gains[r] for n, r in chosen.items())
    if price > spend:  # the planner's promise, checked
        raise PlanError(f"the plan adds {price} B over the {low} model, more than its budget {spend} B")
    chosen = {n: chosen[n] for n in prices.linears if n in chosen}  # model order
    chosen_by = {"criterion": gains.criterion, "batches": gains.batches, "tokens": gains.tokens,
                 "predicted_gain": gain, "low_model_bytes": prices.low_model_bytes, "share": share,
                 "currency": f"bytes over the all-{prices.low} model as served", "writer": "make_plan"}
    return Plan(rungs=chosen, low=prices.low, group_size=prices.group_size, groups=groups, rung_set=rungs,
                budget=budget_text or str(budget), budget_bytes=spend, price_bytes=price,
                model_identity=model_identity(model_path) if model_path is not None else None,
                chosen_by=chosen_by, keep_modules=list(gains.profile.keep_modules) if gains.profile is not None else [],
                serve=serve)


def precision_plan(plan: Plan, profile: SensitivityProfile, model=None, batches=None) -> PrecisionPlan:
    """A BF16-only :class:`~gnmr_hf.planning.plan.Plan` over ``profile``'s units as the controller's
    :class:`~gnmr_hf.planning.planner.PrecisionPlan` (unit indices, BF16 bytes, predicted and, with ``model``
    and ``batches``, measured gap closed on the profile batches: one forward): what the price tables, the plot and
    ``profile.json``'s ``plan`` record read. ``budget_bytes`` is the plan's budget as served over the low model,
    ``bytes`` and ``total_bytes`` BF16 bytes (the held bytes follow from them)."""
    chosen = [i for i, u in enumerate(profile.units) if any(m in plan.rungs for m in u.modules)]
    criterion = plan.chosen_by.get("criterion")
    gain_score = criterion if criterion in ("loss", "first_order") else None
    predicted = None if gain_score is None else sum(profile.units[i].scores[gain_score] for i in chosen)
    gap = profile.gap
    view = PrecisionPlan(
        criterion=criterion, budget_bytes=plan.budget_bytes, total_bytes=profile.total_bytes, indices=chosen,
        names=[profile.units[i].name for i in chosen], modules=[m for i in chosen for m in profile.units[i].modules],
        bytes=sum(profile.units[i].bytes for i in chosen), predicted_gain=predicted,
        predicted_gap_closed=None if predicted is None or gap == 0 else predicted / gap, gain_score=gain_score,
        keep_modules=list(profile.keep_modules), groups=plan.groups)
    if model is not None:
        units = _units(model, "linears")
        view.held_bytes = sum(sum(m._gnmr_source.weight_bytes(m) for m in units[i].dual) for i in chosen)
        if batches is not None:
            prepared, _ = _prepare_batches(model, batches)
            view.measured["profile"] = measure_plan(model, chosen, prepared,
                                                    reference=(profile.losses["low"], profile.losses["high"]))
    return view
