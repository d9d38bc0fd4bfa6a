"""The GNMR controller core: risk scores, budgeted top-``max_active`` selection and lock counters.

Pure PyTorch (no transformers, peft or bitsandbytes import). The rules are those of DESIGN.md
section 2; where the paper is vague, that section decides, and the few cases it leaves open are
settled in :class:`GNMRController`'s docstring.

Everything is vectorised over units: one tensor op per rule, no Python loop over units. The
statistics live on the CPU in float64; the norms arrive once per step as one small tensor, so
the only device synchronisation is that copy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = ["GNMRConfig", "GNMRController"]

_STATE_VERSION = 1


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; True as a step count is always a mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"GNMRConfig.{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"GNMRConfig.{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value: Any, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        extra = " (or None)" if allow_none else ""
        raise ValueError(f"GNMRConfig.{name} must be a finite number > 0{extra}, got {value!r}")
    return float(value)


@dataclass
class GNMRConfig:
    """Configuration of the GNMR controller.

    Args:
        max_active (`int`, defaults to 10):
            The paper's maxO: at most this many units run on the recovery path at one step (outside
            the ``full_recovery_steps`` warm-up). 0 means never recover (monitor only).
        lock_steps (`int`, defaults to 1):
            The paper's T_lock: a unit selected while risky stays in the candidate pool for this many
            further decisions. 0 disables locking.
        alpha (`float`, defaults to 1.1):
            The paper's alpha_t after the init phase: a unit is risky when GNMR >= alpha.
        alpha_init (`float` or `None`, defaults to 1.5):
            The GNMR threshold during the first ``init_steps`` steps; None means "same as ``alpha``".
        beta (`float`, defaults to 1.5):
            The paper's beta_t after the init phase: a unit is risky when Delta-GNMR >= beta.
        beta_init (`float` or `None`, defaults to `None`):
            The Delta-GNMR threshold during the first ``init_steps`` steps; None means "same as ``beta``".
        window (`int`, defaults to 5):
            The paper's delta: how many recent finite GNMR values Delta-GNMR divides by.
        init_steps (`int`, defaults to 0):
            Steps t <= init_steps use ``alpha_init`` / ``beta_init`` (the two-stage threshold).
        full_recovery_steps (`int`, defaults to 0):
            High-fidelity warm-up: the first ``full_recovery_steps`` steps run every recoverable unit on
            the recovery path regardless of ``max_active``; statistics and lock counters evolve as if
            there were no warm-up.
    """

    max_active: int = 10
    lock_steps: int = 1
    alpha: float = 1.1
    alpha_init: float | None = 1.5
    beta: float = 1.5
    beta_init: float | None = None
    window: int = 5
    init_steps: int = 0
    full_recovery_steps: int = 0

    def __post_init__(self) -> None:
        self.max_active = _check_int("max_active", self.max_active, 0)
        self.lock_steps = _check_int("lock_steps", self.lock_steps, 0)
        self.alpha = _check_positive("alpha", self.alpha)
        self.alpha_init = _check_positive("alpha_init", self.alpha_init, allow_none=True)
        self.beta = _check_positive("beta", self.beta)
        self.beta_init = _check_positive("beta_init", self.beta_init, allow_none=True)
        self.window = _check_int("window", self.window, 1)
        self.init_steps = _check_int("init_steps", self.init_steps, 0)
        self.full_recovery_steps = _check_int("full_recovery_steps", self.full_recovery_steps, 0)

    def thresholds(self, t: int) -> tuple[float, float]:
        """Return ``(alpha_t, beta_t)`` for step ``t`` (1-based)."""
        if t <= self.init_steps:
            alpha = self.alpha if self.alpha_init is None else self.alpha_init
            beta = self.beta if self.beta_init is None else self.beta_init
            return alpha, beta
        return self.alpha, self.beta

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-safe dict (ints, floats and None)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GNMRConfig:
        """Build a config from :meth:`to_dict` output; unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"GNMRConfig.from_dict: unknown field(s) {unknown}")
        return cls(**dict(data))


def init_steps_from_fraction(init_fraction: float, total_steps: int) -> int:
    """The ``init_steps`` for an initial-threshold phase of ``init_fraction`` of ``total_steps`` steps.

    The one place this conversion happens (callback, recipes, stress bench): the product rounded half
    up, and at least one step for a positive fraction, so "the first 2.5% of 100 steps" is 3 steps and
    2.5% of 20 steps is 1.

    Args:
        init_fraction (`float`): the fraction of training, in [0, 1].
        total_steps (`int`): the run's number of optimizer steps (``max_steps``), >= 0.
    """
    if isinstance(init_fraction, bool) or not isinstance(init_fraction, numbers.Real) or not 0 <= init_fraction <= 1:
        raise ValueError(f"init_fraction must be a number in [0, 1], got {init_fraction!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) or total_steps < 0:
        raise ValueError(f"total_steps must be an integer >= 0, got {total_steps!r}")
    if init_fraction == 0 or total_steps == 0:
        return 0
    return max(1, math.floor(init_fraction * total_steps + 0.5))


class GNMRController:
    """Budgeted, lock-stabilised selection of the riskiest units from their gradient norms.

    Call :meth:`step` once per optimizer step t = 1, 2, ... with the per-unit gradient norms n_t
    (pre-clip); it returns the units to run on the recovery path at step t + 1.

    The rules (DESIGN.md section 2), per unit b:

    * GNMR_t = n_t / mean(finite past n). With no finite past norm (always the case at t = 1, or
      when every earlier norm was non-finite) GNMR_t = 1: this gives GNMR_1 = 1 and treats a unit
      whose history is all NaN/Inf like a unit seen for the first time. A zero historical mean gives
      GNMR = 1 when n_t = 0, else +inf.
    * Delta_t = GNMR_t / mean(last min(window, k) finite GNMR values before t). With k = 0 (always
      at t = 1) Delta_t = 1, consistent with Delta_1 = 1. A zero window mean follows the GNMR rule:
      1 when GNMR_t = 0, else +inf. GNMR = +inf is not finite, so it never enters the window.
    * alpha_t, beta_t: the ``*_init`` values while t <= init_steps, else the main ones.
    * R_t = max(GNMR_t / alpha_t, Delta_t / beta_t); risky means R_t >= 1.
    * Non-finite n_t (NaN or Inf): R_t = +inf, n_t and GNMR_t stay out of both histories, and it is
      counted. Its GNMR and Delta are reported as NaN (undefined), so they never count as
      threshold exceedances; the ``nonfinite`` counts report such steps.
    * Candidates C_t = (risky or lock > 0) and recoverable. The selection is the top ``max_active``
      of C_t by R_t, ties to the lower index.
    * Locks: a unit selected and risky gets lock = ``lock_steps``; any other unit with lock > 0
      loses 1.

    Masks and the warm-up: :meth:`initial_mask` is the mask for step 1 (every recoverable unit if
    ``full_recovery_steps > 0``, else none). ``step`` at step t returns the mask for step t + 1: every
    recoverable unit if t + 1 <= ``full_recovery_steps``, else the budgeted selection. The selection
    and the locks are computed at every step, warm-up or not, so after the warm-up the controller is
    exactly where it would be without one. With ``full_recovery_steps = F`` the masks for steps 1..F
    are all-recoverable and step(F) returns the first budgeted mask (for step F + 1).

    Args:
        num_units (`int`):
            Number of monitored units U (every unit is monitored; the norms tensor has shape [U]).
        config (`GNMRConfig`, *optional*):
            Thresholds and budget; defaults to ``GNMRConfig()``.
        recoverable (*optional*):
            Which units have a recovery path: None (all), a bool mask of length U, or an iterable of
            unit indices. Monitored-only units get statistics but are never selected.

    Attributes:
        num_units (`int`): U.
        config (`GNMRConfig`): the configuration.
        t (`int`): number of steps taken.
        active (`torch.BoolTensor` [U]): the mask in effect for the next step (step t + 1).
        recoverable (`torch.BoolTensor` [U]): units with a recovery path.
        last_record (`dict` or `None`): the per-step record of the last step (see :attr:`last_record`).
        locks (`torch.LongTensor` [U]): the lock counters L_b (a copy).
    """

    def __init__(
        self,
        num_units: int,
        config: GNMRConfig | None = None,
        recoverable: torch.Tensor | Iterable[int] | Iterable[bool] | None = None,
    ) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, numbers.Integral) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        if config is None:
            config = GNMRConfig()
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"config must be a GNMRConfig, got {type(config).__name__}")
        self.num_units = int(num_units)
        self.config = config
        self.recoverable = self._recoverable_mask(recoverable)
        self._num_recoverable = int(self.recoverable.sum())
        alpha_init = config.alpha if config.alpha_init is None else config.alpha_init
        beta_init = config.beta if config.beta_init is None else config.beta_init
        values = {"zero": 0.0, "one": 1.0, "minus_one": -1.0, "inf": math.inf, "nan": math.nan,
                  "alpha": config.alpha, "beta": config.beta, "alpha_init": alpha_init, "beta_init": beta_init}
        self._const = {key: torch.tensor(v, dtype=torch.float64) for key, v in values.items()}
        self._reset_state()

    # ------------------------------------------------------------------ setup

    def _recoverable_mask(self, recoverable: Any) -> torch.Tensor:
        U = self.num_units
        if recoverable is None:
            return torch.ones(U, dtype=torch.bool)
        if isinstance(recoverable, torch.Tensor):
            values = recoverable.detach().cpu()
        else:
            values = list(recoverable)
            if values and all(isinstance(v, bool) for v in values):
                values = torch.tensor(values, dtype=torch.bool)
            else:
                if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
                    raise ValueError("recoverable must be a bool mask of length num_units or unit indices")
                values = torch.tensor(values, dtype=torch.long)
        if values.dtype == torch.bool:
            if values.shape != (U,):
                raise ValueError(f"recoverable mask must have shape ({U},), got {tuple(values.shape)}")
            return values.clone()
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dim() != 1:
            raise ValueError("recoverable must be a bool mask of length num_units or a 1-D tensor of indices")
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= U):
            raise ValueError(f"recoverable indices must lie in [0, {U}), got {values.tolist()}")
        mask = torch.zeros(U, dtype=torch.bool)
        mask[values.long()] = True
        return mask

    def _reset_state(self) -> None:
        U, W = self.num_units, self.config.window
        self.t = 0
        self.active = self.initial_mask()
        self._n_active = int(self.active.sum())
        # running sum / count of the finite norms: the historical mean needs nothing more
        self._norm_sum = torch.zeros(U, dtype=torch.float64)
        self._norm_count = torch.zeros(U, dtype=torch.long)
        # The last finite GNMR values per unit as W rows of shape [U], oldest first, zero-padded on
        # the old side. A Python list of rows makes the usual shift (every unit got a finite GNMR) a
        # list rotation with no tensor work, and keeps every op at [U] (no intra-op threading).
        # Units skip their non-finite steps independently; then only those keep their old column.
        # The window sum adds the rows oldest-first (the padding zeros add exactly).
        self._gnmr_window = [torch.zeros(U, dtype=torch.float64) for _ in range(W)]
        self._gnmr_count = torch.zeros(U, dtype=torch.long)  # finite GNMR values ever pushed
        self._locks = torch.zeros(U, dtype=torch.long)
        # run totals (Python ints)
        self._totals = dict.fromkeys(_TOTAL_KEYS, 0)
        self._record_tensors: tuple | None = None
        self._record_cache: dict[str, Any] | None = None

    def initial_mask(self) -> torch.Tensor:
        """The mask for step 1: every recoverable unit if ``full_recovery_steps > 0``, else none."""
        if self.config.full_recovery_steps > 0:
            return self.recoverable.clone()
        return torch.zeros(self.num_units, dtype=torch.bool)

    @property
    def locks(self) -> torch.Tensor:
        """Lock counters L_b ([U] int64, a copy)."""
        return self._locks.clone()

    # ------------------------------------------------------------------ the step

    def _as_norms(self, norms: Any) -> torch.Tensor:
        if not isinstance(norms, torch.Tensor):
            norms = torch.as_tensor(norms)
        if norms.dim() != 1 or norms.shape[0] != self.num_units:
            raise ValueError(
                f"norms must be a 1-D tensor of shape [num_units] = [{self.num_units}], got shape {tuple(norms.shape)}"
            )
        if norms.dtype.is_complex or norms.dtype == torch.bool:
            raise ValueError(f"norms must be real numbers, got dtype {norms.dtype}")
        # + 0.0 turns -0.0 into +0.0, so no signed zero reaches the histories (a window of -0.0
        # values would otherwise divide into -inf)
        return norms.detach().to(device="cpu", dtype=torch.float64) + self._const["zero"]

    def step(self, norms: torch.Tensor) -> torch.Tensor:
        """Take step t's per-unit gradient norms and return the mask for step t + 1.

        Args:
            norms (`torch.Tensor` [U]):
                L2 norm of each unit's gradient at this step, any real dtype and device. NaN/Inf
                are allowed (counted and treated as maximal risk); negative values are an error.

        Returns:
            `torch.BoolTensor` [U] on the CPU: the units on the recovery path at the next step.
        """
        n = self._as_norms(norms)
        cfg = self.config
        K = cfg.max_active
        t = self.t + 1
        alpha_t, beta_t = cfg.thresholds(t)
        c = self._const  # 0-dim float64 tensors: cheaper than wrapping Python scalars every op
        alpha, beta = (c["alpha_init"], c["beta_init"]) if t <= cfg.init_steps else (c["alpha"], c["beta"])
        # NaN compares False; -inf passes here but is caught by the negative check below
        nonfinite = ~(n < c["inf"])

        # GNMR = n / historical mean. Every case that must give 1 yields NaN here: no finite history
        # (0/0 mean) and 0/0 with an all-zero history; x/0 = +inf for x > 0 is already right.
        # Non-finite norms are overwritten with NaN afterwards.
        gnmr = n / (self._norm_sum / self._norm_count)
        gnmr.masked_fill_(gnmr != gnmr, c["one"]).masked_fill_(nonfinite, c["nan"])

        # Delta = GNMR / mean of the last min(window, k) finite GNMR values: same NaN trick for
        # k = 0 and 0/0. The rows are added oldest-first (the padding zeros add exactly), a fixed
        # rounding order that a plain sum over a unit's window list reproduces bit for bit.
        k = self._gnmr_count.clamp(max=cfg.window)
        rows = self._gnmr_window
        wsum = rows[0]
        for row in rows[1:]:  # over the window (W rows), not over units
            wsum = wsum + row
        delta = gnmr / (wsum / k)
        delta.masked_fill_(delta != delta, c["one"]).masked_fill_(nonfinite, c["nan"])

        risk = torch.maximum(gnmr / alpha, delta / beta).masked_fill_(nonfinite, c["inf"])
        risky = risk >= c["one"]
        cand = (risky | self._locks.bool()) & self.recoverable
        push = gnmr < c["inf"]  # GNMR >= 0 here; NaN and +inf stay out of the window
        # the counts, taken before any state changes so that a bad input leaves the controller
        # untouched; one count_nonzero per [U] mask (a stacked [6, U] sum costs no fewer ops and,
        # past torch's parallel grain, hands work to a thread pool that stalls on a busy machine)
        masks = (gnmr >= alpha, delta >= beta, nonfinite, cand, push, n < c["zero"])
        over_gnmr, over_delta, n_nonfinite, n_cand, n_push, n_negative = (
            torch.stack([m.count_nonzero() for m in masks]).tolist()
        )
        if n_negative:
            raise ValueError(f"norms must be >= 0 (they are L2 norms); got {n_negative} negative value(s)")

        # top max_active candidates by R, ties to the lower index
        if n_cand <= K:
            selected = cand
        elif K == 0:
            selected = torch.zeros_like(cand)
        else:
            # the K-th largest R is the cut: everything above it is in, and of the units tied at
            # it, the lowest indices fill the remaining places (cumsum counts ties in index order)
            key = risk.masked_fill(~cand, c["minus_one"])  # R >= 0, so non-candidates rank below all
            cut = key.topk(K).values[-1]
            above = key > cut
            tied = key == cut
            selected = above | (tied & (tied.cumsum(0) <= K - above.count_nonzero()))
        n_selected = min(n_cand, K)

        # locks, from the budgeted selection even during the warm-up
        locks = (self._locks - 1).clamp_(min=0)
        self._locks = locks.masked_fill_(selected & risky, cfg.lock_steps)

        # histories: only finite norms, only finite GNMR values
        self._norm_sum += n.masked_fill(nonfinite, c["zero"])
        self._norm_count += ~nonfinite
        shifted = rows[1:] + [gnmr]
        if n_push < self.num_units:  # rare: some unit had a non-finite norm or an infinite GNMR
            shifted = [torch.where(push, new_row, old_row) for new_row, old_row in zip(shifted, rows)]
        self._gnmr_window = shifted
        self._gnmr_count += push

        warmup = t + 1 <= cfg.full_recovery_steps
        new = self.recoverable.clone() if warmup else selected
        old = self.active
        n_new = self._num_recoverable if warmup else n_selected
        n_switch = int((new ^ old).count_nonzero())
        n_old = self._n_active
        # |new| - |old| = promotions - demotions and |new ^ old| = promotions + demotions
        n_prom = (n_switch + n_new - n_old) // 2
        n_dem = n_switch - n_prom
        hit_max = n_selected == K

        tot = self._totals
        tot["gnmr_exceed"] += over_gnmr
        tot["delta_exceed"] += over_delta
        tot["nonfinite"] += n_nonfinite
        tot["active_unit_steps"] += n_old  # `old` is the mask that was in effect during step t
        tot["promotions"] += n_prom
        tot["demotions"] += n_dem
        tot["hit_max_steps"] += int(hit_max)

        self.t = t
        self.active = new
        self._n_active = n_new
        # the record's lists are built on first access: step() stays cheap at U = 10,000
        self._record_tensors = (
            t, new, old, selected, gnmr, delta, risk, warmup, alpha_t, beta_t,
            over_gnmr, over_delta, n_cand, hit_max, n_nonfinite,
        )
        self._record_cache = None
        return new.clone()

    # ------------------------------------------------------------------ reporting

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The record of the last step, or None before the first step (and right after a load).

        Keys: ``step`` (t, the step whose norms were read), ``active`` (indices active at step t + 1),
        ``promoted`` / ``demoted`` (indices entering / leaving the recovery path between t and t + 1),
        ``selected`` (the budgeted top-``max_active`` set; equals ``active`` outside the warm-up),
        ``warmup`` (True when ``active`` is the full-recovery warm-up mask), ``over_gnmr`` /
        ``over_delta`` (units with GNMR >= alpha_t / Delta >= beta_t), ``candidates`` (|C_t|),
        ``hit_max`` (|selected| == max_active), ``nonfinite`` (units with non-finite norm),
        ``alpha_t``, ``beta_t``, and per-unit lists ``gnmr``, ``delta``, ``risk`` (floats; NaN
        for a non-finite norm's GNMR and Delta, +inf allowed; ``json.dumps`` writes them as
        NaN / Infinity).
        """
        if self._record_tensors is None:
            return None
        if self._record_cache is None:
            (t, new, old, selected, gnmr, delta, risk, warmup, alpha_t, beta_t,
             over_gnmr, over_delta, n_cand, hit_max, nonfinite) = self._record_tensors
            self._record_cache = {
                "step": t,
                "active": new.nonzero().flatten().tolist(),
                "promoted": (new & ~old).nonzero().flatten().tolist(),
                "demoted": (old & ~new).nonzero().flatten().tolist(),
                "selected": selected.nonzero().flatten().tolist(),
                "warmup": warmup,
                "over_gnmr": over_gnmr,
                "over_delta": over_delta,
                "candidates": n_cand,
                "hit_max": hit_max,
                "nonfinite": nonfinite,
                "alpha_t": alpha_t,
                "beta_t": beta_t,
                "gnmr": gnmr.tolist(),
                "delta": delta.tolist(),
                "risk": risk.tolist(),
            }
        return self._record_cache

    def summary(self) -> dict[str, Any]:
        """Run figures over the steps taken so far (all 0.0 before the first step).

        Keys: ``steps``; ``promotion_ratio`` = active unit-steps / recoverable unit-steps over the
        masks in effect during steps 1..t (the initial mask and the masks step() returned for steps
        2..t); ``hit_max_rate`` = decisions whose budgeted selection filled ``max_active`` / steps;
        ``gnmr_exceedance_rate`` / ``delta_exceedance_rate`` = monitored unit-steps (U * t) with
        GNMR >= alpha_t / Delta >= beta_t (the paper's Table 3); ``switches`` = promotions +
        demotions decided so far (path changes between consecutive masks, steps 1 -> 2 .. t -> t+1);
        ``promotions``, ``demotions``; ``nonfinite`` = unit-steps with a non-finite norm.
        """
        tot, t, U = self._totals, self.t, self.num_units
        rec_unit_steps = t * self._num_recoverable
        return {
            "steps": t,
            "promotion_ratio": tot["active_unit_steps"] / rec_unit_steps if rec_unit_steps else 0.0,
            "hit_max_rate": tot["hit_max_steps"] / t if t else 0.0,
            "gnmr_exceedance_rate": tot["gnmr_exceed"] / (U * t) if t else 0.0,
            "delta_exceedance_rate": tot["delta_exceed"] / (U * t) if t else 0.0,
            "switches": tot["promotions"] + tot["demotions"],
            "promotions": tot["promotions"],
            "demotions": tot["demotions"],
            "nonfinite": tot["nonfinite"],
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (plain ints, floats, bools, lists; no NaN/Inf) for exact resume.

        ``last_record`` is not part of it: it is a view of the last step, not needed to continue.
        """
        return {
            "version": _STATE_VERSION,
            "num_units": self.num_units,
            "config": self.config.to_dict(),
            "recoverable": self.recoverable.tolist(),
            "t": self.t,
            "active": self.active.tolist(),
            "locks": self._locks.tolist(),
            "norm_sum": self._norm_sum.tolist(),
            "norm_count": self._norm_count.tolist(),
            "gnmr_window": torch.stack(self._gnmr_window, dim=1).tolist(),  # [U][W], oldest first
            "gnmr_count": self._gnmr_count.tolist(),
            "totals": dict(self._totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly after a JSON round trip).

        The state must come from a controller with the same ``num_units``, config and recoverable
        units; otherwise ``ValueError`` says what differs (build a matching controller with
        :meth:`from_state_dict`).
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported GNMRController state version {state.get('version')!r}")
        if state["num_units"] != self.num_units:
            raise ValueError(
                f"state is for num_units={state['num_units']}, this controller has num_units={self.num_units}"
            )
        saved = GNMRConfig.from_dict(state["config"])
        if saved != self.config:
            diff = [
                f"{f.name}: saved {getattr(saved, f.name)!r} vs {getattr(self.config, f.name)!r}"
                for f in fields(GNMRConfig)
                if getattr(saved, f.name) != getattr(self.config, f.name)
            ]
            raise ValueError("state was saved with a different GNMRConfig (" + "; ".join(diff) + ")")
        if list(state["recoverable"]) != self.recoverable.tolist():
            raise ValueError("state was saved with a different set of recoverable units")
        U, W = self.num_units, self.config.window
        window = torch.tensor(state["gnmr_window"], dtype=torch.float64)
        if window.shape != (U, W):
            raise ValueError(f"state gnmr_window has shape {tuple(window.shape)}, expected ({U}, {W})")
        missing = set(_TOTAL_KEYS) - set(state["totals"])
        if missing:
            raise ValueError(f"state totals lack {sorted(missing)}")
        for name in ("active", "locks", "norm_sum", "norm_count", "gnmr_count"):
            if len(state[name]) != U:
                raise ValueError(f"state {name} has length {len(state[name])}, expected {U}")
        self.t = int(state["t"])
        self.active = torch.tensor(state["active"], dtype=torch.bool)
        self._n_active = int(self.active.sum())
        self._locks = torch.tensor(state["locks"], dtype=torch.long)
        self._norm_sum = torch.tensor(state["norm_sum"], dtype=torch.float64)
        self._norm_count = torch.tensor(state["norm_count"], dtype=torch.long)
        self._gnmr_window = [row.clone() for row in window.T]
        self._gnmr_count = torch.tensor(state["gnmr_count"], dtype=torch.long)
        self._totals = {key: int(state["totals"][key]) for key in _TOTAL_KEYS}
        self._record_tensors = None
        self._record_cache = None

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> GNMRController:
        """Build a controller with the saved num_units, config and recoverable units, then load the state."""
        ctrl = cls(
            state["num_units"],
            GNMRConfig.from_dict(state["config"]),
            recoverable=torch.tensor(state["recoverable"], dtype=torch.bool),
        )
        ctrl.load_state_dict(state)
        return ctrl

    def __repr__(self) -> str:
        return (
            f"GNMRController(num_units={self.num_units}, recoverable={int(self.recoverable.sum())}, "
            f"t={self.t}, active={self.active.nonzero().flatten().tolist()}, config={self.config})"
        )


_TOTAL_KEYS = (
    "gnmr_exceed",
    "delta_exceed",
    "nonfinite",
    "active_unit_steps",
    "promotions",
    "demotions",
    "hit_max_steps",
)
