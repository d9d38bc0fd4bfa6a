"""The GNMR controller core: risk scores, budgeted top-``max_active`` selection (optionally under a byte
budget too) and lock counters.

Pure: torch and NumPy only (no transformers, peft or bitsandbytes import). The rules are those
of docs/design.md; where the paper is vague, that document decides, and the few cases it leaves
open are settled in :class:`GNMRController`'s docstring.

Everything is vectorised over units: one array op per rule, no Python loop over units. The
statistics live on the CPU as NumPy float64 arrays (at tens of units a step is a few dozen tiny
ops, where NumPy's per-op cost is a fraction of torch's); tensors come in and go out, the norms
once per step as one small tensor, so the only device synchronisation is that copy.
"""


from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from gnmr_hf.core.config import (  # noqa: F401 (the names this module has always had)
    GNMRConfig,
    _check_int,
    _check_int_or_none,
    _check_positive,
    _check_unit_bytes,
    init_steps_from_fraction,
    unit_mask,
)
from gnmr_hf.core.selection import _TOP_K_SORT_MAX, _risk, _top_k, _top_k_bytes  # noqa: F401
from gnmr_hf.core.state import _BYTE_TOTAL_KEYS, _STATE_VERSION, _TOTAL_KEYS, controller_state, restore_state  # noqa: F401

__all__ = ["GNMRConfig", "GNMRController", "init_steps_from_fraction", "unit_mask"]

# dtypes NumPy holds natively: their tensors convert without a torch-side cast
_NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)
_ZERO = np.zeros(())  # a float64 0-d array: NumPy adds it faster than the Python float 0.0


class GNMRController:
    """Budgeted, lock-stabilised selection of the riskiest units from their gradient norms.

    Call :meth:`step` once per optimizer step t = 1, 2, ... with the per-unit gradient norms n_t
    (pre-clip); it returns the units to run on the recovery path at step t + 1.

    The rules (docs/design.md), per unit b:

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
    * With a byte budget B (``config.max_active_bytes``): walk C_t in that same rank order, skip a
      unit whose ``unit_bytes`` would take the running total over B, and stop at ``max_active``
      units. A greedy walk, not the best packing: the rank decides, the bytes only veto. With
      ``max_active_bytes = None`` the selection is the count-only one above, unit for unit.
    * Locks: a unit selected and risky gets lock = ``lock_steps``; any other unit with lock > 0
      loses 1. A candidate skipped for its bytes is not selected, so its lock decays.

    Masks and the warm-up: :meth:`initial_mask` is the mask for step 1 (every recoverable unit if
    ``full_recovery_steps > 0``, else none). ``step`` at step t returns the mask for step t + 1: every
    recoverable unit if t + 1 <= ``full_recovery_steps``, else the budgeted selection. The selection
    and the locks are computed at every step, warm-up or not, so after the warm-up the controller is
    exactly where it would be without one. With ``full_recovery_steps = F`` the masks for steps 1..F
    are all-recoverable and step(F) returns the first budgeted mask (for step F + 1). The warm-up
    ignores the byte budget as it ignores ``max_active`` (the paper's high-fidelity warm-up): its masks
    may hold more than ``max_active_bytes``.

    Args:
        num_units (`int`):
            Number of monitored units U (every unit is monitored; the norms tensor has shape [U]).
        config (`GNMRConfig`, *optional*):
            Thresholds and budget; defaults to ``GNMRConfig()``.
        recoverable (*optional*):
            Which units have a recovery path: None (all), a bool mask of length U, or an iterable of
            unit indices. Monitored-only units get statistics but are never selected.
        unit_bytes (*optional*):
            Each unit's recovery bytes: a sequence (or 1-D integer tensor) of U integers >= 0, e.g. the
            device bytes its recovery weights take. Required when ``config.max_active_bytes`` is set;
            without a byte budget it only adds the byte figures to the records and the summary.

    Attributes:
        num_units (`int`): U.
        config (`GNMRConfig`): the configuration.
        t (`int`): number of steps taken.
        active (`torch.BoolTensor` [U]): the mask in effect for the next step (step t + 1).
        recoverable (`torch.BoolTensor` [U]): units with a recovery path.
        unit_bytes (`tuple[int, ...]` or `None`): each unit's recovery bytes, as given.
        last_record (`dict` or `None`): the per-step record of the last step (see :attr:`last_record`).
        locks (`torch.LongTensor` [U]): the lock counters L_b (a copy).
    """

    def __init__(
        self,
        num_units: int,
        config: GNMRConfig | None = None,
        recoverable: torch.Tensor | Iterable[int] | Iterable[bool] | None = None,
        unit_bytes: torch.Tensor | Iterable[int] | None = None,
    ) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, numbers.Integral) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        if config is None:
            config = GNMRConfig()
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"config must be a GNMRConfig, got {type(config).__name__}")
        self.num_units = int(num_units)
        self.config = config
        self.recoverable = (
            torch.ones(self.num_units, dtype=torch.bool) if recoverable is None else unit_mask(recoverable, num_units)
        )
        self._recoverable = self.recoverable.numpy().copy()
        self._num_recoverable = int(self._recoverable.sum())
        self.unit_bytes = None if unit_bytes is None else _check_unit_bytes(unit_bytes, self.num_units)
        if config.max_active_bytes is not None and self.unit_bytes is None:
            raise ValueError(
                f"GNMRConfig.max_active_bytes={config.max_active_bytes} needs unit_bytes "
                "(each unit's recovery bytes): pass GNMRController(..., unit_bytes=...)"
            )
        self._bytes = None if self.unit_bytes is None else np.array(self.unit_bytes, dtype=np.int64)
        self._budget_bytes = config.max_active_bytes
        # (alpha_t, beta_t) during and after the init phase, as floats (the record's values) and as
        # 0-d arrays (NumPy compares an array with a 0-d array faster than with a Python float);
        # t = 0 is always in the init phase. The config is read here once: step() uses these.
        self._thresholds = tuple(
            (a, b, np.array(a), np.array(b)) for a, b in (config.thresholds(0), config.thresholds(config.init_steps + 1))
        )
        self._window_size = np.array(float(config.window))  # the window mean's divisor once the window is full
        self._init_steps = config.init_steps
        self._max_active = config.max_active
        self._lock_steps = config.lock_steps
        self._full_recovery_steps = config.full_recovery_steps
        self._reset_state()

    # ------------------------------------------------------------------ setup

    def _reset_state(self) -> None:
        U, W = self.num_units, self.config.window
        self.t = 0
        self._active = self.initial_mask().numpy()
        self._n_active = int(self._active.sum())
        self._active_bytes = self._bytes_of(self._active)
        # running sum / count of the finite norms: the historical mean needs nothing more
        self._norm_sum = np.zeros(U, dtype=np.float64)
        self._norm_count = np.zeros(U, dtype=np.float64)
        # The last finite GNMR values per unit as W rows of shape [U], oldest first, zero-padded on
        # the old side. A Python list of rows makes the usual shift (every unit got a finite GNMR) a
        # list rotation with no array work. Units skip their non-finite steps independently; then
        # only those keep their old column. The window sum adds the rows oldest-first (the padding
        # zeros add exactly), the order a plain sum over one unit's window list uses.
        self._gnmr_window = [np.zeros(U, dtype=np.float64) for _ in range(W)]
        self._gnmr_count = np.zeros(U, dtype=np.int64)  # finite GNMR values ever pushed
        # The lock counters, and which are non-zero. With lock_steps = 1 a counter is 1 exactly while
        # its unit is locked, so only the mask is kept (_locks is None; _lock_counters() derives them).
        self._locks = None if self.config.lock_steps == 1 else np.zeros(U, dtype=np.int64)
        self._locked = np.zeros(U, dtype=bool)
        self._refresh_flags()
        # run totals (Python ints)
        self._totals = dict.fromkeys(_TOTAL_KEYS, 0)
        # byte figures, kept apart so that a controller without unit_bytes writes the same state as before
        self._byte_totals = dict.fromkeys(_BYTE_TOTAL_KEYS, 0)
        self._record_arrays: tuple | None = None
        self._record_cache: dict[str, Any] | None = None

    def _refresh_flags(self) -> None:
        # Facts about the state that let step() skip work. The first two are monotone (sums and
        # counts only grow), so once true they stay true and cost nothing more to maintain.
        # every unit has a positive historical mean: GNMR needs no "no history" / 0/0 fix-up
        self._history_positive = bool(np.all(self._norm_sum > 0.0))
        # every unit has a full window: the window mean divides by the constant `window`
        self._window_full = bool(np.all(self._gnmr_count >= self.config.window))
        # how many lock counters are non-zero: with none, a candidate is just a risky recoverable unit
        self._n_locked = int(np.count_nonzero(self._locked))

    def _bytes_of(self, mask: np.ndarray) -> int | None:
        """The recovery bytes of the units in ``mask`` (None without ``unit_bytes``)."""
        if self._bytes is None:
            return None
        return int(self._bytes[mask].sum())

    def _lock_counters(self) -> np.ndarray:
        """The lock counters L_b as an int64 array [U] (do not modify)."""
        if self._locks is None:  # lock_steps == 1
            return self._locked.astype(np.int64)
        return self._locks

    def initial_mask(self) -> torch.Tensor:
        """The mask for step 1: every recoverable unit if ``full_recovery_steps > 0``, else none."""
        if self.config.full_recovery_steps > 0:
            return self.recoverable.clone()
        return torch.zeros(self.num_units, dtype=torch.bool)

    @property
    def active(self) -> torch.Tensor:
        """The mask in effect for the next step (step t + 1), [U] bool (a copy)."""
        return torch.from_numpy(self._active.copy())

    @property
    def locks(self) -> torch.Tensor:
        """Lock counters L_b ([U] int64, a copy)."""
        return torch.from_numpy(self._lock_counters().copy())

    # ------------------------------------------------------------------ the step

    def _as_norms(self, norms: Any) -> np.ndarray:
        if not isinstance(norms, torch.Tensor):
            norms = torch.as_tensor(norms)
        if norms.ndim != 1 or norms.shape[0] != self.num_units:
            raise ValueError(
                f"norms must be a 1-D tensor of shape [num_units] = [{self.num_units}], got shape {tuple(norms.shape)}"
            )
        dtype = norms.dtype
        if dtype not in _NUMPY_FLOATS:
            if dtype.is_complex or dtype == torch.bool:
                raise ValueError(f"norms must be real numbers, got dtype {dtype}")
            norms = norms.to(torch.float64)  # bfloat16 and integer dtypes: NumPy cannot take them as they are
        if norms.requires_grad:
            norms = norms.detach()
        if not norms.is_cpu:
            norms = norms.cpu()
        # + 0.0 turns -0.0 into +0.0 (so no signed zero reaches the histories: a window of -0.0
        # values would otherwise divide into -inf) and gives the step its own float64 copy
        return np.add(norms.numpy(), _ZERO, dtype=np.float64)

    def step(self, norms: torch.Tensor) -> torch.Tensor:
        """Take step t's per-unit gradient norms and return the mask for step t + 1.

        Args:
            norms (`torch.Tensor` [U]):
                L2 norm of each unit's gradient at this step, any real dtype and device. NaN/Inf
                are allowed (counted and treated as maximal risk); negative values are an error.

        Returns:
            `torch.BoolTensor` [U] on the CPU: the units on the recovery path at the next step.
        """
        # The arithmetic runs in NumPy float64 on the CPU: at the usual U (tens of layers) a step is
        # a few dozen tiny array ops, NumPy's per-op cost is a fraction of torch's, and the usual
        # step (finite norms, warmed-up histories) skips the fix-ups it cannot need. At that size the
        # cost is the number of array ops, so the step makes as few as it can: the risk R is only
        # computed when the top-K cut needs it (or the record is read), the risky test compares GNMR
        # and Delta with the thresholds directly, and the lock mask is kept next to the counters.
        n = self._as_norms(norms)
        t = self.t + 1
        alpha, beta, alpha_a, beta_a = self._thresholds[t > self._init_steps]
        rows = self._gnmr_window
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            gnmr, delta, nonfinite, n_nonfinite, push_all = self._gnmr_delta(n, rows)
            # Risky means R = max(GNMR / alpha, Delta / beta) >= 1, that is GNMR >= alpha or
            # Delta >= beta: for x >= 0 (+inf included) and a finite y > 0 the rounded quotient
            # x / y is >= 1 exactly when x >= y (rounding is monotone, y / y = 1, and for x < y the
            # exact x / y is at most 1 - 2**-53, a double). A non-finite norm's NaN GNMR and Delta
            # compare False (so they count as no exceedance) and its R = +inf makes it risky.
            over_g = gnmr >= alpha_a
            over_d = delta >= beta_a
            over_gnmr = int(np.count_nonzero(over_g))
            over_delta = int(np.count_nonzero(over_d))
            # A lock is only ever set on a selected (so recoverable) unit: with no risky unit and no
            # lock there is no candidate, and the quiet step is done here.
            if not (over_gnmr or over_delta or n_nonfinite or self._n_locked):
                risky = selected = over_g  # all False
                n_cand, risk, hit_bytes = 0, None, False
            else:
                risky, selected, n_cand, risk, hit_bytes = self._select(
                    gnmr, delta, over_g | over_d, nonfinite, n_nonfinite, alpha, beta)
        K = self._max_active
        n_selected = min(n_cand, K) if self._budget_bytes is None else int(np.count_nonzero(selected))
        self._update_locks(risky, selected, n_cand, n_selected)
        self._push_histories(n, gnmr, rows, nonfinite, n_nonfinite, push_all)

        warmup = t < self._full_recovery_steps  # the mask is for step t + 1 <= full_recovery_steps
        new = self._recoverable if warmup else selected
        old = self._active
        n_new = self._num_recoverable if warmup else n_selected
        # the budget bound: the count cap filled, or (with a byte budget) the bytes vetoed a candidate
        hit_max = n_selected == K or hit_bytes
        new_bytes = self._count(new, old, n_new, warmup or n_selected, over_gnmr, over_delta, n_nonfinite,
                                hit_max, hit_bytes)
        self.t = t
        self._active = new
        self._n_active = n_new
        self._active_bytes = new_bytes
        # the record (and R, unless the cut needed it) is built on first access: step() stays cheap
        self._record_arrays = (
            t, new, old, selected, gnmr, delta, risk, nonfinite, warmup, alpha, beta,
            over_gnmr, over_delta, n_cand, hit_max, n_nonfinite, new_bytes, hit_bytes,
        )
        self._record_cache = None
        return torch.from_numpy(new.copy())

    def _gnmr_delta(self, n: np.ndarray, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                           int, bool]:
        """Step t's GNMR and Delta [U] (call under ``np.errstate`` with divide, invalid and over ignored), the
        non-finite norm mask (None when there is none), their count, and whether every GNMR enters the window."""
        # GNMR = n / historical mean. Every case that must give 1 yields NaN here: no finite
        # history (0/0 mean) and 0/0 with an all-zero history; x/0 = +inf for x > 0 is already
        # right. With a positive mean everywhere, a NaN or infinite GNMR can only come from a
        # NaN or infinite norm (or an overflow) and a GNMR <= 0 (-0.0 included) from a norm
        # <= 0 (or an underflow), so two reductions clear the usual step: every GNMR finite and
        # positive. Anything else (negative norms included) goes through _fix_gnmr, before any
        # state changes, so that a bad input leaves the controller untouched.
        gnmr = n / (self._norm_sum / self._norm_count)
        usual = (
            self._history_positive
            and np.maximum.reduce(gnmr) < math.inf  # a NaN norm makes the maximum NaN
            and np.minimum.reduce(gnmr) > 0.0
        )
        if usual:
            nonfinite, n_nonfinite, push_all = None, 0, True
        else:
            nonfinite, n_nonfinite, push_all = self._fix_gnmr(n, gnmr)

        # Delta = GNMR / mean of the last min(window, k) finite GNMR values: same NaN trick for
        # k = 0 and 0/0, rows added oldest-first (a fixed rounding order, see _reset_state).
        wsum = rows[0]
        for row in rows[1:]:  # over the window (W rows), not over units
            wsum = wsum + row
        k = self._window_size if self._window_full else np.minimum(self._gnmr_count, self.config.window)
        delta = gnmr / (wsum / k)
        # with k > 0 a NaN needs 0 / 0 (a finite GNMR over a finite window mean): never in the
        # usual step, whose GNMR values are all positive
        if not (usual and self._window_full):
            delta[np.isnan(delta)] = 1.0
        if n_nonfinite:
            delta[nonfinite] = math.nan
        return gnmr, delta, nonfinite, n_nonfinite, push_all

    def _select(self, gnmr: np.ndarray, delta: np.ndarray, risky: np.ndarray, nonfinite: np.ndarray | None,
                n_nonfinite: int, alpha: float, beta: float) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None,
                                                                      bool]:
        """The budgeted selection from the units over a threshold (``risky``, a new array: updated in place):
        ``(risky, selected, |C_t|, R or None when the cut did not need it, whether the bytes vetoed a candidate)``.
        Call it under ``np.errstate(over="ignore")``."""
        U, K = self.num_units, self._max_active
        budget = self._budget_bytes
        hit_bytes = False  # the byte budget vetoed a candidate before the count cap filled
        risk = None
        if n_nonfinite:
            risky |= nonfinite
        cand = risky | self._locked if self._n_locked else risky
        if self._num_recoverable < U:
            cand = cand & self._recoverable
        n_cand = int(np.count_nonzero(cand))
        # top max_active candidates by R, ties to the lower index
        if budget is not None and n_cand and K:
            if n_cand <= K and int(self._bytes[cand].sum()) <= budget:
                selected = cand  # every candidate fits, in count and in bytes
            else:
                risk = _risk(gnmr, delta, alpha, beta, nonfinite)
                selected, hit_bytes = _top_k_bytes(cand, risk, K, self.unit_bytes, budget)
        elif n_cand <= K:
            selected = cand
        elif K == 0:
            selected = np.zeros(U, dtype=bool)
        else:
            risk = _risk(gnmr, delta, alpha, beta, nonfinite)
            selected = _top_k(cand, risk, K)
        return risky, selected, n_cand, risk, hit_bytes

    def _update_locks(self, risky: np.ndarray, selected: np.ndarray, n_cand: int, n_selected: int) -> None:
        """The lock counters, from the budgeted selection even during the warm-up. Every locked unit is a
        candidate, so with no candidate there is no lock to set or decay."""
        lock_steps = self._lock_steps
        if not (lock_steps and n_cand):
            return
        U = self.num_units
        # selected & risky; when every candidate is selected and every unit recoverable, that is
        # (risky | locked) & risky = risky
        locked_now = risky if n_selected == n_cand and self._num_recoverable == U else selected & risky
        if self._locks is None:  # lock_steps == 1: every other lock decays to 0
            locked = locked_now
        else:
            locks = np.maximum(self._locks - 1, 0) if self._n_locked else np.zeros(U, dtype=np.int64)
            locks[locked_now] = lock_steps
            self._locks = locks
            locked = locks > 0
        self._locked = locked
        self._n_locked = int(np.count_nonzero(locked))

    def _push_histories(self, n: np.ndarray, gnmr: np.ndarray, rows: list[np.ndarray], nonfinite: np.ndarray | None,
                        n_nonfinite: int, push_all: bool) -> None:
        """The histories: only finite norms, only finite GNMR values (the counts are float64, so the mean needs
        no int-to-float conversion)."""
        if n_nonfinite:
            self._norm_sum += np.where(nonfinite, 0.0, n)
            self._norm_count += ~nonfinite
        else:
            self._norm_sum += n
            self._norm_count += 1.0
        if not self._history_positive:
            self._history_positive = bool(np.all(self._norm_sum > 0.0))
        if push_all:
            self._gnmr_window = rows[1:] + [gnmr]
            self._gnmr_count += 1
        else:  # rare: some unit had a non-finite norm or an infinite GNMR (GNMR >= 0 or NaN here)
            push = gnmr < math.inf
            self._gnmr_window = [np.where(push, new_row, old_row) for new_row, old_row in zip(rows[1:] + [gnmr], rows)]
            self._gnmr_count += push
        if not self._window_full:
            self._window_full = bool(np.minimum.reduce(self._gnmr_count) >= self.config.window)

    def _count(self, new: np.ndarray, old: np.ndarray, n_new: int, changed: Any, over_gnmr: int, over_delta: int,
               n_nonfinite: int, hit_max: bool, hit_bytes: bool) -> int | None:
        """Add step t to the run totals (``old``: the mask in effect during step t, ``new``: the next one;
        ``changed`` false: the new mask is empty and not the warm-up's); returns ``new``'s recovery bytes."""
        # an empty new mask switches exactly the units of the old one
        n_switch = int(np.count_nonzero(new ^ old)) if changed else self._n_active
        n_old = self._n_active
        # |new| - |old| = promotions - demotions and |new ^ old| = promotions + demotions
        n_prom = (n_switch + n_new - n_old) // 2
        tot = self._totals
        tot["gnmr_exceed"] += over_gnmr
        tot["delta_exceed"] += over_delta
        tot["nonfinite"] += n_nonfinite
        tot["active_unit_steps"] += n_old  # `old` is the mask that was in effect during step t
        tot["promotions"] += n_prom
        tot["demotions"] += n_switch - n_prom
        tot["hit_max_steps"] += hit_max
        if self._bytes is None:
            return None
        bt = self._byte_totals
        bt["active_bytes"] += self._active_bytes  # the mask in effect during step t, as above
        bt["peak_active_bytes"] = max(bt["peak_active_bytes"], self._active_bytes)
        bt["hit_bytes_steps"] += hit_bytes
        return self._bytes_of(new)

    def _fix_gnmr(self, n: np.ndarray, gnmr: np.ndarray) -> tuple[np.ndarray | None, int, bool]:
        """The general case of the GNMR (in place): no finite history, zero means or norms, non-finite norms.

        Returns the non-finite norm mask (None when there is none), their count, and whether every
        GNMR is finite (so every unit pushes it into its window). Raises on a negative norm.
        """
        # one reduction tells whether every norm is finite (NaN and +-inf make the sum non-finite;
        # so can an overflow, which only costs the mask below)
        all_finite = math.isfinite(np.add.reduce(n))
        if all_finite:
            nonfinite, n_nonfinite = None, 0
        else:
            nonfinite = ~(n < math.inf)  # NaN compares False; -inf is caught just below
            n_nonfinite = int(np.count_nonzero(nonfinite))
        # fmin skips NaN, so one reduction finds any negative value (-inf included)
        if np.fmin.reduce(n) < 0.0:
            self._raise_negative(n)
        # a NaN from a finite norm is 0/0 or x/NaN: no finite history, an all-zero history, or a
        # positive history sum whose mean underflows to 0 (a subnormal sum over a growing count)
        gnmr[np.isnan(gnmr)] = 1.0
        if n_nonfinite:
            gnmr[nonfinite] = math.nan
        # GNMR >= 0 here; NaN and +inf stay out of the window (the maximum propagates a NaN)
        return nonfinite, n_nonfinite, all_finite and np.maximum.reduce(gnmr) < math.inf

    @staticmethod
    def _raise_negative(n: np.ndarray) -> None:
        n_negative = int(np.count_nonzero(n < 0.0))
        raise ValueError(f"norms must be >= 0 (they are L2 norms); got {n_negative} negative value(s)")

    # ------------------------------------------------------------------ reporting

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The record of the last step, or None before the first step (and right after a load).

        Keys: ``step`` (t, the step whose norms were read), ``active`` (indices active at step t + 1),
        ``promoted`` / ``demoted`` (indices entering / leaving the recovery path between t and t + 1),
        ``selected`` (the budgeted top-``max_active`` set; equals ``active`` outside the warm-up),
        ``warmup`` (True when ``active`` is the full-recovery warm-up mask), ``over_gnmr`` /
        ``over_delta`` (units with GNMR >= alpha_t / Delta >= beta_t), ``candidates`` (|C_t|),
        ``hit_max`` (the budget bound: |selected| == max_active, or with a byte budget also
        ``hit_bytes``), ``hit_bytes`` (the byte budget skipped at least one candidate before
        ``max_active`` units were taken; always False without one), ``active_bytes`` (the recovery
        bytes of ``active``, which in the warm-up may exceed the budget; None without ``unit_bytes``),
        ``budget_bytes`` (``max_active_bytes``, None without a byte budget), ``nonfinite`` (units
        with non-finite norm),
        ``alpha_t``, ``beta_t``, and per-unit lists ``gnmr``, ``delta``, ``risk`` (floats; NaN
        for a non-finite norm's GNMR and Delta, +inf allowed; ``json.dumps`` writes them as
        NaN / Infinity).
        """
        if self._record_arrays is None:
            return None
        if self._record_cache is None:
            (t, new, old, selected, gnmr, delta, risk, nonfinite_mask, warmup, alpha_t, beta_t,
             over_gnmr, over_delta, n_cand, hit_max, nonfinite, active_bytes, hit_bytes) = self._record_arrays
            if risk is None:
                with np.errstate(over="ignore"):
                    risk = _risk(gnmr, delta, alpha_t, beta_t, nonfinite_mask)
            self._record_cache = {
                "step": t,
                "active": np.flatnonzero(new).tolist(),
                "promoted": np.flatnonzero(new & ~old).tolist(),
                "demoted": np.flatnonzero(old & ~new).tolist(),
                "selected": np.flatnonzero(selected).tolist(),
                "warmup": warmup,
                "over_gnmr": over_gnmr,
                "over_delta": over_delta,
                "candidates": n_cand,
                "hit_max": hit_max,
                "hit_bytes": hit_bytes,
                "active_bytes": active_bytes,
                "budget_bytes": self._budget_bytes,
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
        2..t); ``mean_active`` = active unit-steps / t (the mean number of units on the recovery path
        per step, what an equal-budget baseline matches); ``hit_max_rate`` = decisions where the budget bound (the selection filled ``max_active``, or the
        byte budget skipped a candidate) / steps;
        ``gnmr_exceedance_rate`` / ``delta_exceedance_rate`` = monitored unit-steps (U * t) with
        GNMR >= alpha_t / Delta >= beta_t (the paper's Table 3); ``switches`` = promotions +
        demotions decided so far (path changes between consecutive masks, steps 1 -> 2 .. t -> t+1);
        ``promotions``, ``demotions``; ``nonfinite`` = unit-steps with a non-finite norm.

        With ``unit_bytes``, also: ``mean_active_bytes`` = recovery bytes of the masks in effect during
        steps 1..t / t; ``peak_active_bytes`` = the largest of them (warm-up masks included);
        ``hit_bytes_rate`` = decisions where the byte budget skipped a candidate / steps (these count in
        ``hit_max_rate`` too).
        """
        tot, t, U = self._totals, self.t, self.num_units
        rec_unit_steps = t * self._num_recoverable
        out = {
            "steps": t,
            "promotion_ratio": tot["active_unit_steps"] / rec_unit_steps if rec_unit_steps else 0.0,
            "mean_active": tot["active_unit_steps"] / t if t else 0.0,
            "hit_max_rate": tot["hit_max_steps"] / t if t else 0.0,
            "gnmr_exceedance_rate": tot["gnmr_exceed"] / (U * t) if t else 0.0,
            "delta_exceedance_rate": tot["delta_exceed"] / (U * t) if t else 0.0,
            "switches": tot["promotions"] + tot["demotions"],
            "promotions": tot["promotions"],
            "demotions": tot["demotions"],
            "nonfinite": tot["nonfinite"],
        }
        if self._bytes is not None:
            bt = self._byte_totals
            out["mean_active_bytes"] = bt["active_bytes"] / t if t else 0.0
            out["peak_active_bytes"] = bt["peak_active_bytes"]
            out["hit_bytes_rate"] = bt["hit_bytes_steps"] / t if t else 0.0
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (plain ints, floats, bools, lists; no NaN/Inf) for exact resume.

        ``last_record`` is not part of it: it is a view of the last step, not needed to continue.
        """
        return controller_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (possibly after a JSON round trip).

        The state must come from a controller with the same ``num_units``, config, recoverable
        units and ``unit_bytes``; otherwise ``ValueError`` says what differs (build a matching controller with
        :meth:`from_state_dict`).
        """
        restore_state(self, state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> GNMRController:
        """Build a controller with the saved num_units, config, recoverable units and unit_bytes, then load
        the state."""
        ctrl = cls(
            state["num_units"],
            GNMRConfig.from_dict(state["config"]),
            recoverable=torch.tensor(state["recoverable"], dtype=torch.bool),
            unit_bytes=state.get("unit_bytes"),
        )
        ctrl.load_state_dict(state)
        return ctrl

    def __repr__(self) -> str:
        return (
            f"GNMRController(num_units={self.num_units}, recoverable={int(self.recoverable.sum())}, "
            f"t={self.t}, active={np.flatnonzero(self._active).tolist()}, config={self.config})"
        )

