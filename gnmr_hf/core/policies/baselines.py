"""The baselines GNMR is compared with: the paper's ADAPT-style static profile and GSNR ranking
(Appendix E.4, E.5), the project's random draws (a full budget, or GNMR's mean budget on a schedule), and
the oracle-informed :class:`GapProfilePolicy` (the measured recovery gap)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from gnmr_hf.core.policies.base import (
    _as_vector,
    _BaselinePolicy,
    _json_float,
    _top_k,
)

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


