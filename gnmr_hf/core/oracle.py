"""The oracle diagnostic: how close a trigger comes to recovering the units with the largest recovery gaps.

The paper's Corollary 1 names the ideal trigger: under the budget, put the units with the largest
recovery gaps on the recovery path. This module is that ideal's arithmetic, pure (torch only); the
training side supplies, at the steps it diagnoses, each unit's gradient on the low path (the step as
run) and on the recovery path (one extra backward with every unit on the recovery path).

Definitions (per step, units b = 0..U-1, budget K = ``max_active``, R = the recoverable units):

- **recovery gap**: the relative gradient error of the low path,
  ``gap_b = ||g_low_b - g_high_b|| / ||g_high_b||``, the norms taken over all of the unit's gradient
  tensors together (its LoRA A and B, say). ``0 / 0 = 0`` (no gradient on either path: no error);
  ``x / 0 = +inf`` for x > 0. It is 0 exactly when the low path reproduces the recovery path's gradient.
- **oracle set** O: the top ``min(K, |R|)`` units of R by gap, ties to the lower index.
- for a trigger's chosen set C (only its recoverable units count), with ``hits = |C & O|``:

  - ``precision_at_k = hits / K`` (precision@max_active; an unfilled budget counts as misses),
  - ``precision = hits / |C|`` (NaN when C is empty),
  - ``recall = hits / |O|`` (the share of the oracle set the trigger found; equal to ``precision_at_k``
    unless fewer than K units are recoverable),
  - ``captured = sum(gap over C) / sum(gap over R)``: the share of the total gap the chosen set
    recovers; ``oracle_captured`` is the same for O (the best any trigger can do under the budget).
    Both are NaN when the total gap is 0 (nothing to capture).

The metrics need finite gaps; :class:`OracleAccumulator` skips (and counts) steps with a non-finite one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gnmr_hf.core.controller import unit_mask

__all__ = [
    "METRICS",
    "OracleAccumulator",
    "oracle_mask",
    "recovery_gap",
    "recovery_gap_from_sq_norms",
    "selection_metrics",
]

METRICS = ("precision_at_k", "precision", "recall", "captured", "oracle_captured", "n_chosen")

UnitGrads = torch.Tensor | Sequence[torch.Tensor | None] | None


def _unit_tensors(grads: UnitGrads) -> list[torch.Tensor | None]:
    if grads is None or isinstance(grads, torch.Tensor):
        return [grads]
    return list(grads)


def recovery_gap(low_grads: Sequence[UnitGrads], high_grads: Sequence[UnitGrads]) -> torch.Tensor:
    """Per-unit recovery gap ``||g_low - g_high|| / ||g_high||`` from the two paths' gradients.

    Args:
        low_grads (`Sequence`): per unit, its gradient on the low path: one tensor or a sequence of
            tensors (all of the unit's parameters, in the same order as in ``high_grads``); ``None``
            stands for a zero gradient (a parameter the backward did not reach).
        high_grads (`Sequence`): the same on the recovery path.

    Returns:
        `torch.Tensor` [U], float64 on the CPU: the gaps (0/0 = 0, x/0 = +inf; NaN when a gradient is).
    """
    if len(low_grads) != len(high_grads):
        raise ValueError(f"low_grads has {len(low_grads)} unit(s), high_grads has {len(high_grads)}: one entry per unit in both")
    diff_sq, high_sq = [], []
    for b, (low, high) in enumerate(zip(low_grads, high_grads)):
        lows, highs = _unit_tensors(low), _unit_tensors(high)
        if len(lows) != len(highs):
            raise ValueError(f"unit {b}: {len(lows)} low-path gradients vs {len(highs)} recovery-path gradients")
        d = h = 0.0
        for i, (lo, hi) in enumerate(zip(lows, highs)):
            if lo is not None and hi is not None and lo.shape != hi.shape:
                raise ValueError(f"unit {b}, tensor {i}: shapes {tuple(lo.shape)} and {tuple(hi.shape)} differ")
            # float64 sums: the difference of two close gradients must not drown in rounding
            lo64 = None if lo is None else lo.detach().to(torch.float64)
            hi64 = None if hi is None else hi.detach().to(torch.float64)
            if hi64 is not None:
                h += float(hi64.square().sum())
                d += float((hi64 - lo64).square().sum()) if lo64 is not None else float(hi64.square().sum())
            elif lo64 is not None:
                d += float(lo64.square().sum())
        diff_sq.append(d)
        high_sq.append(h)
    return recovery_gap_from_sq_norms(torch.tensor(diff_sq, dtype=torch.float64),
                                      torch.tensor(high_sq, dtype=torch.float64))


def recovery_gap_from_sq_norms(diff_sq: Any, high_sq: Any) -> torch.Tensor:
    """Per-unit recovery gap ``sqrt(diff_sq / high_sq)`` from squared norms.

    For callers that reduce the gradients themselves (one foreach pass per path):
    ``diff_sq[b] = ||g_low_b - g_high_b||^2`` and ``high_sq[b] = ||g_high_b||^2``, each summed over all
    of unit b's gradient tensors.

    Args:
        diff_sq (`torch.Tensor` [U]): squared norm of the gradient difference per unit, >= 0.
        high_sq (`torch.Tensor` [U]): squared norm of the recovery-path gradient per unit, >= 0.

    Returns:
        `torch.Tensor` [U], float64 on the CPU: 0/0 = 0, x/0 = +inf, NaN stays NaN.
    """
    d = torch.as_tensor(diff_sq).detach().to(device="cpu", dtype=torch.float64)
    h = torch.as_tensor(high_sq).detach().to(device="cpu", dtype=torch.float64)
    if d.dim() != 1 or d.shape != h.shape:
        raise ValueError(f"diff_sq and high_sq must be 1-D of equal shape, got {tuple(d.shape)} and {tuple(h.shape)}")
    if bool((d < 0).any()) or bool((h < 0).any()):
        raise ValueError("diff_sq and high_sq are squared norms and must be >= 0")
    gap = (d / h).sqrt()
    return gap.masked_fill_((d == 0) & (h == 0), 0.0)


def _as_gaps(gaps: Any) -> list[float]:
    values = torch.as_tensor(gaps).detach().to(device="cpu", dtype=torch.float64)
    if values.dim() != 1:
        raise ValueError(f"gaps must be 1-D [U], got shape {tuple(values.shape)}")
    values = values.tolist()
    if not all(math.isfinite(v) for v in values):
        raise ValueError("gaps must be finite; skip a step whose gradients were not (OracleAccumulator does)")
    if any(v < 0 for v in values):
        raise ValueError("gaps must be >= 0 (relative gradient errors)")
    return values


def _as_recoverable(recoverable: Any, num_units: int) -> list[bool]:
    return [True] * num_units if recoverable is None else unit_mask(recoverable, num_units).tolist()


def _as_set(chosen: Any, num_units: int) -> set[int]:
    """A chosen set from a bool mask [U] (tensor or list) or from unit indices."""
    return set(unit_mask(chosen, num_units, "chosen").nonzero().flatten().tolist())


def _check_budget(max_active: Any) -> int:
    if isinstance(max_active, bool) or not isinstance(max_active, int) or max_active < 1:
        raise ValueError(f"max_active must be an integer >= 1, got {max_active!r}")
    return max_active


def _oracle(gaps: list[float], max_active: int, rec: list[bool]) -> list[int]:
    pool = sorted((b for b in range(len(gaps)) if rec[b]), key=lambda b: (-gaps[b], b))
    return sorted(pool[:max_active])


def oracle_mask(gaps: Any, max_active: int, recoverable: Any = None) -> torch.Tensor:
    """The oracle set: the top ``min(max_active, recoverable)`` recoverable units by gap, ties to the lower index.

    Args:
        gaps (`torch.Tensor` [U]): finite per-unit recovery gaps (:func:`recovery_gap`).
        max_active (`int`): the budget K >= 1.
        recoverable (*optional*): U bools; None means all.

    Returns:
        `torch.BoolTensor` [U].
    """
    values = _as_gaps(gaps)
    rec = _as_recoverable(recoverable, len(values))
    mask = torch.zeros(len(values), dtype=torch.bool)
    mask[_oracle(values, _check_budget(max_active), rec)] = True
    return mask


def selection_metrics(gaps: Any, chosen: Any, max_active: int, recoverable: Any = None) -> dict[str, float]:
    """How a trigger's chosen set compares with the oracle set at one step (definitions in the module docstring).

    Args:
        gaps (`torch.Tensor` [U]): finite per-unit recovery gaps.
        chosen: the trigger's units on the recovery path: a bool mask [U] or unit indices; units that
            are not recoverable are ignored.
        max_active (`int`): the budget K >= 1.
        recoverable (*optional*): U bools; None means all.

    Returns:
        `dict` with ``precision_at_k``, ``precision``, ``recall``, ``captured``, ``oracle_captured`` and
        ``n_chosen`` (floats; NaN where undefined).
    """
    values = _as_gaps(gaps)
    U = len(values)
    K = _check_budget(max_active)
    rec = _as_recoverable(recoverable, U)
    if not any(rec):
        raise ValueError("no unit is recoverable: the oracle set is empty")
    oracle = set(_oracle(values, K, rec))
    picked = {b for b in _as_set(chosen, U) if rec[b]}
    hits = len(picked & oracle)
    total = sum(v for v, r in zip(values, rec) if r)
    return {
        "precision_at_k": hits / K,
        "precision": hits / len(picked) if picked else math.nan,
        "recall": hits / len(oracle),
        "captured": sum(values[b] for b in picked) / total if total > 0 else math.nan,
        "oracle_captured": sum(values[b] for b in oracle) / total if total > 0 else math.nan,
        "n_chosen": float(len(picked)),
    }


def _nan_to_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


class OracleAccumulator:
    """Collects, step by step, the gaps and every trigger's metrics; returns the tables and the heat map.

    Args:
        num_units (`int`): U.
        max_active (`int`): the budget K >= 1.
        recoverable (*optional*): U bools; None means all.

    Example::

        acc = OracleAccumulator(30, max_active=7)
        acc.add(step, gaps, {"gnmr": controller_mask, "random": random_mask})
        acc.table()["gnmr"]["captured"]  # mean share of the gap GNMR's sets captured
    """

    def __init__(self, num_units: int, max_active: int, recoverable: Any = None) -> None:
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}")
        self.num_units = num_units
        self.max_active = _check_budget(max_active)
        self.recoverable = _as_recoverable(recoverable, num_units)
        self.steps: list[int] = []  # the scored steps
        self.gaps: list[list[float]] = []  # one row [U] per scored step: the heat map
        self.oracle_sets: list[list[int]] = []
        self.skipped: list[int] = []  # steps with a non-finite gap (not scored)
        self._series: dict[str, dict[str, list]] = {}  # trigger -> {"step": [...], metric: [...]}

    def add(self, step: int, gaps: Any, choices: Mapping[str, Any]) -> dict[str, dict[str, float]] | None:
        """Score every trigger's chosen set at ``step`` against the oracle of ``gaps``.

        Args:
            step (`int`): the training step the gaps were measured at.
            gaps (`torch.Tensor` [U]): the per-unit recovery gaps at that step.
            choices (`Mapping[str, mask or indices]`): per trigger name, its units on the recovery path
                at that step.

        Returns:
            The step's metrics per trigger, or None when a gap is non-finite (the step is skipped and
            listed in :attr:`skipped`).
        """
        values = torch.as_tensor(gaps).detach().to(device="cpu", dtype=torch.float64)
        if values.shape != (self.num_units,):
            raise ValueError(f"gaps must have shape ({self.num_units},), got {tuple(values.shape)}")
        if not bool(values.isfinite().all()):
            self.skipped.append(int(step))
            return None
        row = values.tolist()
        scored = {name: selection_metrics(row, chosen, self.max_active, self.recoverable)
                  for name, chosen in choices.items()}
        self.steps.append(int(step))
        self.gaps.append(row)
        self.oracle_sets.append(_oracle(row, self.max_active, self.recoverable))
        for name, metrics in scored.items():
            series = self._series.setdefault(name, {"step": [], **{m: [] for m in METRICS}})
            series["step"].append(int(step))
            for m in METRICS:
                series[m].append(metrics[m])
        return scored

    @property
    def triggers(self) -> list[str]:
        """The trigger names seen so far, in order of first appearance."""
        return list(self._series)

    def series(self, trigger: str, metric: str) -> tuple[list[int], list[float]]:
        """The per-step values of one metric for one trigger: ``(steps, values)``."""
        if trigger not in self._series:
            raise ValueError(f"no trigger {trigger!r}; known: {self.triggers}")
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
        return list(self._series[trigger]["step"]), list(self._series[trigger][metric])

    def table(self) -> dict[str, dict[str, float]]:
        """Per trigger: ``steps`` scored and the mean of every metric over them (NaN values left out;
        NaN when all are NaN)."""
        out = {}
        for name, series in self._series.items():
            row: dict[str, float] = {"steps": float(len(series["step"]))}
            for m in METRICS:
                finite = [v for v in series[m] if not math.isnan(v)]
                row[m] = sum(finite) / len(finite) if finite else math.nan
            out[name] = row
        return out

    def heatmap(self) -> tuple[list[int], list[list[float]]]:
        """The gap heat map: the scored steps and one row of U gaps per step."""
        return list(self.steps), [list(r) for r in self.gaps]

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-safe data (NaN as None): config, steps, gaps, oracle sets, series, table."""
        return {
            "num_units": self.num_units,
            "max_active": self.max_active,
            "recoverable": list(self.recoverable),
            "steps": list(self.steps),
            "skipped": list(self.skipped),
            "gaps": [list(r) for r in self.gaps],
            "oracle_sets": [list(s) for s in self.oracle_sets],
            "series": {name: {"step": list(s["step"]), **{m: [_nan_to_none(v) for v in s[m]] for m in METRICS}}
                       for name, s in self._series.items()},
            "table": {name: {k: _nan_to_none(v) for k, v in row.items()} for name, row in self.table().items()},
        }
