"""Planned sets: a fixed set of units on the recovery path (:class:`StaticSetPolicy`, alias
:class:`StaticPolicy`, the planner's choice), GNMR on top of it (:class:`HybridPolicy`), and the two
set builders of the static baselines (:func:`most_active_units`, :func:`edge_units`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController, _check_unit_bytes
from gnmr_hf.core.policies.base import (
    _BaselinePolicy,
    _check_recoverable,
    _recoverable_list,
    _top_k,
    _unit_list,
)


def most_active_units(active_sets: Iterable[Iterable[int]], num_units: int, k: int) -> list[int]:
    """The ``k`` units that were on the recovery path at the most steps (ties to the lower index).

    For the static baseline "the k layers GNMR promoted most": pass the ``active`` index lists of a GNMR
    run's trace (one per step).

    Args:
        active_sets: per step, the indices of the active units.
        num_units: U.
        k: how many units to return, 0 <= k <= U.
    """
    if not 0 <= k <= num_units:
        raise ValueError(f"k must lie in [0, {num_units}], got {k!r}")
    counts = [0] * num_units
    for active in active_sets:
        for b in active:
            if not 0 <= b < num_units:
                raise ValueError(f"unit index {b} outside [0, {num_units})")
            counts[b] += 1
    return _top_k([float(c) for c in counts], k, [True] * num_units)


def edge_units(num_units: int, k: int) -> list[int]:
    """The first ``ceil(k / 2)`` and the last ``floor(k / 2)`` units: the "first and last layers" set.

    Args:
        num_units: U.
        k: how many units, 0 <= k <= U.
    """
    if not 0 <= k <= num_units:
        raise ValueError(f"k must lie in [0, {num_units}], got {k!r}")
    first = (k + 1) // 2
    return list(range(first)) + list(range(num_units - (k - first), num_units))


class StaticSetPolicy(_BaselinePolicy):
    """A fixed (planned) set of units on the recovery path at every step, step 1 included; also
    available as :data:`StaticPolicy`.

    The mask never changes: :meth:`initial_mask` and every :meth:`step` return the set, so the summary
    has no switches, ``promotion_ratio = |units| / recoverable units`` and ``hit_max_rate`` 1 when the
    set fills ``max_active``.

    Args:
        num_units (`int`): U.
        units (`Sequence[int]`): the unit indices (distinct, recoverable), e.g. :func:`most_active_units`
            of a GNMR run or :func:`edge_units`.
        recoverable (*optional*): U bools; None means all.
        max_active (`int`, *optional*): the budget the set must fit in; defaults to ``len(units)``.
        unit_bytes (*optional*): each unit's recovery bytes (U integers >= 0), as for
            :class:`~gnmr_hf.core.controller.GNMRController`: the records then carry ``active_bytes``
            (the set's bytes) and the summary ``mean_active_bytes`` / ``peak_active_bytes``.
        **thresholds: the GNMR statistics' thresholds, as for :class:`StaticSensitivityPolicy`.
    """

    name = "static_set"
    static = True  # the mask never changes: GNMRCallback logs no per-step gnmr/* counts for it

    def __init__(self, num_units: int, units: Sequence[int], recoverable: Any = None,
                 max_active: int | None = None, unit_bytes: Any = None, **thresholds: Any) -> None:
        self.units = _unit_list(units, num_units, None)  # _first_mask, called by __init__, needs them
        super().__init__(num_units, len(self.units) if max_active is None else max_active, recoverable,
                         **thresholds)
        _check_recoverable(self.units, self.recoverable, "units")
        if len(self.units) > self.max_active:
            raise ValueError(f"{len(self.units)} units do not fit in max_active={self.max_active}")
        self.unit_bytes = None if unit_bytes is None else _check_unit_bytes(unit_bytes, num_units)
        self.set_bytes = None if self.unit_bytes is None else sum(self.unit_bytes[b] for b in self.units)

    def step(self, norms: Any) -> torch.Tensor:
        """Take step t's per-unit gradient norms [U]; return the (always the same) mask for step t + 1."""
        mask = super().step(norms)
        if self.unit_bytes is not None:
            self.last_record.update(hit_bytes=False, active_bytes=self.set_bytes, budget_bytes=None)
        return mask

    def summary(self) -> dict[str, Any]:
        """The baselines' figures; with ``unit_bytes`` also ``mean_active_bytes`` and ``peak_active_bytes``
        (both the set's bytes once a step was taken: the set is in effect at every step)."""
        out = super().summary()
        if self.unit_bytes is not None:
            ran = out["steps"] > 0
            out["mean_active_bytes"] = float(self.set_bytes) if ran else 0.0
            out["peak_active_bytes"] = self.set_bytes if ran else 0
            out["hit_bytes_rate"] = 0.0
        return out

    def _first_mask(self) -> list[bool]:
        chosen = set(self.units)
        return [b in chosen for b in range(self.num_units)]

    def _select(self, t, norms, stats):
        return list(self.units), [1.0 if m else 0.0 for m in self._first_mask()]

    def _extra_state(self):
        return {"units": list(self.units)}

    def _load_extra_state(self, state):
        if [int(b) for b in state["units"]] != self.units:
            raise ValueError(f"state is for the unit set {state['units']}, this policy holds {self.units}")


StaticPolicy = StaticSetPolicy
"""A planned unit set on the recovery path at every step: :class:`StaticSetPolicy` under its plan name."""


class HybridPolicy:
    """A planned set of units always on the recovery path, plus GNMR over the other recoverable units.

    The mask for every step is ``planned | gnmr``, where ``gnmr`` is the mask of an exact
    :class:`~gnmr_hf.core.controller.GNMRController` built with ``config`` over all U units (every unit
    is monitored, so the GNMR statistics are the controller's own) whose recoverable units exclude the
    planned ones: GNMR never selects a planned unit, and a planned unit never takes a place of its
    budget.

    The budget: ``config`` is the budget of the GNMR part alone, on top of the planned set. To spend at
    most K units and B bytes in all, plan the set P and give GNMR what is left yourself, e.g.
    ``HybridPolicy(U, planned=P, config=GNMRConfig(max_active=K - len(P), max_active_bytes=B - bytes(P)),
    unit_bytes=unit_bytes)``; nothing is subtracted here. The warm-up (``full_recovery_steps``) puts every
    recoverable unit on the recovery path, planned or not, as the controller's does.

    Records (:attr:`last_record`): the controller's record with ``active`` (and, with ``unit_bytes``,
    ``active_bytes``) for the whole mask, planned units included, plus ``planned`` (the planned indices),
    ``gnmr_active`` / ``gnmr_active_bytes`` (the controller's part alone). ``selected``, ``candidates``,
    ``hit_max``, ``hit_bytes``, ``budget_bytes`` and the per-unit statistics are the GNMR part's;
    ``promoted`` / ``demoted`` are the same for both (the planned set never changes).

    Args:
        num_units (`int`): U.
        planned (`Sequence[int]`): the planned unit indices (distinct, recoverable).
        config (`GNMRConfig`, *optional*): the GNMR part's thresholds, locks and budget; defaults to
            ``GNMRConfig()``.
        recoverable (*optional*): which units have a recovery path (None: all), as for the controller.
        unit_bytes (*optional*): each unit's recovery bytes (U integers >= 0); required when
            ``config.max_active_bytes`` is set.

    Attributes:
        controller (`GNMRController`): the GNMR part.
        planned (`list[int]`): the planned units, ascending.
        planned_bytes (`int` or `None`): their recovery bytes (None without ``unit_bytes``).
    """

    name = "hybrid"
    needs_microbatch_norms = False

    def __init__(self, num_units: int, planned: Sequence[int], config: GNMRConfig | None = None,
                 recoverable: Any = None, unit_bytes: Any = None) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        self.num_units = num_units
        self.recoverable = _recoverable_list(recoverable, num_units)
        self.planned = _unit_list(planned, num_units, self.recoverable, "planned")
        planned_set = set(self.planned)
        gnmr_recoverable = [r and b not in planned_set for b, r in enumerate(self.recoverable)]
        self.controller = GNMRController(num_units, config, recoverable=gnmr_recoverable, unit_bytes=unit_bytes)
        self.config = self.controller.config
        self.unit_bytes = self.controller.unit_bytes
        self.planned_bytes = None if self.unit_bytes is None else sum(self.unit_bytes[b] for b in self.planned)
        self._planned_mask = torch.zeros(num_units, dtype=torch.bool)
        self._planned_mask[self.planned] = True
        self._record_src: dict[str, Any] | None = None  # the controller record the cached one was built from
        self._record: dict[str, Any] | None = None

    def initial_mask(self) -> torch.Tensor:
        """The units on the recovery path during step 1: the planned set (every recoverable unit in a warm-up)."""
        return self._planned_mask | self.controller.initial_mask()

    def step(self, norms: Any) -> torch.Tensor:
        """Take step t's per-unit gradient norms [U]; return ``planned | GNMR's mask`` for step t + 1."""
        return self._planned_mask | self.controller.step(norms)

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The record of the last step (see the class docstring), or None before the first and after a load."""
        inner = self.controller.last_record
        if inner is None:
            return None
        if self._record_src is not inner:
            record = dict(inner)
            record["gnmr_active"] = inner["active"]
            record["gnmr_active_bytes"] = inner["active_bytes"]
            record["active"] = sorted(set(inner["active"]) | set(self.planned))
            if self.planned_bytes is not None:
                # the controller's active units are never planned ones, so the bytes add up
                record["active_bytes"] = inner["active_bytes"] + self.planned_bytes
            record["planned"] = list(self.planned)
            self._record_src, self._record = inner, record
        return self._record

    def summary(self) -> dict[str, Any]:
        """Run figures for the whole mask, with the controller's definitions, and the GNMR part's own.

        ``promotion_ratio`` = (planned + GNMR) active unit-steps / recoverable unit-steps (all recoverable
        units, planned included), ``mean_active`` = GNMR's mean + the planned count; ``hit_max_rate``,
        ``hit_bytes_rate``, the exceedance rates, ``switches``, ``promotions``, ``demotions`` and
        ``nonfinite`` are the GNMR part's (the planned set never switches). ``planned`` = the planned
        count; ``gnmr`` = the controller's own :meth:`~GNMRController.summary` (its ratio is over the
        units it may select). With ``unit_bytes``, ``mean_active_bytes`` / ``peak_active_bytes`` include
        the planned bytes, and ``planned_bytes`` gives them.
        """
        inner = self.controller.summary()
        t, P = inner["steps"], len(self.planned)
        rec_steps = t * sum(self.recoverable)
        # GNMR's active unit-steps: mean_active * t is an integer count up to rounding
        active = round(inner["mean_active"] * t) + P * t
        out = dict(inner)
        out.update(
            promotion_ratio=active / rec_steps if rec_steps else 0.0,
            mean_active=active / t if t else 0.0,
        )
        if self.planned_bytes is not None:
            out["mean_active_bytes"] = inner["mean_active_bytes"] + (self.planned_bytes if t else 0)
            out["peak_active_bytes"] = inner["peak_active_bytes"] + (self.planned_bytes if t else 0)
            out["planned_bytes"] = self.planned_bytes
        return {"policy": self.name, "planned": P, **out, "gnmr": inner}

    def state_dict(self) -> dict[str, Any]:
        """A JSON-safe snapshot for exact resume: the planned set and the controller's state."""
        return {"policy": self.name, "num_units": self.num_units, "planned": list(self.planned),
                "controller": self.controller.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a hybrid policy with the same units, plan, config and unit bytes."""
        if state.get("policy") != self.name or state.get("num_units") != self.num_units:
            raise ValueError(f"state is for policy {state.get('policy')!r} with {state.get('num_units')} units, "
                             f"not {self.name!r} with {self.num_units}")
        if [int(b) for b in state["planned"]] != self.planned:
            raise ValueError(f"state is for the planned set {state['planned']}, this policy plans {self.planned}")
        self.controller.load_state_dict(state["controller"])
        self._record_src = self._record = None

    def __repr__(self) -> str:
        return (f"HybridPolicy(num_units={self.num_units}, planned={self.planned}, "
                f"steps={self.controller.t}, config={self.config})")
