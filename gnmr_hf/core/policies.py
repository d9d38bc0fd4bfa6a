"""Trigger policies: who goes on the recovery path next step, all under the same ``max_active`` budget.

Every policy has the controller's duck-typed interface, so :class:`gnmr_hf.GNMRCallback` (``policy=``)
and the stress recipe drive them through the same actuator:

- ``initial_mask() -> bool[U]``: the active set for step 1;
- ``step(norms[U]) -> bool[U]``: given step t's per-unit gradient norms (pre-clip, after accumulation),
  the active set for step t+1;
- ``state_dict()`` / ``load_state_dict(sd)`` (JSON-safe, exact resume), ``last_record`` (per-step
  record with the controller's keys) and ``summary()`` (promotion ratio, hit-maxO rate, switches, ...).

Policies (paper section 5.1 and Appendix E.4/E.5):

- ``"gnmr"``: GNMR + Delta-GNMR, i.e. :class:`gnmr_hf.core.controller.GNMRController` itself.
- ``"adapt"``: :class:`StaticSensitivityPolicy`, an ADAPT-style static baseline: profile each unit's
  GNMR during a BF16 warm-up of ``warmup_steps`` steps, then fix the top 25 % (capped by max_active)
  on the recovery path for the rest of the run.
- ``"gsnr"``: :class:`GSNRPolicy`, a gradient signal-to-noise ranking from the micro-batch gradients
  of each accumulation window; fills the budget every step with the lowest-GSNR units.
- ``"random"``: :class:`RandomPolicy`, a seeded random ranking that fills the budget every step.

The baselines also compute each unit's GNMR and Delta-GNMR (same definitions as the controller,
DESIGN.md section 2) so that their records and summaries report threshold exceedance alike; those
values do not influence their selections (except the static profile, which *is* mean GNMR).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

POLICIES = ("gnmr", "adapt", "gsnr", "random")


def _as_norms(norms: Any, num_units: int) -> list[float]:
    t = torch.as_tensor(norms, dtype=torch.float64).detach().cpu().reshape(-1)
    if t.numel() != num_units:
        raise ValueError(f"expected {num_units} norms, got {t.numel()}")
    return [float(v) for v in t]


def _recoverable_list(recoverable: Sequence[bool] | None, num_units: int) -> list[bool]:
    if recoverable is None:
        return [True] * num_units
    rec = [bool(r) for r in recoverable]
    if len(rec) != num_units:
        raise ValueError(f"recoverable has {len(rec)} entries for {num_units} units")
    return rec


class _GNMRMonitor:
    """Per-unit GNMR and Delta-GNMR exactly as DESIGN.md section 2 defines them (no selection)."""

    def __init__(self, num_units: int, window: int) -> None:
        self.window = window
        self.sums = [0.0] * num_units  # finite past norms
        self.counts = [0] * num_units
        self.recent: list[deque] = [deque(maxlen=window) for _ in range(num_units)]  # finite past GNMR

    def update(self, norms: list[float]) -> tuple[list[float], list[float], list[bool]]:
        gnmr, delta, nonfinite = [], [], []
        for b, n in enumerate(norms):
            if not math.isfinite(n):
                # undefined, as in the controller: NaN never counts as a threshold exceedance
                gnmr.append(math.nan)
                delta.append(math.nan)
                nonfinite.append(True)
                continue
            nonfinite.append(False)
            if self.counts[b] == 0:
                g = 1.0
            else:
                mean = self.sums[b] / self.counts[b]
                g = n / mean if mean > 0 else (1.0 if n == 0 else math.inf)
            if not self.recent[b]:
                d = 1.0
            else:
                m = sum(self.recent[b]) / len(self.recent[b])
                d = g / m if m > 0 else (1.0 if g == 0 else math.inf)
            self.sums[b] += n
            self.counts[b] += 1
            if math.isfinite(g):
                self.recent[b].append(g)
            gnmr.append(g)
            delta.append(d)
        return gnmr, delta, nonfinite

    def state_dict(self) -> dict:
        return {"sums": list(self.sums), "counts": list(self.counts), "recent": [list(r) for r in self.recent]}

    def load_state_dict(self, sd: dict) -> None:
        self.sums = [float(v) for v in sd["sums"]]
        self.counts = [int(v) for v in sd["counts"]]
        self.recent = [deque((float(v) for v in r), maxlen=self.window) for r in sd["recent"]]


def _json_float(v: float) -> float | str:
    # JSON has no inf/nan; keep them as strings so state_dict() survives json.dumps(allow_nan=False)
    return v if math.isfinite(v) else repr(v)


def _from_json_float(v: float | str) -> float:
    return float(v)


class _BudgetedPolicy:
    """Shared bookkeeping: budget, records, summary, monitor; subclasses implement ``_select``."""

    name = "base"
    needs_microbatch_norms = False

    def __init__(
        self,
        num_units: int,
        max_active: int,
        recoverable: Sequence[bool] | None = None,
        alpha: float = 1.1,
        beta: float = 1.5,
        window: int = 5,
        alpha_init: float | None = None,
        beta_init: float | None = None,
        init_steps: int = 0,
    ) -> None:
        if not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be a positive integer, got {num_units!r}")
        if not isinstance(max_active, int) or isinstance(max_active, bool) or max_active < 0:
            raise ValueError(f"max_active must be a non-negative integer, got {max_active!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        if not alpha > 0 or not beta > 0:
            raise ValueError("alpha and beta must be positive")
        self.num_units = num_units
        self.max_active = max_active
        self.recoverable = _recoverable_list(recoverable, num_units)
        self.alpha = float(alpha)
        self.beta = float(beta)
        # the controller's two-stage thresholds, for the exceedance statistics only
        self.alpha_init = self.alpha if alpha_init is None else float(alpha_init)
        self.beta_init = self.beta if beta_init is None else float(beta_init)
        self.init_steps = int(init_steps)
        self.window = window
        self._monitor = _GNMRMonitor(num_units, window)
        self._mask = [False] * num_units
        self.last_record: dict[str, Any] | None = None
        self._totals = {"steps": 0, "active": 0, "hit_max": 0, "promotions": 0, "demotions": 0,
                        "over_gnmr": 0, "over_delta": 0, "nonfinite": 0}

    @property
    def budget(self) -> int:
        """Units the policy may activate at once: ``min(max_active, recoverable units)``."""
        return min(self.max_active, sum(self.recoverable))

    def initial_mask(self) -> torch.Tensor:
        return torch.zeros(self.num_units, dtype=torch.bool)

    def _top(self, score: list[float], k: int, highest: bool) -> list[int]:
        """Indices of the k recoverable units with the highest (or lowest) score; ties: lower index."""
        cand = [b for b in range(self.num_units) if self.recoverable[b]]
        sign = -1.0 if highest else 1.0
        cand.sort(key=lambda b: (sign * score[b] if not math.isnan(score[b]) else -math.inf, b))
        return sorted(cand[:k])

    def _select(self, norms: list[float], gnmr: list[float]) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def step(self, norms: Any) -> torch.Tensor:
        values = _as_norms(norms, self.num_units)
        t = self._totals["steps"] + 1
        gnmr, delta, nonfinite = self._monitor.update(values)
        active, risk = self._select(values, gnmr)
        if len(active) > self.budget or any(not self.recoverable[b] for b in active):
            raise AssertionError(f"{self.name} selected {active} outside its budget")  # a bug, not user error
        new = [b in set(active) for b in range(self.num_units)]
        promoted = [b for b in range(self.num_units) if new[b] and not self._mask[b]]
        demoted = [b for b in range(self.num_units) if self._mask[b] and not new[b]]
        # every monitored unit counts, as in the controller's Table 3 figures
        alpha, beta = (self.alpha_init, self.beta_init) if t <= self.init_steps else (self.alpha, self.beta)
        over_g = sum(1 for g in gnmr if g >= alpha)
        over_d = sum(1 for d in delta if d >= beta)
        hit = len(active) == self.max_active
        tot = self._totals
        tot["steps"] = t
        tot["active"] += sum(self._mask)  # the mask in effect during step t
        tot["promotions"] += len(promoted)
        tot["demotions"] += len(demoted)
        self._mask = new
        tot["hit_max"] += int(hit)
        tot["over_gnmr"] += over_g
        tot["over_delta"] += over_d
        tot["nonfinite"] += sum(nonfinite)
        self.last_record = {
            "step": t,
            "active": list(active),
            "promoted": promoted,
            "demoted": demoted,
            "over_gnmr": over_g,
            "over_delta": over_d,
            "candidates": sum(self.recoverable),
            "hit_max": hit,
            "nonfinite": sum(nonfinite),
            "gnmr": gnmr,
            "delta": delta,
            "risk": risk,
        }
        return torch.tensor(new, dtype=torch.bool)

    def summary(self) -> dict[str, Any]:
        """Run figures with the controller's definitions (``GNMRController.summary``).

        ``promotion_ratio`` = active unit-steps / recoverable unit-steps over the masks in effect
        during steps 1..t; ``hit_max_rate`` = steps whose selection filled ``max_active`` / steps;
        ``gnmr_exceedance_rate`` / ``delta_exceedance_rate`` = unit-steps (U * t) with GNMR >= alpha /
        Delta >= beta; ``switches`` = promotions + demotions; ``nonfinite`` = non-finite unit-steps.
        """
        tot = self._totals
        steps = tot["steps"]
        rec_steps = steps * sum(self.recoverable)
        all_steps = steps * self.num_units
        return {
            "policy": self.name,
            "steps": steps,
            "promotion_ratio": tot["active"] / rec_steps if rec_steps else 0.0,
            "hit_max_rate": tot["hit_max"] / steps if steps else 0.0,
            "gnmr_exceedance_rate": tot["over_gnmr"] / all_steps if all_steps else 0.0,
            "delta_exceedance_rate": tot["over_delta"] / all_steps if all_steps else 0.0,
            "switches": tot["promotions"] + tot["demotions"],
            "promotions": tot["promotions"],
            "demotions": tot["demotions"],
            "nonfinite": tot["nonfinite"],
        }

    # -- state -------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, sd: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {
            "policy": self.name,
            "num_units": self.num_units,
            "mask": list(self._mask),
            "totals": dict(self._totals),
            "monitor": self._monitor.state_dict(),
            "last_record": _jsonable_record(self.last_record),
            **self._extra_state(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("policy") != self.name or sd.get("num_units") != self.num_units:
            raise ValueError(f"state is for policy {sd.get('policy')!r} with {sd.get('num_units')} units, "
                             f"not {self.name!r} with {self.num_units}")
        self._mask = [bool(v) for v in sd["mask"]]
        self._totals = {k: int(v) for k, v in sd["totals"].items()}
        self._monitor.load_state_dict(sd["monitor"])
        rec = sd.get("last_record")
        if rec is not None:
            rec = dict(rec)
            for key in ("gnmr", "delta", "risk"):
                rec[key] = [_from_json_float(v) for v in rec[key]]
        self.last_record = rec
        self._load_extra_state(sd)


def _jsonable_record(rec: dict | None) -> dict | None:
    if rec is None:
        return None
    out = dict(rec)
    for key in ("gnmr", "delta", "risk"):
        out[key] = [_json_float(v) for v in rec[key]]
    return out


class StaticSensitivityPolicy(_BudgetedPolicy):
    """ADAPT-style static baseline (paper Appendix E.4).

    During the first ``warmup_steps`` steps (which the recipe runs in BF16) it records each unit's
    GNMR; at the end of the warm-up it averages GNMR per unit, takes the top ``fraction`` of the
    recoverable units (at least one, at most ``max_active``) and keeps exactly that set on the
    recovery path for the rest of the run. It never changes after the warm-up.

    Args:
        num_units: U.
        max_active: the budget maxO.
        warmup_steps: W, the profiling steps (paper: 500).
        fraction: share of units fixed at high precision (paper: 0.25).
        recoverable: as for the controller.
        thresholds: ``alpha``, ``beta``, ``window``, ``alpha_init``, ``beta_init``, ``init_steps`` as
            in ``GNMRConfig``; they only feed the exceedance statistics.
    """

    name = "adapt"

    def __init__(self, num_units: int, max_active: int, warmup_steps: int, fraction: float = 0.25,
                 recoverable: Sequence[bool] | None = None, **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be a positive integer, got {warmup_steps!r}")
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

    def _select(self, norms, gnmr):
        t = self._totals["steps"] + 1
        if t <= self.warmup_steps:
            for b, g in enumerate(gnmr):
                if math.isfinite(g):
                    self._gnmr_sum[b] += g
                    self._gnmr_count[b] += 1
                else:  # a non-finite step is as risky as it gets; count it at the top
                    self._gnmr_sum[b] += 1e30
                    self._gnmr_count[b] += 1
        score = [s / c if c else 0.0 for s, c in zip(self._gnmr_sum, self._gnmr_count)]
        if t < self.warmup_steps:
            return [], score
        if self.fixed is None:
            k = min(self.budget, max(1, math.ceil(self.fraction * sum(self.recoverable))))
            self.fixed = self._top(score, k, highest=True)
        return list(self.fixed), score

    def _extra_state(self):
        return {"gnmr_sum": list(self._gnmr_sum), "gnmr_count": list(self._gnmr_count), "fixed": self.fixed}

    def _load_extra_state(self, sd):
        self._gnmr_sum = [float(v) for v in sd["gnmr_sum"]]
        self._gnmr_count = [int(v) for v in sd["gnmr_count"]]
        self.fixed = None if sd["fixed"] is None else [int(v) for v in sd["fixed"]]


class GSNRPolicy(_BudgetedPolicy):
    """GSNR-style ranking (paper Appendix E.5): the noisiest units by gradient signal-to-noise ratio.

    Over one accumulation window of K micro-batches with per-unit gradient contributions d_1..d_K
    (the callback reports ``||d_k||^2`` through :meth:`observe_microbatch`) and accumulated
    gradient G = sum_k d_k (whose norm ``step`` receives), the mean is G/K and the unbiased
    variance is (sum_k ||d_k||^2 - ||G||^2 / K) / (K - 1), so

        GSNR = (||G||^2 / K^2) / ((sum_k ||d_k||^2 - ||G||^2 / K) / (K - 1)).

    It is scale-free (the Trainer's 1/K loss scaling cancels). Every step the ``max_active`` units
    with the lowest GSNR go on the recovery path. Needs K >= 2 (gradient accumulation).
    """

    name = "gsnr"
    needs_microbatch_norms = True

    def __init__(self, num_units: int, max_active: int, recoverable: Sequence[bool] | None = None,
                 **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        self._sq_sum = [0.0] * num_units
        self._micro = 0

    def observe_microbatch(self, sq_norms: Any) -> None:
        """Add one micro-batch's per-unit squared gradient-contribution norms ``[U]``."""
        values = _as_norms(sq_norms, self.num_units)
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

    def _select(self, norms, gnmr):
        k = self._micro
        if k < 2:
            raise ValueError(
                f"GSNR needs the micro-batch gradients of an accumulation window (>= 2 micro-batches), got {k}; "
                "use gradient_accumulation_steps >= 2"
            )
        score = [self.gsnr(n, s, k) for n, s in zip(norms, self._sq_sum)]
        self._sq_sum = [0.0] * self.num_units
        self._micro = 0
        return self._top(score, self.budget, highest=False), score

    def _extra_state(self):
        return {"sq_sum": list(self._sq_sum), "micro": self._micro}

    def _load_extra_state(self, sd):
        self._sq_sum = [float(v) for v in sd["sq_sum"]]
        self._micro = int(sd["micro"])


class RandomPolicy(_BudgetedPolicy):
    """Seeded random ranking: ``max_active`` recoverable units drawn uniformly every step."""

    name = "random"

    def __init__(self, num_units: int, max_active: int, recoverable: Sequence[bool] | None = None,
                 seed: int = 0, **thresholds: Any) -> None:
        super().__init__(num_units, max_active, recoverable, **thresholds)
        self.seed = int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)

    def _select(self, norms, gnmr):
        score = torch.rand(self.num_units, generator=self._gen, dtype=torch.float64).tolist()
        return self._top(score, self.budget, highest=True), score

    def _extra_state(self):
        return {"seed": self.seed, "generator": self._gen.get_state().tolist()}

    def _load_extra_state(self, sd):
        self.seed = int(sd["seed"])
        self._gen.set_state(torch.tensor(sd["generator"], dtype=torch.uint8))


def make_policy(name: str, num_units: int, config: Any, recoverable: Sequence[bool] | None = None,
                warmup_steps: int | None = None, fraction: float = 0.25, seed: int = 0) -> Any:
    """Build a trigger policy by name under the budget and thresholds of a :class:`GNMRConfig`.

    Args:
        name: one of ``"gnmr"``, ``"adapt"``, ``"gsnr"``, ``"random"``.
        num_units: U.
        config: a ``GNMRConfig``; ``max_active`` is the common budget, ``alpha``/``beta``/``window``
            define the exceedance statistics of the baselines.
        recoverable: per-unit flags (None: all).
        warmup_steps: the ADAPT-style profiling length (required for ``"adapt"``).
        fraction: share of units the ADAPT-style baseline fixes at high precision.
        seed: the random policy's seed.
    """
    common = {"alpha": config.alpha, "beta": config.beta, "window": config.window, "alpha_init": config.alpha_init,
              "beta_init": config.beta_init, "init_steps": config.init_steps}
    if name == "gnmr":
        from gnmr_hf.core.controller import GNMRController

        return GNMRController(num_units, config, recoverable=recoverable)
    if name == "adapt":
        if warmup_steps is None:
            raise ValueError("the 'adapt' policy needs warmup_steps")
        return StaticSensitivityPolicy(num_units, config.max_active, warmup_steps, fraction, recoverable, **common)
    if name == "gsnr":
        return GSNRPolicy(num_units, config.max_active, recoverable, **common)
    if name == "random":
        return RandomPolicy(num_units, config.max_active, recoverable, seed=seed, **common)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
