"""The planner: a budget in bytes, the greedy fill by score per byte, the plan and its measurement."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnmr_hf.backends.base import active_units
from gnmr_hf.planning.criteria import GAIN_SCORES
from gnmr_hf.planning.groups import (
    ServingGroup,
    architecture_of,
    purchase_totals,
    purchases,
    serving_groups,
    split_groups,
)
from gnmr_hf.planning.passes import _batch_digest, _loss, _prepare_batches, _set_path, _Unit, _units
from gnmr_hf.planning.plan import PLAN_FILE, PlanError
from gnmr_hf.planning.plan import plan_file as _plan_file
from gnmr_hf.planning.results import SensitivityProfile, _fmt, _is_int, _json_safe, _pct
from gnmr_hf.planning.skiplist import skip_modules
from gnmr_hf.strict_json import DuplicateKeyError, read_json
from gnmr_hf.units import UnitSpec

# ------------------------------------------------------------------------------------------ planning


#: the currencies a plan prices its units in: ``"bf16"`` (2 bytes a weight, what keeping a linear unquantised
#: costs when served) or ``"held"`` (what the model's recovery path stores: 4 bytes a weight under FP32 storage)
PRICES = ("bf16", "held")

#: what a plan may be asked to buy as one purchase besides single units: ``"vllm"``, whole serving groups
#: (:mod:`gnmr_hf.planning.groups`: q/k/v of a layer together, gate/up together, o_proj and down_proj alone, as
#: vLLM fuses them, read from the architecture); ``groups=None`` (the default) plans free, unit by unit
GROUPINGS = ("vllm",)


@dataclass
class PrecisionPlan:
    """The units to keep on BF16 under a byte budget, chosen greedily by score per byte.

    Attributes:
        criterion: the score the plan was chosen by.
        priced_in: the currency of ``budget_bytes``, ``total_bytes`` and ``bytes``: ``"bf16"`` (the default:
            BF16 bytes, 2 a weight, whatever dtype the model's recovery path stores) or ``"held"`` (the bytes
            the model's recovery path holds, :func:`plan`'s ``priced_in``).
        budget_bytes: the extra bytes allowed; ``total_bytes`` the quantised weights' bytes (both in ``priced_in``).
        indices, names, modules: the chosen units (unit indices for ``set_active_units`` / a static policy,
            readable names, and the qualified names of their linears).
        bytes: the chosen units' bytes in ``priced_in``.
        held_bytes: what the chosen units hold on the recovery path of the model the plan was made for (with
            ``set_active_units(model, plan.indices)``): ``bytes`` for BF16 storage, twice the BF16 bytes for FP32;
            None when neither the model nor the profile says (a profile written before it was recorded).
        predicted_gain: the sum of the chosen units' single gains (``loss`` or ``first_order`` scores; the
            criterion's own when it is a gain, else the profile's ``loss``, else ``first_order``); None
            without a gain score. ``predicted_gap_closed`` = predicted_gain / (L_low - L_high).
        measured: per data set (``profile``, ``heldout``): ``loss_low``, ``loss_high``, ``loss_plan`` and
            ``gap_closed`` = (L_low - L_plan) / (L_low - L_high), measured with the set on BF16.
        keep_modules: the profile's default-kept modules (see :func:`skip_modules`).
        groups: ``None`` (a free plan: any set of units) or ``"vllm"`` (whole serving groups bought together,
            :func:`plan`'s ``groups``); recorded in :meth:`to_dict` so a plan file says how it was made.
    """

    criterion: str
    budget_bytes: int
    total_bytes: int
    indices: list[int]
    names: list[str]
    modules: list[str]
    bytes: int
    predicted_gain: float | None
    predicted_gap_closed: float | None
    gain_score: str | None = None
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    keep_modules: list[str] = field(default_factory=list)
    priced_in: str = "bf16"
    held_bytes: int | None = None
    groups: str | None = None

    @property
    def fraction(self) -> float:
        """The chosen bytes as a share of the quantised weights' bytes (the same share in either currency)."""
        return self.bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def budget_fraction(self) -> float:
        return self.budget_bytes / self.total_bytes if self.total_bytes else 0.0

    def skip_modules(self, keep: Sequence[str] | None = None) -> list[str]:
        """See :func:`skip_modules`."""
        return skip_modules(self, keep)

    def summary(self) -> str:
        """A few lines: budget, chosen set, predicted and measured gap closed."""
        cur = "BF16" if self.priced_in == "bf16" else "held"
        lines = [f"plan by {self.criterion}: {len(self.indices)} unit(s), {self.bytes / 2**20:.1f} MiB {cur} = "
                 f"{100 * self.fraction:.1f} % of the quantised weights' {cur} bytes (budget "
                 f"{self.budget_bytes / 2**20:.1f} MiB, {100 * self.budget_fraction:.1f} %)"]
        if self.groups is not None:
            lines.append(f"  grouped ({self.groups}): whole serving groups only (q/k/v of a layer together, gate/up "
                         "together; gnmr_hf.planning.groups)")
        if self.held_bytes is not None and self.held_bytes != self.bytes:
            lines.append(f"  held on the model's recovery path: {self.held_bytes / 2**20:.1f} MiB "
                         f"({self.held_bytes / self.bytes:g} bytes per {cur} byte)")
        if self.predicted_gap_closed is not None:
            lines.append(f"  predicted gap closed (sum of single {self.gain_score} gains): "
                         f"{_fmt(self.predicted_gap_closed, '.3f')}")
        for where, m in self.measured.items():
            lines.append(f"  measured gap closed on {where}: {_fmt(m['gap_closed'], '.3f')} (L_low {m['loss_low']:.4f}, "
                         f"L_plan {m['loss_plan']:.4f}, L_high {m['loss_high']:.4f})")
        if self.names:
            lines.append("  units: " + ", ".join(self.names))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe({
            "criterion": self.criterion, "budget_bytes": self.budget_bytes, "budget_fraction": self.budget_fraction,
            "total_bytes": self.total_bytes, "bytes": self.bytes, "fraction": self.fraction,
            "indices": list(self.indices), "names": list(self.names), "modules": list(self.modules),
            "predicted_gain": self.predicted_gain, "predicted_gap_closed": self.predicted_gap_closed,
            "gain_score": self.gain_score, "measured": self.measured, "skip_modules": self.skip_modules(),
            "priced_in": self.priced_in, "held_bytes": self.held_bytes, "groups": self.groups,
        })


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB" if n >= 2**10 else f"{int(n)} B"


def budget_error(sizes: Sequence[int], budget: int, names: Sequence[str] | None = None) -> str | None:
    """Why a budget of ``budget`` extra BF16 bytes cannot be planned over units of ``sizes`` bytes (None if it can):
    it buys no unit (below the smallest one), or it exceeds the quantised weights' BF16 bytes (the sum)."""
    total = sum(sizes)
    positive = [(b, i) for i, b in enumerate(sizes) if b > 0]
    if not positive:
        return "the units hold no bytes to plan"
    smallest, where = min(positive)
    unit = f" ({names[where]})" if names else ""
    bounds = (f"the smallest unit{unit} is {smallest} B ({_mib(smallest)}), all {len(sizes)} units total {total} B "
              f"({_mib(total)})")
    if budget < smallest:
        return f"budget {budget} B ({_mib(budget)}) buys no unit: {bounds}"
    if budget > total:
        return f"budget {budget} B ({_mib(budget)}) exceeds what there is to keep on BF16: {bounds}"
    return None


def _budget(sizes: Sequence[int], names: Sequence[str], budget_bytes: int | None,
            budget_fraction: float | None) -> int:
    if (budget_bytes is None) == (budget_fraction is None):
        raise ValueError("give exactly one of budget_bytes and budget_fraction")
    if budget_fraction is not None:
        if not (isinstance(budget_fraction, (int, float)) and not isinstance(budget_fraction, bool)
                and 0 < budget_fraction <= 1):
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        budget = int(budget_fraction * sum(sizes))
    else:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        budget = budget_bytes
    why = budget_error(sizes, budget, names)
    if why:
        given = f"budget_fraction {budget_fraction!r}: " if budget_fraction is not None else ""
        raise ValueError(given + why)
    return budget


def held_unit_bytes(info: Sequence[_Unit]) -> list[int]:
    """Each unit's bytes as its recovery path holds them while active: its linears' checkpoint weights in the
    dtype the dual path keeps them (4 bytes a weight under FP32 storage), an INT8 rung's int8 weights and
    row scales; 0 for a unit whose layers hold no recovery weight (MX, activation quantisation)."""
    return [sum(m._gnmr_source.weight_bytes(m) for m in u.dual if getattr(m, "_gnmr_source", None) is not None)
            for u in info]


def _recorded_held(profile: SensitivityProfile) -> list[int] | None:
    held = (profile.meta or {}).get("held_unit_bytes")
    if isinstance(held, list) and len(held) == len(profile.units) and all(_is_int(b) and b >= 0 for b in held):
        return list(held)
    return None


def _check_same_units(profile: SensitivityProfile, info: list[_Unit]) -> None:
    """The model's units must be the profile's (same count, names and bytes, in order)."""
    if len(info) != len(profile.units):
        raise ValueError(f"the model is not the profiled one: the profile has {len(profile.units)} units, the model "
                         f"{len(info)} ({type(info[0].module).__name__ if info else '-'} ...)")
    for i, (u, m) in enumerate(zip(profile.units, info)):
        if (u.name, u.bytes) != (m.name, m.bytes):
            raise ValueError(f"the model is not the profiled one: unit {i} is {u.name} ({u.bytes} B) in the profile, "
                             f"{m.name} ({m.bytes} B) in the model")


def _check_same_batches(profile: SensitivityProfile, prepared: list[dict[str, Any]], counts: list[int]) -> None:
    """``batches`` must be the profile's own (its L_low and L_high are reused): compared by fingerprint when
    the profile has them, else by target-token counts (profiles written before fingerprints were recorded)."""
    hint = ("; plan(batches=) takes the profile's own batches (its L_low and L_high are reused), other data goes "
            "in heldout= (a shuffling DataLoader gives other batches on each pass: pass a list)")
    meta = profile.meta or {}
    if len(prepared) != profile.batches:
        raise ValueError(f"batches are not the profile's: {len(prepared)} batch(es), the profile saw {profile.batches}"
                         + hint)
    digests, tokens = meta.get("batch_digests"), meta.get("batch_tokens")
    if digests is not None:
        for i, (b, d) in enumerate(zip(prepared, digests)):
            if _batch_digest(b) != d:
                raise ValueError(f"batches are not the profile's: batch {i} differs from the profiled one (token ids, "
                                 "labels or mask)" + hint)
    elif tokens is not None:
        if list(counts) != list(tokens):
            raise ValueError(f"batches are not the profile's: target tokens per batch {counts}, the profile saw "
                             f"{list(tokens)}" + hint)
    elif sum(counts) != profile.tokens:
        raise ValueError(f"batches are not the profile's: {sum(counts)} target tokens, the profile saw "
                         f"{profile.tokens}" + hint)


def greedy_select(scores: Sequence[float], sizes: Sequence[int], budget: int) -> list[int]:
    """Indices chosen greedily by score per byte (highest first, ties to the lower index), skipping
    units that no longer fit; units with a non-positive (or non-finite) score are never chosen."""
    order = sorted((i for i, s in enumerate(scores) if math.isfinite(s) and s > 0 and sizes[i] > 0),
                   key=lambda i: (-scores[i] / sizes[i], i))
    return fill_in_order(order, sizes, budget)


def fill_in_order(order: Iterable[int], sizes: Sequence[int], budget: int) -> list[int]:
    """Walk ``order`` and keep each index whose size still fits in ``budget`` (sorted result)."""
    chosen, used = [], 0
    for i in order:
        if used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen)


def check_groups(groups: Any) -> str | None:
    """``groups`` as :func:`plan` takes it: None (free) or one of :data:`GROUPINGS`; else a one-line ValueError."""
    if groups is None or groups in GROUPINGS:
        return groups
    raise ValueError(f"groups={groups!r}: None (a free plan, unit by unit) or 'vllm' (whole serving groups: q/k/v "
                     "of a layer together, gate/up together, as vLLM fuses them)")


def serving_layout(groups: str, model: nn.Module | None = None, profile: SensitivityProfile | None = None,
                   linears: Sequence[str] | None = None) -> list[ServingGroup]:
    """The serving groups ``groups`` (``"vllm"``) names for a model, read from its architecture
    (:func:`gnmr_hf.planning.groups.serving_groups`): ``model``'s class, else the architecture ``profile``
    recorded (``meta["model"]``, written by :func:`profile_sensitivity`), over ``linears`` (default: the
    profile's units' linears, else the model's decoder linears).

    Raises:
        ValueError: an unknown ``groups``, no architecture to read (neither a model nor a profile that
            recorded one), or (:class:`~gnmr_hf.planning.groups.ServingLayoutError`) an architecture whose
            serving layout is not known or linears that do not fit it: one line.
    """
    check_groups(groups)
    if linears is None and profile is not None:
        linears = [m for u in profile.units for m in u.modules]
    if model is not None:
        return serving_groups(architecture_of(model), linears) if linears is not None else serving_groups(model)
    arch = (profile.meta or {}).get("model") if profile is not None else None
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"groups={groups!r} reads the serving layout from the model's architecture: give the model "
                         "(model=...), or a profile taken by profile_sensitivity (it records the architecture)")
    return serving_groups(arch, linears)


def unit_purchases(profile: SensitivityProfile | Sequence[Sequence[str]],
                   layout: Sequence[ServingGroup]) -> tuple[list[list[int]], list[str]]:
    """The purchases of a grouped plan: unit indices bought together (units sharing a serving group, see
    :func:`gnmr_hf.planning.groups.purchases`) and a name for each (its serving groups' vLLM names, joined
    by ``+``)."""
    modules = [u.modules for u in profile.units] if isinstance(profile, SensitivityProfile) else \
        [list(m) for m in profile]
    buys = purchases(modules, layout)
    group_of = {m: g.name for g in layout for m in g.members}
    names = []
    for b in buys:
        seen = list(dict.fromkeys(group_of.get(m, m) for i in b for m in modules[i]))
        names.append(f"serving group {seen[0]}" if len(seen) == 1 else "serving groups " + "+".join(seen))
    return buys, names


def plan_groups(data: Any) -> str | None:
    """How a plan file (a ``profile.json`` as a dict: ``gnmr-hf profile``'s, a planned recipe's, a ladder
    recipe's) was planned: its recorded ``groups`` (``"vllm"``), or None for a free plan (also a file written
    before plans recorded it)."""
    if not isinstance(data, dict):
        return None
    for where in (data.get("plan"), data):
        if isinstance(where, dict) and where.get("groups") is not None:
            return str(where["groups"])
    return None


def require_groups(plan_file: str | os.PathLike | dict[str, Any], groups: str) -> None:
    """Refuse (one-line ValueError) a plan file not planned with ``groups``: a grouped request (a server that
    needs whole serving groups) on a plan made free. ``plan_file``: a ``profile.json``, the folder holding it,
    or its parsed dict."""
    check_groups(groups)
    if isinstance(plan_file, dict):
        data, shown = plan_file, "the plan"
    else:
        path = Path(plan_file)
        shown = str(path / PLAN_FILE if path.is_dir() else path)
        try:
            data = read_json(_plan_file(path))  # a folder means DIR/profile.json, as every plan reader says
        except DuplicateKeyError:
            raise
        except (OSError, ValueError, PlanError) as e:
            raise ValueError(f"{shown}: not a readable plan file ({type(e).__name__})") from None
    made = plan_groups(data)
    if made != groups:
        how = "free (no groups recorded)" if made is None else f"with groups={made!r}"
        raise ValueError(f"{shown} was planned {how}, not with groups={groups!r}: plan again with groups={groups!r} "
                         f"(gnmr-hf profile --groups {groups}, or profile.groups: {groups} in a recipe)")


def plan(
    profile: SensitivityProfile,
    budget_bytes: int | None = None,
    *,
    budget_fraction: float | None = None,
    criterion: str | None = None,
    model: nn.Module | None = None,
    batches: Iterable[dict[str, Any]] | None = None,
    heldout: Iterable[dict[str, Any]] | None = None,
    heldout_reference: tuple[float, float] | None = None,
    units: UnitSpec = None,
    priced_in: str = "bf16",
    groups: str | None = None,
) -> PrecisionPlan:
    """Choose the units to keep on BF16 within a byte budget, and (with ``model``) measure the choice.

    Greedy by score per byte; units with a non-positive score are never chosen, so a plan may use
    less than its budget.

    **The currency.** By default (``priced_in="bf16"``) a unit costs its BF16 bytes (2 a weight): what keeping
    it unquantised adds to a served model, whatever dtype the training model's recovery path stores. A dual
    path prepared with ``dtype=torch.float32`` (the CPU default) holds 4 bytes a weight, so
    ``set_active_units(model, plan.indices)`` then holds twice ``plan.bytes``; the plan records what it
    holds as ``held_bytes`` when it knows the model (``model=``, or a profile that recorded it).
    ``priced_in="held"`` prices every unit, the budget and ``budget_fraction``'s total in the bytes the
    model's recovery path holds instead, so the plan holds at most ``budget_bytes`` (with
    ``budget_fraction`` the chosen set is the same in either currency; with ``budget_bytes`` under FP32
    storage it is about half as many bytes of weights). Single gains do not add, so the set's gain is measured: with ``model`` and
    ``batches`` (the profile's batches: the profile's L_low and L_high are reused, one forward), and
    optionally ``heldout`` batches (three forwards: low, high, the plan).

    Args:
        profile: from :func:`profile_sensitivity`.
        budget_bytes: extra BF16 bytes allowed; or ``budget_fraction``: a share of the quantised weights'
            BF16 bytes (``profile.total_bytes``). Exactly one of them.
        criterion: the score to plan by (default: :data:`DEFAULT_CRITERION` if in the profile, else the
            first present).
        model, batches, heldout, units: for the measurement (the model the profile was taken on; ``batches``
            must be the profile's own, whose L_low and L_high the profile holds). Both are checked: the model's
            units (count, names, bytes) against the profile's, the batches against the fingerprints (or, for an
            older profile, the target-token counts) the profile recorded; a mismatch is a ValueError.
        heldout_reference: ``(L_low, L_high)`` on ``heldout`` when already measured (saves two forwards).
        priced_in: ``"bf16"`` or ``"held"`` (see above; ``"held"`` needs ``model`` or a profile taken by
            :func:`profile_sensitivity`, which records each unit's held bytes).
        groups: ``None`` (the default: free, unit by unit) or ``"vllm"``: buy whole serving groups, the
            linears vLLM fuses into one module (q/k/v of a layer, gate/up; o_proj and down_proj alone), so the
            plan never splits one (:func:`serving_layout`: the layout read from ``model``'s architecture, else
            the one the profile recorded). Units sharing a group are one purchase, its price and score the
            sums of its members' (:func:`gnmr_hf.planning.groups.purchases`), filled greedily by score per
            byte under the same budget; ``budget_fraction`` is of the same total. What the constraint costs:
            :func:`format_grouping_table` (``gnmr-hf profile`` prints it).

    Returns:
        A :class:`PrecisionPlan`; :func:`skip_modules` turns it into ``llm_int8_skip_modules``.

    Raises:
        ValueError: a budget that buys no unit (below the smallest unit's bytes) or exceeds the total (the
            message gives both), ``budget_fraction`` outside (0, 1], another model or other batches.
        ServingLayoutError: ``groups="vllm"`` for an architecture whose serving layout is not known, or units
            that do not fit it (one line naming the linears found; a ValueError).
    """
    name = profile._score_name(criterion)
    sizes, held = _unit_prices(profile, priced_in, model, units)
    budget, chosen = _choose(profile, name, sizes, budget_bytes, budget_fraction, groups, model)
    gain_score = name if name in GAIN_SCORES else next((s for s in GAIN_SCORES if s in profile.score_names), None)
    predicted = None if gain_score is None else sum(profile.units[i].scores[gain_score] for i in chosen)
    gap = profile.gap
    result = PrecisionPlan(
        criterion=name, budget_bytes=budget, total_bytes=sum(sizes), indices=chosen,
        names=[profile.units[i].name for i in chosen],
        modules=[m for i in chosen for m in profile.units[i].modules],
        bytes=sum(sizes[i] for i in chosen), predicted_gain=predicted,
        predicted_gap_closed=None if predicted is None or gap == 0 else predicted / gap, gain_score=gain_score,
        keep_modules=list(profile.keep_modules), priced_in=priced_in,
        held_bytes=None if held is None else sum(held[i] for i in chosen), groups=groups)
    _measure_into(result, profile, model, batches, heldout, heldout_reference, units)
    return result


def _unit_prices(profile: SensitivityProfile, priced_in: str, model: nn.Module | None,
                 units: UnitSpec) -> tuple[list[int], list[int] | None]:
    """:func:`plan`'s price of each profiled unit in ``priced_in``, and the bytes each holds on the model's recovery
    path (None when neither the model nor the profile says); the model's units are checked against the profile's."""
    if priced_in not in PRICES:
        raise ValueError(f"priced_in={priced_in!r}: one of {PRICES} (BF16 bytes, or the bytes the model's recovery "
                         "path holds)")
    if model is not None:
        info = _units(model, units)
        _check_same_units(profile, info)
        held = held_unit_bytes(info)
    else:
        held = _recorded_held(profile)
    if priced_in != "held":
        return [u.bytes for u in profile.units], held
    if held is None:
        raise ValueError("priced_in='held' prices the bytes the model's recovery path holds: give the model "
                         "(plan(..., model=model)), or a profile from profile_sensitivity, which records them")
    return held, held


def _choose(profile: SensitivityProfile, name: str, sizes: list[int], budget_bytes: int | None,
            budget_fraction: float | None, groups: str | None, model: nn.Module | None) -> tuple[int, list[int]]:
    """:func:`plan`'s budget in bytes and the units it buys, greedy by ``name``'s score per byte: unit by unit, or
    whole serving groups (``groups``)."""
    if groups is None:
        budget = _budget(sizes, [u.name for u in profile.units], budget_bytes, budget_fraction)
        return budget, greedy_select(profile.scores(name), sizes, budget)
    buys, buy_names = unit_purchases(profile, serving_layout(groups, model=model, profile=profile))
    buy_sizes = purchase_totals(buys, sizes)
    budget = _budget(buy_sizes, buy_names, budget_bytes, budget_fraction)
    picks = greedy_select(purchase_totals(buys, profile.scores(name)), buy_sizes, budget)
    return budget, sorted(i for b in picks for i in buys[b])


def _measure_into(result: PrecisionPlan, profile: SensitivityProfile, model: nn.Module | None,
                  batches: Iterable[dict[str, Any]] | None, heldout: Iterable[dict[str, Any]] | None,
                  heldout_reference: tuple[float, float] | None, units: UnitSpec) -> None:
    """:func:`plan`'s measurement of its chosen set into ``result.measured``: on the profile's own ``batches`` (checked
    against the profile's; its L_low and L_high reused) and on ``heldout``."""
    if model is None:
        if batches is not None or heldout is not None:
            raise ValueError("measuring a plan needs the model: plan(..., model=model, batches=...)")
        return
    if batches is not None:
        prepared, counts = _prepare_batches(model, batches)
        _check_same_batches(profile, prepared, counts)
        ref = (profile.losses["low"], profile.losses["high"])
        result.measured["profile"] = measure_plan(model, result.indices, prepared, reference=ref, units=units)
    if heldout is not None:
        result.measured["heldout"] = measure_plan(model, result.indices, heldout, reference=heldout_reference,
                                                  units=units)


def measure_plan(
    model: nn.Module,
    chosen: PrecisionPlan | Sequence[int],
    batches: Iterable[dict[str, Any]],
    reference: tuple[float, float] | None = None,
    units: UnitSpec = None,
) -> dict[str, float]:
    """The loss with ``chosen`` on BF16 (the rest low) and the share of the low-to-high gap it closes.

    Args:
        model: the profiled dual-path model.
        chosen: a plan or unit indices.
        batches: the data (as for :func:`profile_sensitivity`).
        reference: ``(L_low, L_high)`` on these batches when known (else two more forwards measure them).

    Returns:
        ``loss_low``, ``loss_high``, ``loss_plan``, ``gap_closed`` = (L_low - L_plan) / (L_low - L_high)
        (NaN when L_low == L_high), ``seconds``.
    """
    indices = list(chosen.indices if isinstance(chosen, PrecisionPlan) else chosen)
    info = _units(model, units)
    bad = [i for i in indices if not _is_int(i) or not 0 <= i < len(info)]
    if bad:
        raise ValueError(f"unit indices {bad[:5]} are not units of this model (it has {len(info)}: 0 to {len(info) - 1})")
    if isinstance(chosen, PrecisionPlan) and len(chosen.names) == len(indices):
        for i, name in zip(indices, chosen.names):
            if info[i].name != name:
                raise ValueError(f"the plan is not for this model: its unit {i} is {name}, the model's is {info[i].name}")
    prepared, counts = _prepare_batches(model, batches)
    weights = [n / sum(counts) for n in counts]
    start = active_units(model, [(u.name, u.module) for u in info])
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            def mean_loss(path: Iterable[int]) -> float:
                _set_path(info, path)
                return sum(w * float(_loss(model, b)) for w, b in zip(weights, prepared))

            if reference is None:
                low, high = mean_loss([]), mean_loss(range(len(info)))
            else:
                low, high = float(reference[0]), float(reference[1])
            planned = mean_loss(indices)
    finally:
        _set_path(info, start)
        model.train(was_training)
    gap = low - high
    return {"loss_low": low, "loss_high": high, "loss_plan": planned,
            "gap_closed": (low - planned) / gap if gap != 0 else math.nan, "seconds": time.perf_counter() - t0}


def paired_plans(profile: SensitivityProfile, plans: Sequence[PrecisionPlan], groups: str = "vllm",
                 **kw: Any) -> tuple[list[PrecisionPlan], list[PrecisionPlan]]:
    """``(free, grouped)``: each of ``plans`` beside the plan of the other kind (grouped by ``groups`` for a
    free plan, free for a grouped one) at the same budget, criterion and currency, measured as ``kw`` says
    (:func:`plan`'s ``model``, ``batches``, ``heldout``, ...); a budget that buys no serving group is left out
    (a tiny model's smallest budgets). The layout is checked first: an unknown one raises, in one line."""
    serving_layout(groups, model=kw.get("model"), profile=profile)
    free, grouped = [], []
    for p in plans:
        other = None if p.groups else groups
        try:
            q = plan(profile, p.budget_bytes, criterion=p.criterion, priced_in=p.priced_in, groups=other, **kw)
        except ValueError:  # the layout is known (above): the budget buys no purchase of the other kind
            continue
        free.append(q if p.groups else p)
        grouped.append(p if p.groups else q)
    return free, grouped


def format_grouping_table(free: Sequence[PrecisionPlan], grouped: Sequence[PrecisionPlan],
                          layout: Sequence[ServingGroup] | None = None,
                          over_low: dict[str, Any] | None = None) -> str:
    """The free and the grouped plan at each budget, side by side (rows in pairs): linears kept, serving groups
    the plan splits (with ``layout``), bytes, predicted and measured gap closed on each data set the plans were
    measured on (``profile``: in-sample, the batches the plan was chosen on; ``heldout``), and on each grouped
    row what the constraint cost: grouped minus free gap closed. ``free[i]`` and ``grouped[i]`` are plans of
    one profile at one budget; ``over_low`` (:func:`gnmr_hf.planning.budget.memory_budget`'s record) adds
    each plan's memory over the all-low model."""

    if len(free) != len(grouped):
        raise ValueError(f"{len(free)} free plan(s) against {len(grouped)} grouped: one of each per budget")
    wheres = sorted({w for p in [*free, *grouped] for w in p.measured}, key=lambda w: (w != "profile", w))
    label = {"profile": "profile, in-sample"}
    head = (["budget", "plan", "linears"] + (["split groups"] if layout is not None else []) + ["extra MiB (BF16)"]
            + ([f"memory over {over_low['low'].upper()}"] if over_low else []) + ["predicted gap closed"]
            + [f"gap closed ({label.get(w, w)})" for w in wheres] + [f"grouped - free ({w})" for w in wheres])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f, g in zip(free, grouped):
        if f.budget_bytes != g.budget_bytes:
            raise ValueError(f"the free plan's budget is {f.budget_bytes} B, the grouped one's {g.budget_bytes} B")
        for kind, p in (("free", f), (f"grouped ({g.groups})", g)):
            row = [f"{_pct(p.budget_fraction)} %", kind, str(len(p.modules))]
            if layout is not None:
                row.append(str(len(split_groups(p.modules, layout))))
            row.append(f"{p.bytes / 2**20:.2f}")
            if over_low:
                row.append(f"+{100 * p.bytes / over_low['bf16_per_over_byte'] / over_low['low_model_bytes']:.1f} %")
            row.append(_fmt(p.predicted_gap_closed, ".3f"))
            row += [_fmt(p.measured.get(w, {}).get("gap_closed"), ".3f") for w in wheres]
            if p is g:
                diffs = [(g.measured.get(w, {}).get("gap_closed"), f.measured.get(w, {}).get("gap_closed"))
                         for w in wheres]
                row += [_fmt(None if a is None or b is None else a - b, "+.3f") for a, b in diffs]
            else:
                row += [""] * len(wheres)
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)



def random_sets(sizes: Sequence[int], budget: int, draws: int, seed: int = 0) -> list[list[int]]:
    """``draws`` random unit sets of at most ``budget`` bytes: units in a seeded random order, each taken
    when it still fits (the same fill rule as the greedy planner)."""
    r = random.Random(seed)
    out = []
    for _ in range(draws):
        order = list(range(len(sizes)))
        r.shuffle(order)
        chosen, used = [], 0
        for i in order:
            if used + sizes[i] <= budget:
                chosen.append(i)
                used += sizes[i]
        out.append(sorted(chosen))
    return out

