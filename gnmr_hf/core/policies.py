"""Trigger policies: who goes on the recovery path next step, GNMR and the baselines it is compared with.

Every policy satisfies :class:`TriggerPolicy`, the interface :class:`gnmr_hf.GNMRCallback` (``policy=``)
and the stress recipes drive, so all of them act through the same dual-path actuator:

- ``initial_mask() -> bool[U]``: the units on the recovery path during step 1;
- ``step(norms[U]) -> bool[U]``: given step t's per-unit gradient norms (pre-clip, after accumulation),
  the units on the recovery path during step t + 1;
- ``state_dict()`` / ``load_state_dict(state)``: a JSON-safe snapshot for exact resume;
- ``last_record``: the record of the last step (the controller's keys: ``active``, ``promoted``,
  ``demoted``, ``over_gnmr``, ``over_delta``, ``hit_max``, ``nonfinite``, ``gnmr``, ``delta``, ``risk``);
- ``summary()``: run figures with the controller's definitions (promotion ratio, mean active units,
  hit-maxO rate, exceedance rates, switches).

Two optional extensions, each with its own protocol: :class:`MicrobatchPolicy` (``needs_microbatch_norms``
and ``observe_microbatch(sq_norms)``: the callback reports every micro-batch's squared per-unit gradient
norms before ``step``) and :class:`GapPolicy` (``wants_gap(step)`` and ``observe_gap(gaps)``: the caller
measures the per-unit recovery gap of :mod:`gnmr_hf.core.oracle` at the steps the policy asks for).

The policies, by the name :func:`make_policy` knows them:

- ``"gnmr"``: GNMR + Delta-GNMR under the ``max_active`` budget with locks, i.e.
  :class:`gnmr_hf.core.controller.GNMRController` itself (the paper's method; rules in docs/design.md).
- ``"adapt"``: :class:`StaticSensitivityPolicy`, an ADAPT-style static baseline (paper Appendix E.4):
  profile each unit's GNMR over a BF16 warm-up, then fix the top 25 % (capped by ``max_active``) on the
  recovery path for the rest of the run.
- ``"gsnr"``: :class:`GSNRPolicy`, the gradient signal-to-noise ranking (paper Appendix E.5): every step
  the ``max_active`` units with the lowest GSNR over the accumulation window's micro-batches.
- ``"random"``: :class:`RandomPolicy`, a seeded uniform draw of ``max_active`` units every step (a
  project baseline, not in the paper: the budget always full, no signal).
- ``"random_budget"``: :class:`RandomBudgetPolicy`, a seeded uniform draw whose size follows a
  deterministic schedule with a given, possibly fractional, mean number of recovery units per step:
  the "same budget as GNMR actually used" baseline of the NF4 comparison.
- ``"static_set"``: :class:`StaticSetPolicy`, a fixed set of units on the recovery path every step
  (for instance the units GNMR promoted most, see :func:`most_active_units`, or the first and last
  layers, see :func:`edge_units`): does *which* units matter, or only how many?
- ``"gap_profile"``: :class:`GapProfilePolicy`, the top-k units by their measured recovery gap (the
  relative gradient error of the low path, :func:`gnmr_hf.core.oracle.recovery_gap`) averaged over a
  window of measurements: a trigger that knows the gap, profiled over the first steps and optionally
  refreshed every N steps; with a window of 1 refreshed every step it is the previous
  step's gap.

Outside :func:`make_policy` (they take a planned unit set, which the recipes choose):

- :class:`StaticPolicy` (= :class:`StaticSetPolicy`): a planned set on the recovery path at every step.
- :class:`HybridPolicy`: a planned set always on the recovery path, plus an exact
  :class:`~gnmr_hf.core.controller.GNMRController` choosing among the other recoverable units under its
  own budget (``max_active`` and optionally ``max_active_bytes`` of its config).

The baselines report GNMR, Delta-GNMR and their exceedance counts like the controller does, so their
records and summaries compare line for line; those figures come from an inner
:class:`~gnmr_hf.core.controller.GNMRController` with ``max_active=0`` (one implementation of GNMR) and
do not influence the selections, except the ADAPT-style profile, which *is* mean GNMR.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController, _check_unit_bytes, unit_mask

__all__ = [
    "POLICIES",
    "GSNRPolicy",
    "GapPolicy",
    "GapProfilePolicy",
    "HybridPolicy",
    "MicrobatchPolicy",
    "RandomBudgetPolicy",
    "RandomPolicy",
    "StaticPolicy",
    "StaticSensitivityPolicy",
    "StaticSetPolicy",
    "TriggerPolicy",
    "edge_units",
    "make_policy",
    "most_active_units",
]

POLICIES = ("gnmr", "adapt", "gsnr", "random", "random_budget", "static_set", "gap_profile")

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


# ---------------------------------------------------------------------------------------------- baselines


class StaticSensitivityPolicy(_BaselinePolicy):
    """ADAPT-style static baseline (paper Appendix E.4).

    During the first ``warmup_steps`` steps (which the recipe runs in BF16) it records each unit's GNMR;
    at the end of the warm-up it averages GNMR per unit (a non-finite norm counts as 1e30, the riskiest),
    takes the top ``fraction`` of the recoverable units (at least one, at most ``max_active``) and keeps
    exactly that set on the recovery path for the rest of the run.

    Args:
        num_units (`int`): U.
        max_active (`int`): the budget maxO.
        warmup_steps (`int`): the profiling steps W (paper: 500).
        fraction (`float`, defaults to 0.25): share of the recoverable units fixed at high precision.
        recoverable (*optional*): U bools; None means all.
        **thresholds: ``alpha``, ``alpha_init``, ``beta``, ``beta_init``, ``window``, ``init_steps`` as in
            ``GNMRConfig`` (the GNMR statistics).
    """

    name = "adapt"

    def __init__(self, num_units: int, max_active: int, warmup_steps: int, fraction: float = 0.25,
                 recoverable: Any = None, **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.warmup_steps = warmup_steps
        self.fraction = float(fraction)
        self._gnmr_sum = [0.0] * num_units
        self._gnmr_count = [0] * num_units
        self.fixed: list[int] | None = None

    @property
    def in_warmup(self) -> bool:
        """True while the next step is still a warm-up (BF16) step."""
        return self._totals["steps"] < self.warmup_steps

    def _select(self, t, norms, stats):
        if t <= self.warmup_steps:
            for b, g in enumerate(stats["gnmr"]):
                self._gnmr_sum[b] += g if math.isfinite(g) else 1e30
                self._gnmr_count[b] += 1
        score = [s / c if c else 0.0 for s, c in zip(self._gnmr_sum, self._gnmr_count)]
        if t < self.warmup_steps:
            return [], score
        if self.fixed is None:
            k = min(self.budget, max(1, math.ceil(self.fraction * sum(self.recoverable))))
            self.fixed = _top_k(score, k, self.recoverable)
        return list(self.fixed), score

    def _extra_state(self):
        return {"gnmr_sum": list(self._gnmr_sum), "gnmr_count": list(self._gnmr_count), "fixed": self.fixed}

    def _load_extra_state(self, state):
        self._gnmr_sum = [float(v) for v in state["gnmr_sum"]]
        self._gnmr_count = [int(v) for v in state["gnmr_count"]]
        self.fixed = None if state["fixed"] is None else [int(v) for v in state["fixed"]]


class GSNRPolicy(_BaselinePolicy):
    """GSNR-style ranking (paper Appendix E.5): the noisiest units by gradient signal-to-noise ratio.

    Over one accumulation window of K micro-batches with per-unit gradient contributions d_1..d_K (the
    callback reports ``||d_k||^2`` through :meth:`observe_microbatch`) and accumulated gradient
    G = sum_k d_k (whose norm ``step`` receives), the mean is G/K and the unbiased variance is
    (sum_k ||d_k||^2 - ||G||^2 / K) / (K - 1), so

        GSNR = (||G||^2 / K^2) / ((sum_k ||d_k||^2 - ||G||^2 / K) / (K - 1)).

    It is scale-free (the Trainer's 1/K loss scaling cancels). Every step the ``max_active`` units with
    the lowest GSNR go on the recovery path. Needs K >= 2 (gradient accumulation).

    Args:
        num_units (`int`): U.
        max_active (`int`): the budget maxO.
        recoverable (*optional*): U bools; None means all.
        **thresholds: the GNMR statistics' thresholds, as for :class:`StaticSensitivityPolicy`.
    """

    name = "gsnr"
    needs_microbatch_norms = True

    def __init__(self, num_units: int, max_active: int, recoverable: Any = None, **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        self._sq_sum = [0.0] * num_units
        self._micro = 0

    def observe_microbatch(self, sq_norms: Any) -> None:
        """Add one micro-batch's per-unit squared gradient-contribution norms [U]."""
        values = _as_vector(sq_norms, self.num_units, "sq_norms")
        self._sq_sum = [s + v for s, v in zip(self._sq_sum, values)]
        self._micro += 1

    @staticmethod
    def gsnr(total_norm: float, sq_sum: float, k: int) -> float:
        """GSNR of one unit from ``||G||``, ``sum_k ||d_k||^2`` and K (see the class docstring)."""
        if not (math.isfinite(total_norm) and math.isfinite(sq_sum)):
            return -math.inf  # a non-finite gradient ranks as the noisiest
        signal = total_norm**2 / k**2
        var = (sq_sum - total_norm**2 / k) / (k - 1)
        if var <= 0:
            return math.inf if signal > 0 else 0.0
        return signal / var

    def _check_ready(self):
        if self._micro < 2:
            raise ValueError(
                f"GSNR needs the micro-batch gradients of an accumulation window (>= 2 micro-batches), got "
                f"{self._micro}; use gradient_accumulation_steps >= 2"
            )

    def _select(self, t, norms, stats):
        k = self._micro
        values = _as_vector(norms, self.num_units, "norms")
        score = [self.gsnr(n, s, k) for n, s in zip(values, self._sq_sum)]
        self._sq_sum = [0.0] * self.num_units
        self._micro = 0
        return _top_k(score, self.budget, self.recoverable, highest=False), score

    def _extra_state(self):
        return {"sq_sum": [_json_float(v) for v in self._sq_sum], "micro": self._micro}

    def _load_extra_state(self, state):
        self._sq_sum = [float(v) for v in state["sq_sum"]]
        self._micro = int(state["micro"])


class RandomPolicy(_BaselinePolicy):
    """Seeded random ranking: ``max_active`` recoverable units drawn uniformly every step (the budget full).

    Args:
        num_units (`int`): U.
        max_active (`int`): units drawn per step (capped by the recoverable units).
        recoverable (*optional*): U bools; None means all.
        seed (`int`, defaults to 0): the generator's seed.
        **thresholds: the GNMR statistics' thresholds, as for :class:`StaticSensitivityPolicy`.
    """

    name = "random"

    def __init__(self, num_units: int, max_active: int, recoverable: Any = None, seed: int = 0,
                 **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        self.seed = int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)

    def _select(self, t, norms, stats):
        score = torch.rand(self.num_units, generator=self._gen, dtype=torch.float64).tolist()
        return _top_k(score, self.budget, self.recoverable), score

    def _extra_state(self):
        return {"seed": self.seed, "generator": self._gen.get_state().tolist()}

    def _load_extra_state(self, state):
        self.seed = int(state["seed"])
        self._gen.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


class RandomBudgetPolicy(_BaselinePolicy):
    """Random units at a given mean budget: the same mean number of recovery unit-steps as a reference run.

    The number of units on the recovery path during step s (s = 1, 2, ...) follows a deterministic schedule,

        k_s = floor(m * s) - floor(m * (s - 1)),     m = ``mean_active``,

    so every step has ``floor(m)`` or ``ceil(m)`` units and the first T steps hold exactly
    ``floor(m * T)`` unit-steps: the mean over any run length is within 1 / T of m. m is read as the
    nearest fraction with denominator at most 10^6 (0.29 is 29/100 exactly), so the schedule does not
    depend on binary rounding. Which units: a uniform draw of k_s distinct recoverable units from a
    seeded generator, fresh every step. The draw for step 1 happens at construction
    (:meth:`initial_mask` returns it), the draw for step s + 1 in ``step(s)``.

    To match a GNMR run, pass its ``summary()["mean_active"]`` (active unit-steps per step).

    Args:
        num_units (`int`): U.
        mean_active (`float`): m >= 0, the mean number of recovery units per step.
        recoverable (*optional*): U bools; None means all.
        max_active (`int`, *optional*): the per-step cap, for ``hit_max`` and a check that
            ``ceil(m) <= max_active``; defaults to ``ceil(m)``.
        seed (`int`, defaults to 0): the generator's seed.
        **thresholds: the GNMR statistics' thresholds, as for :class:`StaticSensitivityPolicy`.
    """

    name = "random_budget"

    def __init__(self, num_units: int, mean_active: float, recoverable: Any = None, max_active: int | None = None,
                 seed: int = 0, **thresholds: Any) -> None:
        if isinstance(mean_active, bool) or not isinstance(mean_active, (int, float)) or not (
            math.isfinite(mean_active) and mean_active >= 0
        ):
            raise ValueError(f"mean_active must be a finite number >= 0, got {mean_active!r}")
        self.mean_active = Fraction(mean_active).limit_denominator(10**6)
        ceil_m = math.ceil(self.mean_active)
        max_active = ceil_m if max_active is None else max_active
        self.seed = int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._draw_for = 1  # the step the next draw is for
        self._first: list[bool] | None = None
        super().__init__(num_units, max_active, recoverable, **thresholds)
        if ceil_m > self.budget:
            raise ValueError(
                f"mean_active={mean_active} needs up to {ceil_m} units in a step, more than the budget "
                f"min(max_active={self.max_active}, recoverable units={sum(self.recoverable)})"
            )

    def count(self, step: int) -> int:
        """k_s: the number of units on the recovery path during ``step`` (1-based)."""
        m = self.mean_active
        return math.floor(m * step) - math.floor(m * (step - 1))

    def _draw(self) -> list[int]:
        k = self.count(self._draw_for)
        self._draw_for += 1
        pool = [b for b in range(self.num_units) if self.recoverable[b]]
        order = torch.randperm(len(pool), generator=self._gen).tolist()
        return sorted(pool[i] for i in order[:k])

    def _first_mask(self) -> list[bool]:
        if self._first is None:
            chosen = set(self._draw())
            self._first = [b in chosen for b in range(self.num_units)]
        return list(self._first)

    def _select(self, t, norms, stats):
        active = self._draw()
        return active, [1.0 if b in active else 0.0 for b in range(self.num_units)]

    def _extra_state(self):
        return {"seed": self.seed, "generator": self._gen.get_state().tolist(), "draw_for": self._draw_for,
                "first": self._first}

    def _load_extra_state(self, state):
        self.seed = int(state["seed"])
        self._gen.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        self._draw_for = int(state["draw_for"])
        self._first = [bool(v) for v in state["first"]]


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


class GapProfilePolicy(_BaselinePolicy):
    """The ``k`` units with the largest measured recovery gap, averaged over a window of measurements.

    The caller measures every unit's recovery gap (``gnmr_hf.core.oracle.recovery_gap``: the relative
    gradient error of the low path, one extra recovery-path backward) at the steps :meth:`wants_gap`
    names, and passes it to :meth:`observe_gap` before calling :meth:`step` for that step:

    - steps 1..``profile_steps`` (the profile), then
    - with ``refresh_every = N``, steps ``profile_steps + N``, ``profile_steps + 2N``, ... (the refresh).

    Each ``step`` that follows a new measurement re-ranks the units by the mean of the last ``gap_window``
    measurements (default: ``profile_steps``) and keeps the top ``k`` recoverable ones (ties to the lower
    index) until the next measurement. So during the profile the set follows the measurements so far,
    without refresh it is fixed from step ``profile_steps + 1`` on, and ``profile_steps = 1,
    refresh_every = 1`` gives the previous step's gap. Before the first measurement nothing is
    selected. A non-finite gap ranks as the largest. ``step`` raises ``ValueError`` when a wanted
    measurement is missing.

    Args:
        num_units (`int`): U.
        k (`int`): units kept on the recovery path (the budget).
        profile_steps (`int`): P >= 1.
        refresh_every (`int`, *optional*): N >= 1, or None for a profile fixed after step P.
        gap_window (`int`, *optional*): measurements averaged, >= 1; defaults to P.
        recoverable (*optional*): U bools; None means all.
        **thresholds: the GNMR statistics' thresholds, as for :class:`StaticSensitivityPolicy`.
    """

    name = "gap_profile"

    def __init__(self, num_units: int, k: int, profile_steps: int, refresh_every: int | None = None,
                 gap_window: int | None = None, recoverable: Any = None, **thresholds: Any) -> None:
        for field, value, optional in (("profile_steps", profile_steps, False), ("refresh_every", refresh_every, True),
                                       ("gap_window", gap_window, True)):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GapProfilePolicy.{field} must be an integer >= 1, got {value!r}")
        super().__init__(num_units, k, recoverable, **thresholds)
        self.k = k
        self.profile_steps = profile_steps
        self.refresh_every = refresh_every
        self.gap_window = profile_steps if gap_window is None else gap_window
        self._gaps: list[list[float]] = []  # the last `gap_window` measurements, oldest first
        self._measured: int | None = None  # the step the latest measurement is for
        self._selected: list[int] = []

    def wants_gap(self, step: int) -> bool:
        """Whether the gap should be measured at ``step`` (1-based): the profile and the refresh steps."""
        if step <= self.profile_steps:
            return True
        return self.refresh_every is not None and (step - self.profile_steps) % self.refresh_every == 0

    def observe_gap(self, gaps: Any) -> None:
        """Take the per-unit recovery gaps [U] (>= 0; NaN/Inf rank as the largest) of the step in progress."""
        values = _as_vector(gaps, self.num_units, "gaps")
        if any(v < 0 for v in values):
            raise ValueError("gaps must be >= 0 (relative gradient errors)")
        values = [v if math.isfinite(v) else math.inf for v in values]
        step = self._totals["steps"] + 1
        if self._measured == step:
            raise ValueError(f"the gap for step {step} was already observed")
        self._gaps = (self._gaps + [values])[-self.gap_window:]
        self._measured = step

    def _check_ready(self):
        step = self._totals["steps"] + 1
        if self.wants_gap(step) and self._measured != step:
            raise ValueError(f"gap_profile needs the measured gap at step {step}: call observe_gap() before step()")

    def profile(self) -> list[float]:
        """The per-unit mean gap over the current window (zeros before the first measurement)."""
        if not self._gaps:
            return [0.0] * self.num_units
        return [sum(col) / len(col) for col in zip(*self._gaps)]

    def _select(self, t, norms, stats):
        score = self.profile()
        if self._measured == t:
            self._selected = _top_k(score, self.budget, self.recoverable)
        return list(self._selected), score

    def _extra_state(self):
        return {"gaps": [[_json_float(v) for v in row] for row in self._gaps], "measured": self._measured,
                "selected": list(self._selected)}

    def _load_extra_state(self, state):
        self._gaps = [[float(v) for v in row] for row in state["gaps"]]
        self._measured = None if state["measured"] is None else int(state["measured"])
        self._selected = [int(b) for b in state["selected"]]


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


# ---------------------------------------------------------------------------------------------- factory


def make_policy(
    name: str,
    num_units: int,
    config: GNMRConfig,
    recoverable: Sequence[bool] | None = None,
    warmup_steps: int | None = None,
    fraction: float = 0.25,
    seed: int = 0,
    *,
    units: Sequence[int] | None = None,
    mean_active: float | None = None,
    profile_steps: int | None = None,
    refresh_every: int | None = None,
    gap_window: int | None = None,
    unit_bytes: Sequence[int] | None = None,
) -> TriggerPolicy:
    """Build a trigger policy by name under the budget and thresholds of a :class:`GNMRConfig`.

    Args:
        name (`str`): one of :data:`POLICIES` (see the module docstring).
        num_units (`int`): U.
        config (`GNMRConfig`): ``max_active`` is the common budget (the cap of ``"random_budget"``, the
            size ``"gap_profile"`` keeps, the bound on a ``"static_set"``); ``alpha`` / ``beta`` /
            ``window`` / ``*_init`` / ``init_steps`` define the baselines' GNMR statistics.
        recoverable (*optional*): per-unit flags (None: all).
        warmup_steps (`int`, *optional*): the ADAPT-style profiling length (required for ``"adapt"``).
        fraction (`float`, defaults to 0.25): share of units the ADAPT-style baseline fixes.
        seed (`int`, defaults to 0): the random policies' seed.
        units (*optional*): the unit indices of ``"static_set"`` (required for it).
        mean_active (`float`, *optional*): mean recovery units per step of ``"random_budget"`` (required).
        profile_steps (`int`, *optional*): the profile length of ``"gap_profile"`` (required).
        refresh_every (`int`, *optional*): ``"gap_profile"``'s refresh period (None: no refresh).
        gap_window (`int`, *optional*): measurements ``"gap_profile"`` averages (None: ``profile_steps``).
        unit_bytes (*optional*): each unit's recovery bytes, for ``"gnmr"`` (required there when
            ``config.max_active_bytes`` is set) and ``"static_set"`` (byte figures in its records); the
            other policies ignore them.
    """
    if not isinstance(config, GNMRConfig):
        raise TypeError(f"config must be a GNMRConfig, got {type(config).__name__}")
    common = {f: getattr(config, f) for f in _THRESHOLD_FIELDS}
    K = config.max_active
    if name == "gnmr":
        return GNMRController(num_units, config, recoverable=recoverable, unit_bytes=unit_bytes)
    if name == "adapt":
        if warmup_steps is None:
            raise ValueError("the 'adapt' policy needs warmup_steps")
        return StaticSensitivityPolicy(num_units, K, warmup_steps, fraction, recoverable, **common)
    if name == "gsnr":
        return GSNRPolicy(num_units, K, recoverable, **common)
    if name == "random":
        return RandomPolicy(num_units, K, recoverable, seed=seed, **common)
    if name == "random_budget":
        if mean_active is None:
            raise ValueError("the 'random_budget' policy needs mean_active (e.g. a GNMR run's summary()['mean_active'])")
        return RandomBudgetPolicy(num_units, mean_active, recoverable, max_active=K, seed=seed, **common)
    if name == "static_set":
        if units is None:
            raise ValueError("the 'static_set' policy needs units (the unit indices to keep on the recovery path)")
        return StaticSetPolicy(num_units, units, recoverable, max_active=K, unit_bytes=unit_bytes, **common)
    if name == "gap_profile":
        if profile_steps is None:
            raise ValueError("the 'gap_profile' policy needs profile_steps")
        return GapProfilePolicy(num_units, K, profile_steps, refresh_every, gap_window, recoverable, **common)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
