"""What every trigger policy shares: the protocols the callback drives (:class:`TriggerPolicy` and its
two extensions), the argument helpers, and :class:`_BaselinePolicy` (budget, masks, records, summary and
state of the baselines; a new trigger subclasses it and implements ``_select``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController, unit_mask

# GNMRConfig fields that shape the baselines' GNMR statistics (the budget and locks are the policy's own)
_THRESHOLD_FIELDS = ("alpha", "alpha_init", "beta", "beta_init", "window", "init_steps")


# ---------------------------------------------------------------------------------------------- protocols


@runtime_checkable
class TriggerPolicy(Protocol):
    """What the callback calls on a trigger policy (``isinstance`` works on any object)."""

    num_units: int

    def initial_mask(self) -> torch.Tensor:
        """The units on the recovery path during step 1, a bool tensor [U]."""
        ...

    def step(self, norms: torch.Tensor) -> torch.Tensor:
        """Take step t's per-unit gradient norms [U]; return the bool mask [U] for step t + 1."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """A JSON-safe snapshot for exact resume."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly after a JSON round trip)."""
        ...

    def summary(self) -> dict[str, Any]:
        """Run figures (the controller's keys)."""
        ...

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The record of the last step, or None before the first."""
        ...


@runtime_checkable
class MicrobatchPolicy(TriggerPolicy, Protocol):
    """A policy that also reads each micro-batch's squared per-unit gradient norms (GSNR)."""

    needs_microbatch_norms: bool

    def observe_microbatch(self, sq_norms: torch.Tensor) -> None:
        """Add one micro-batch's per-unit squared gradient-contribution norms [U]."""
        ...


@runtime_checkable
class GapPolicy(TriggerPolicy, Protocol):
    """A policy fed measured per-unit recovery gaps (see :mod:`gnmr_hf.core.oracle`)."""

    def wants_gap(self, step: int) -> bool:
        """Whether the caller should measure the gap at ``step`` (1-based) before calling :meth:`step`."""
        ...

    def observe_gap(self, gaps: torch.Tensor) -> None:
        """Take the per-unit gaps [U] measured at the step in progress."""
        ...


# ---------------------------------------------------------------------------------------------- helpers


def _as_vector(values: Any, num_units: int, what: str) -> list[float]:
    vec = torch.as_tensor(values).detach()
    if vec.dim() != 1 or vec.shape[0] != num_units:
        raise ValueError(f"{what} must be a 1-D tensor of shape [{num_units}], got shape {tuple(vec.shape)}")
    return vec.to(device="cpu", dtype=torch.float64).tolist()


def _recoverable_list(recoverable: Any, num_units: int) -> list[bool]:
    return [True] * num_units if recoverable is None else unit_mask(recoverable, num_units).tolist()


def _unit_list(units: Any, num_units: int, recoverable: Sequence[bool] | None, what: str = "units") -> list[int]:
    """Distinct unit indices, sorted, recoverable unless ``recoverable`` is None (``ValueError`` naming
    ``what`` otherwise)."""
    if isinstance(units, (str, bytes)) or not isinstance(units, Iterable):
        raise ValueError(f"{what} must be a sequence of unit indices, got {units!r}")
    units = list(units)
    if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_units for b in units):
        raise ValueError(f"{what} must be indices in [0, {num_units}), got {units}")
    if len(set(units)) != len(units):
        raise ValueError(f"{what} must be distinct, got {units}")
    if recoverable is not None:
        _check_recoverable(units, recoverable, what)
    return sorted(units)


def _check_recoverable(units: Iterable[int], recoverable: Sequence[bool], what: str) -> None:
    not_rec = sorted(b for b in units if not recoverable[b])
    if not_rec:
        raise ValueError(f"{what} {not_rec} have no recovery path (recoverable is False)")


def _top_k(score: Sequence[float], k: int, eligible: Sequence[bool], highest: bool = True) -> list[int]:
    """Indices (ascending) of the ``k`` eligible units with the highest (lowest) score, ties to the lower
    index; a NaN score ranks first either way (an undefined score is treated as the riskiest)."""
    sign = -1.0 if highest else 1.0
    cand = [b for b, ok in enumerate(eligible) if ok]
    cand.sort(key=lambda b: (-math.inf if math.isnan(score[b]) else sign * score[b], b))
    return sorted(cand[:k])


def _json_float(v: float) -> float | str:
    # JSON has no inf/nan; as strings the state survives json.dumps(allow_nan=False), and float() reads them
    return v if math.isfinite(v) else repr(v)


# ---------------------------------------------------------------------------------------------- base


class _BaselinePolicy:
    """Budget, masks, records, summary and state shared by the baselines; subclasses implement ``_select``.

    GNMR / Delta-GNMR statistics come from an inner :class:`GNMRController` with ``max_active=0``.
    """

    name = "base"
    needs_microbatch_norms = False

    def __init__(self, num_units: int, max_active: int, recoverable: Any = None, **thresholds: Any) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        if isinstance(max_active, bool) or not isinstance(max_active, int) or max_active < 0:
            raise ValueError(f"max_active must be an integer >= 0, got {max_active!r}")
        unknown = sorted(set(thresholds) - set(_THRESHOLD_FIELDS))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown argument(s) {unknown}; "
                             f"the GNMR statistics take {list(_THRESHOLD_FIELDS)}")
        self.num_units = num_units
        self.max_active = max_active
        self.recoverable = _recoverable_list(recoverable, num_units)
        self._monitor = GNMRController(num_units, GNMRConfig(max_active=0, **thresholds))
        self._mask = self._first_mask()
        self.last_record: dict[str, Any] | None = None
        self._totals = {"steps": 0, "active": 0, "hit_max": 0, "promotions": 0, "demotions": 0}

    @property
    def budget(self) -> int:
        """Units the policy may activate at once: ``min(max_active, recoverable units)``."""
        return min(self.max_active, sum(self.recoverable))

    def _first_mask(self) -> list[bool]:
        return [False] * self.num_units

    def initial_mask(self) -> torch.Tensor:
        """The units on the recovery path during step 1 (none, unless the policy says otherwise)."""
        return torch.tensor(self._first_mask(), dtype=torch.bool)

    def _check_ready(self) -> None:
        """Raise ``ValueError`` if ``step`` cannot run now (called before any state changes)."""

    def _select(self, t: int, norms: Any, stats: dict[str, Any]) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def step(self, norms: Any) -> torch.Tensor:
        """Take step t's per-unit gradient norms [U]; return the bool mask [U] for step t + 1."""
        self._check_ready()
        self._monitor.step(norms)  # validates the norms before anything else changes
        stats = self._monitor.last_record
        t = stats["step"]
        active, risk = self._select(t, norms, stats)
        if len(active) > self.budget or any(not self.recoverable[b] for b in active):
            raise AssertionError(f"{self.name} selected {active} outside its budget")  # a bug, not user error
        chosen = set(active)
        new = [b in chosen for b in range(self.num_units)]
        promoted = [b for b in range(self.num_units) if new[b] and not self._mask[b]]
        demoted = [b for b in range(self.num_units) if self._mask[b] and not new[b]]
        hit = len(active) == self.max_active
        tot = self._totals
        tot["steps"] = t
        tot["active"] += sum(self._mask)  # the mask in effect during step t
        tot["promotions"] += len(promoted)
        tot["demotions"] += len(demoted)
        tot["hit_max"] += int(hit)
        self._mask = new
        self.last_record = {
            "step": t,
            "active": sorted(chosen),
            "promoted": promoted,
            "demoted": demoted,
            "selected": sorted(chosen),
            "warmup": False,
            "over_gnmr": stats["over_gnmr"],
            "over_delta": stats["over_delta"],
            "candidates": sum(self.recoverable),
            "hit_max": hit,
            "nonfinite": stats["nonfinite"],
            "alpha_t": stats["alpha_t"],
            "beta_t": stats["beta_t"],
            "gnmr": stats["gnmr"],
            "delta": stats["delta"],
            "risk": risk,
        }
        return torch.tensor(new, dtype=torch.bool)

    def summary(self) -> dict[str, Any]:
        """Run figures with the controller's definitions (``GNMRController.summary``).

        ``promotion_ratio`` = active unit-steps / recoverable unit-steps over the masks in effect during
        steps 1..t; ``mean_active`` = active unit-steps / t; ``hit_max_rate`` = steps whose selection
        filled ``max_active`` / steps; ``gnmr_exceedance_rate`` / ``delta_exceedance_rate`` = unit-steps
        (U * t) with GNMR >= alpha_t / Delta >= beta_t; ``switches`` = promotions + demotions;
        ``nonfinite`` = unit-steps with a non-finite norm.
        """
        tot, stats = self._totals, self._monitor.summary()
        steps = tot["steps"]
        rec_steps = steps * sum(self.recoverable)
        return {
            "policy": self.name,
            "steps": steps,
            "promotion_ratio": tot["active"] / rec_steps if rec_steps else 0.0,
            "mean_active": tot["active"] / steps if steps else 0.0,
            "hit_max_rate": tot["hit_max"] / steps if steps else 0.0,
            "gnmr_exceedance_rate": stats["gnmr_exceedance_rate"],
            "delta_exceedance_rate": stats["delta_exceedance_rate"],
            "switches": tot["promotions"] + tot["demotions"],
            "promotions": tot["promotions"],
            "demotions": tot["demotions"],
            "nonfinite": stats["nonfinite"],
        }

    # -- state ---------------------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """A JSON-safe snapshot for exact resume (``last_record`` is a view of the last step, not part of it)."""
        return {
            "policy": self.name,
            "num_units": self.num_units,
            "mask": list(self._mask),
            "totals": dict(self._totals),
            "monitor": self._monitor.state_dict(),
            **self._extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same policy and number of units."""
        if state.get("policy") != self.name or state.get("num_units") != self.num_units:
            raise ValueError(f"state is for policy {state.get('policy')!r} with {state.get('num_units')} units, "
                             f"not {self.name!r} with {self.num_units}")
        self._monitor.load_state_dict(state["monitor"])
        self._mask = [bool(v) for v in state["mask"]]
        self._totals = {k: int(v) for k, v in state["totals"].items()}
        self.last_record = None
        self._load_extra_state(state)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_units={self.num_units}, max_active={self.max_active}, "
                f"steps={self._totals['steps']})")
