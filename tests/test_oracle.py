"""The oracle diagnostic's maths (gnmr_hf.core.oracle): gaps, the oracle set, the metrics and the
accumulator, on cases worked out by hand. Every test name holds "oracle" (``pytest -k oracle``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gnmr_hf.core.oracle import (
    METRICS,
    OracleAccumulator,
    oracle_mask,
    recovery_gap,
    recovery_gap_from_sq_norms,
    selection_metrics,
)

NAN = math.nan


def _gradients(model: torch.nn.Module, x: torch.Tensor) -> list[list[torch.Tensor]]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [[p.grad.clone() for p in layer.parameters()] for layer in model]


def test_oracle_gap_is_zero_when_low_path_equals_recovery_path():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    grads = _gradients(model, x)
    gap = recovery_gap(grads, [[g.clone() for g in unit] for unit in grads])
    assert gap.tolist() == [0.0, 0.0]
    sq = torch.tensor([sum(float(g.square().sum()) for g in unit) for unit in grads])
    assert recovery_gap_from_sq_norms(torch.zeros(2), sq).tolist() == [0.0, 0.0]
    # and not zero once the first layer's weight runs on a coarse grid (the "low path")
    with torch.no_grad():
        model[0].weight.copy_((model[0].weight * 4).round() / 4)
    low = _gradients(model, x)
    gap = recovery_gap(low, grads)
    assert bool(gap.isfinite().all()) and gap[0] > 0 and gap[1] > 0


def test_oracle_gap_by_hand():
    # unit 0: high (3, 4), norm 5; low = high + (0.3, 0.4): difference norm 0.5 -> 0.1
    # unit 1: two tensors; high (1, 0) and (0, 2, 2): norm 3; low (1, 0) and (0, 2, 2) + (0, 0, 0.6) -> 0.2
    # unit 2: no recovery-path gradient but a low-path one -> +inf; unit 3: none on either path -> 0
    # unit 4: a parameter the low-path backward did not reach (None): difference = high -> 1
    high = [torch.tensor([3.0, 4.0]), [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0, 2.0])],
            torch.zeros(2), torch.zeros(3), torch.tensor([0.0, 7.0])]
    low = [torch.tensor([3.3, 4.4]), [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0, 2.6])],
           torch.tensor([0.0, 1e-3]), torch.zeros(3), None]
    gap = recovery_gap(low, high)
    assert gap.dtype == torch.float64
    assert gap[:2].tolist() == pytest.approx([0.1, 0.2], rel=1e-6)
    assert gap[2] == math.inf and gap[3] == 0.0 and gap[4] == 1.0
    # the squared-norm form gives the same values
    by_sq = recovery_gap_from_sq_norms([0.25, 0.36, 1e-6, 0.0, 49.0], [25.0, 9.0, 0.0, 0.0, 49.0])
    torch.testing.assert_close(by_sq, gap, rtol=1e-6, atol=0)


def test_oracle_gap_errors():
    with pytest.raises(ValueError, match="1 unit.*high_grads has 2"):
        recovery_gap([torch.ones(1)], [torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match="shapes"):
        recovery_gap([torch.ones(2)], [torch.ones(3)])
    with pytest.raises(ValueError, match="1 low-path gradients vs 2"):
        recovery_gap([torch.ones(2)], [[torch.ones(2), torch.ones(2)]])
    with pytest.raises(ValueError, match=">= 0"):
        recovery_gap_from_sq_norms([-1.0], [1.0])
    assert math.isnan(recovery_gap([torch.tensor([NAN])], [torch.ones(1)])[0])  # a NaN gradient is not hidden


def test_oracle_set_top_k_ties_to_lower_index_recoverable_only():
    gaps = torch.tensor([0.2, 0.5, 0.2, 0.9, 0.2])
    assert oracle_mask(gaps, 2).nonzero().flatten().tolist() == [1, 3]
    assert oracle_mask(gaps, 3).nonzero().flatten().tolist() == [0, 1, 3]  # three tie at 0.2: unit 0
    rec = [True, True, True, False, True]
    assert oracle_mask(gaps, 2, rec).nonzero().flatten().tolist() == [0, 1]
    assert oracle_mask(gaps, 9, rec).nonzero().flatten().tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="finite"):
        oracle_mask(torch.tensor([0.1, math.inf]), 1)
    with pytest.raises(ValueError, match="max_active"):
        oracle_mask(gaps, 0)


def test_oracle_metrics_by_hand():
    gaps = [0.5, 0.1, 0.3, 0.05, 0.05]  # total 1.0; K = 2: oracle {0, 2}, which holds 0.8 of it
    m = selection_metrics(gaps, [0, 1], 2)
    assert m["precision_at_k"] == 0.5 and m["precision"] == 0.5 and m["recall"] == 0.5
    assert m["captured"] == pytest.approx(0.6) and m["oracle_captured"] == pytest.approx(0.8)
    assert m["n_chosen"] == 2.0
    # a quiet step: nothing chosen -> precision undefined, nothing captured
    m = selection_metrics(gaps, torch.zeros(5, dtype=torch.bool), 2)
    assert m["precision_at_k"] == 0.0 and math.isnan(m["precision"]) and m["recall"] == 0.0
    assert m["captured"] == 0.0
    # more units than the budget (a warm-up mask): both oracle units found, 2 of 3 chosen are oracle units
    m = selection_metrics(gaps, [True, False, True, False, True], 2)
    assert m["precision_at_k"] == 1.0 and m["recall"] == 1.0 and m["precision"] == pytest.approx(2 / 3)
    assert m["captured"] == pytest.approx(0.85)
    # unit 2 not recoverable: the oracle becomes {0, 1}, the total 0.7; a chosen non-recoverable unit is ignored
    rec = [True, True, False, True, True]
    m = selection_metrics(gaps, [0, 2], 2, rec)
    assert m["n_chosen"] == 1.0 and m["precision"] == 1.0 and m["precision_at_k"] == 0.5 and m["recall"] == 0.5
    assert m["captured"] == pytest.approx(0.5 / 0.7) and m["oracle_captured"] == pytest.approx(0.6 / 0.7)
    # fewer recoverable units than the budget: recall counts the oracle's 1 unit, precision@K the budget of 2
    m = selection_metrics(gaps, [1], 2, [False, True, False, False, False])
    assert m["recall"] == 1.0 and m["precision_at_k"] == 0.5 and m["captured"] == 1.0
    # no gap at all: nothing to capture
    m = selection_metrics([0.0, 0.0, 0.0], [0], 1)
    assert math.isnan(m["captured"]) and math.isnan(m["oracle_captured"])


def test_oracle_metrics_errors():
    with pytest.raises(ValueError, match="indices"):
        selection_metrics([0.1, 0.2], [2], 1)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        selection_metrics([0.1, 0.2], [True], 1)
    with pytest.raises(ValueError, match="no unit is recoverable"):
        selection_metrics([0.1, 0.2], [0], 1, [False, False])
    with pytest.raises(ValueError, match=">= 0"):
        selection_metrics([0.1, -0.2], [0], 1)


def test_oracle_accumulator_table_series_and_heatmap():
    acc = OracleAccumulator(4, max_active=1)
    # step 1: oracle {2}, total 1.0;   gnmr chose {2} (hit, captures 0.6); random chose {0} (0.1)
    acc.add(1, torch.tensor([0.1, 0.2, 0.6, 0.1]), {"gnmr": [2], "random": [0]})
    # step 2: a NaN gap (diverged gradients): skipped, not scored
    assert acc.add(2, torch.tensor([0.1, NAN, 0.6, 0.1]), {"gnmr": [2], "random": [1]}) is None
    # step 3: oracle {0}, total 2.0;   gnmr chose nothing (quiet); random chose {0} (hit, 1.0 of 2.0)
    step3 = acc.add(3, [1.0, 0.5, 0.25, 0.25], {"gnmr": [], "random": [0]})
    assert step3["random"]["captured"] == 0.5
    table = acc.table()
    assert acc.triggers == ["gnmr", "random"]
    assert table["gnmr"]["steps"] == 2.0
    assert table["gnmr"]["precision_at_k"] == 0.5 and table["gnmr"]["recall"] == 0.5
    assert table["gnmr"]["precision"] == 1.0  # the quiet step's undefined precision is left out
    assert table["gnmr"]["captured"] == pytest.approx((0.6 + 0.0) / 2)
    assert table["random"]["precision_at_k"] == 0.5 and table["random"]["captured"] == pytest.approx((0.1 + 0.5) / 2)
    assert table["random"]["oracle_captured"] == pytest.approx((0.6 + 0.5) / 2)
    assert acc.series("random", "captured") == ([1, 3], [pytest.approx(0.1), 0.5])
    steps, rows = acc.heatmap()
    assert steps == [1, 3] and rows[1] == [1.0, 0.5, 0.25, 0.25] and acc.skipped == [2]
    assert acc.oracle_sets == [[2], [0]]
    data = json.loads(json.dumps(acc.to_dict(), allow_nan=False))
    assert data["series"]["gnmr"]["precision"] == [1.0, None]
    assert set(data["series"]["gnmr"]) == {"step", *METRICS}
    with pytest.raises(ValueError, match="no trigger"):
        acc.series("gsnr", "captured")
    with pytest.raises(ValueError, match="shape"):
        acc.add(4, torch.ones(3), {})
