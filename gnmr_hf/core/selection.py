"""The budget arithmetic of one controller step: the risk R of each unit, the top-``max_active`` cut by R (ties to
the lower index) and the byte-budgeted walk in the same rank order. Pure NumPy over arrays [U]."""

from __future__ import annotations

import math

import numpy as np

# up to this many candidates the top-K cut sorts them; more are cut with a partition (linear time)
_TOP_K_SORT_MAX = 512


def _risk(gnmr: np.ndarray, delta: np.ndarray, alpha: float, beta: float, nonfinite: np.ndarray | None) -> np.ndarray:
    """R = max(GNMR / alpha_t, Delta / beta_t) per unit, +inf where the norm was not finite (a new array).

    Call it under ``np.errstate(over="ignore")``: a tiny threshold can overflow the quotient to +inf.
    """
    risk = np.maximum(gnmr / alpha, delta / beta)
    if nonfinite is not None:
        risk[nonfinite] = math.inf
    return risk


def _top_k(cand: np.ndarray, risk: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` candidates with the largest R as a new bool mask, ties to the lower index (0 < k < |cand|)."""
    idx = cand.nonzero()[0]  # the candidates' indices, ascending
    r = risk[idx]  # R >= 0 (+inf allowed, never NaN)
    if len(idx) <= _TOP_K_SORT_MAX:
        # a stable sort by -R keeps the candidates tied at one R in index order
        top = idx[(-r).argsort(kind="stable")[:k]]
    else:
        # the k-th largest R is the cut: everything above it is in, and of the candidates tied at
        # it, the lowest indices fill the remaining places (cumsum counts ties in index order)
        cut = -np.partition(-r, k - 1)[k - 1]
        above = r > cut
        tied = r == cut
        top = idx[above | (tied & (tied.cumsum() <= k - np.count_nonzero(above)))]
    selected = np.zeros(len(cand), dtype=bool)
    selected[top] = True
    return selected

def _top_k_bytes(
    cand: np.ndarray, risk: np.ndarray, k: int, unit_bytes: tuple[int, ...], budget: int
) -> tuple[np.ndarray, bool]:
    """The byte-budgeted selection as a new bool mask, and whether the budget skipped a candidate.

    The candidates in rank order (R descending, ties to the lower index: the order of :func:`_top_k`);
    a unit whose bytes would take the running total over ``budget`` is skipped, and the walk stops
    once ``k`` units are taken (k > 0). Candidates after the k-th taken are not looked at, so they
    do not count as skipped. A Python loop over the candidates: they are few (tens) at most steps.
    """
    idx = cand.nonzero()[0]
    order = idx[(-risk[idx]).argsort(kind="stable")].tolist()
    selected = np.zeros(len(cand), dtype=bool)
    total, taken, skipped = 0, 0, False
    for b in order:
        nb = unit_bytes[b]
        if total + nb > budget:
            skipped = True
            continue
        selected[b] = True
        total += nb
        taken += 1
        if taken == k:
            break
    return selected, skipped
