"""Hand-worked sequences for every rule of the GNMR controller (docs/design.md).

Every expected GNMR, Delta, risk and active set below is worked out by hand in the comments, from
the rules, never recomputed with the controller's formula. Notation: n_t are the norms, g_t GNMR,
d_t Delta, R_t = max(g_t / alpha_t, d_t / beta_t), "hist" the finite past norms and "win" the last
`window` finite GNMR values.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController

NAN = math.nan
INF = math.inf


def run(ctrl: GNMRController, rows):
    """Step through rows of norms; return the masks (as index lists) and the records."""
    masks, records = [], []
    for row in rows:
        mask = ctrl.step(torch.tensor(row, dtype=torch.float64))
        masks.append(mask.nonzero().flatten().tolist())
        records.append(ctrl.last_record)
    return masks, records


def same(a, b, rel=1e-12):
    """Per-unit float lists equal, NaN matching NaN, inf matching inf."""
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b):
        if math.isnan(y):
            assert math.isnan(x), (a, b)
        elif math.isinf(y):
            assert x == y, (a, b)
        else:
            assert x == pytest.approx(y, rel=rel, abs=1e-15), (a, b)


# ---------------------------------------------------------------------------- first step, ties


def test_first_step_is_one_and_quiet_with_default_thresholds():
    ctrl = GNMRController(3, GNMRConfig())
    assert ctrl.initial_mask().tolist() == [False, False, False]
    mask = ctrl.step(torch.tensor([2.0, 5.0, 0.0]))
    rec = ctrl.last_record
    # g_1 = d_1 = 1 whatever n_1 is; R = max(1 / 1.1, 1 / 1.5) = 0.90909... < 1: nobody risky
    same(rec["gnmr"], [1.0, 1.0, 1.0])
    same(rec["delta"], [1.0, 1.0, 1.0])
    same(rec["risk"], [1 / 1.1] * 3)
    assert mask.dtype == torch.bool and mask.device.type == "cpu" and mask.shape == (3,)
    assert mask.tolist() == [False, False, False]
    assert rec["step"] == 1 and rec["candidates"] == 0 and rec["active"] == []
    assert rec["over_gnmr"] == 0 and rec["over_delta"] == 0 and rec["hit_max"] is False


def test_first_step_tie_goes_to_lower_indices():
    # alpha = 1.0: R_1 = max(1 / 1, 1 / 1.5) = 1 for every unit, all risky and all tied
    ctrl = GNMRController(4, GNMRConfig(max_active=2, alpha=1.0))
    masks, recs = run(ctrl, [[7.0, 3.0, 9.0, 1.0]])
    assert masks == [[0, 1]]
    assert recs[0]["candidates"] == 4 and recs[0]["hit_max"] is True
    assert recs[0]["promoted"] == [0, 1] and recs[0]["demoted"] == []


def test_top_k_by_risk_with_a_tie_at_the_cut():
    cfg = GNMRConfig(max_active=3, alpha=2.0, beta=100.0, lock_steps=0)
    ctrl = GNMRController(5, cfg)
    # t=1: g = 1 everywhere, R = 1/2 -> quiet
    # t=2: hist = [1] -> g = n = [3, 5, 3, 5, 3]; d = g / 1 (win [1]) -> d/100 tiny
    #      R = g / 2 = [1.5, 2.5, 1.5, 2.5, 1.5]: units 1 and 3 first, then one of the three tied at
    #      1.5 -> the lowest index, unit 0
    masks, recs = run(ctrl, [[1.0] * 5, [3.0, 5.0, 3.0, 5.0, 3.0]])
    same(recs[1]["risk"], [1.5, 2.5, 1.5, 2.5, 1.5])
    assert masks == [[], [0, 1, 3]]
    assert recs[1]["selected"] == [0, 1, 3]
    assert recs[1]["candidates"] == 5 and recs[1]["hit_max"] is True
    # with max_active = 2 the tie does not reach the cut: units 1 and 3
    ctrl2 = GNMRController(5, GNMRConfig(max_active=2, alpha=2.0, beta=100.0, lock_steps=0))
    assert run(ctrl2, [[1.0] * 5, [3.0, 5.0, 3.0, 5.0, 3.0]])[0] == [[], [1, 3]]


def test_infinite_risks_tie_to_lower_index():
    # NaN and Inf norms both give R = +inf: a tie among infinities, broken by index
    ctrl = GNMRController(4, GNMRConfig(max_active=1))
    masks, recs = run(ctrl, [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, INF, NAN]])
    same(recs[1]["risk"], [1 / 1.1, 1 / 1.1, INF, INF])
    assert masks[1] == [2]
    assert recs[1]["nonfinite"] == 2 and recs[1]["candidates"] == 2


# ---------------------------------------------------------------------------- non-finite norms


def test_nan_step_is_maximal_risk_and_kept_out_of_both_histories():
    cfg = GNMRConfig(max_active=1, alpha=2.0, beta=2.0, lock_steps=0)
    ctrl = GNMRController(2, cfg)
    masks, recs = run(ctrl, [[1.0, 1.0], [NAN, 1.0], [3.0, 1.0], [2.0, 1.0]])
    # t=1: g = d = [1, 1], R = [0.5, 0.5]
    same(recs[0]["gnmr"], [1.0, 1.0])
    assert masks[0] == []
    # t=2: unit 0 NaN -> g, d reported NaN, R = inf, counted; unit 1: hist [1] -> g 1, win [1] -> d 1
    same(recs[1]["gnmr"], [NAN, 1.0])
    same(recs[1]["delta"], [NAN, 1.0])
    same(recs[1]["risk"], [INF, 0.5])
    assert recs[1]["nonfinite"] == 1 and masks[1] == [0]
    # NaN does not count as exceeding a threshold
    assert recs[1]["over_gnmr"] == 0 and recs[1]["over_delta"] == 0
    # t=3: unit 0 hist is still [1] (NaN kept out) -> g = 3; win still [1] -> d = 3; R = 1.5
    same(recs[2]["gnmr"], [3.0, 1.0])
    same(recs[2]["delta"], [3.0, 1.0])
    same(recs[2]["risk"], [1.5, 0.5])
    assert masks[2] == [0] and recs[2]["promoted"] == [] and recs[2]["demoted"] == []
    # t=4: hist [1, 3] -> mean 2 -> g = 1; win [1, 3] -> mean 2 -> d = 0.5; R = 0.5, lock_steps=0
    same(recs[3]["gnmr"], [1.0, 1.0])
    same(recs[3]["delta"], [0.5, 1.0])
    assert masks[3] == [] and recs[3]["demoted"] == [0]
    assert ctrl.summary()["nonfinite"] == 1


def test_inf_step_is_kept_out_like_nan():
    ctrl = GNMRController(1, GNMRConfig(max_active=1, alpha=3.0, beta=3.0))
    masks, recs = run(ctrl, [[2.0], [INF], [4.0]])
    # t=2: inf -> R inf, selected
    same(recs[1]["risk"], [INF])
    assert masks[1] == [0]
    # t=3: hist [2] -> g = 4 / 2 = 2; win [1] -> d = 2; R = 2/3 < 1, but the lock set at t=2
    # (selected while risky, lock_steps=1) keeps it one more decision
    same(recs[2]["gnmr"], [2.0])
    same(recs[2]["delta"], [2.0])
    assert masks[2] == [0]


def test_nonfinite_first_norm_then_first_finite_norm_counts_as_first_observation():
    # documented choice: with no finite past norm GNMR = 1, and with no finite past GNMR Delta = 1
    ctrl = GNMRController(1, GNMRConfig(max_active=1, lock_steps=0))
    masks, recs = run(ctrl, [[NAN], [5.0], [10.0]])
    same(recs[0]["gnmr"], [NAN])
    assert masks[0] == [0]
    same(recs[1]["gnmr"], [1.0])
    same(recs[1]["delta"], [1.0])
    assert masks[1] == []
    # t=3: hist [5] -> g = 2; win [1] -> d = 2
    same(recs[2]["gnmr"], [2.0])
    same(recs[2]["delta"], [2.0])


# ---------------------------------------------------------------------------- zero histories


def test_zero_history_zero_norm_is_one_and_positive_norm_is_inf():
    ctrl = GNMRController(2, GNMRConfig(max_active=2, alpha=2.0, beta=2.0, lock_steps=0))
    masks, recs = run(ctrl, [[0.0, 0.0], [0.0, 5.0], [0.0, 5.0]])
    # t=2: unit 0 hist [0], n 0 -> g 1; win [1] -> d 1. unit 1 hist [0], n 5 -> g inf -> d inf
    same(recs[1]["gnmr"], [1.0, INF])
    same(recs[1]["delta"], [1.0, INF])
    same(recs[1]["risk"], [0.5, INF])
    assert masks[1] == [1]
    # a zero history is not a non-finite norm
    assert recs[1]["nonfinite"] == 0 and recs[1]["over_gnmr"] == 1
    # t=3: unit 1 hist [0, 5] -> mean 2.5 -> g = 2; its win holds only the finite g_1 = 1 (g_2 = inf
    # stayed out) -> d = 2; unit 0 hist [0, 0], n 0 -> g 1, win [1, 1] -> d 1
    same(recs[2]["gnmr"], [1.0, 2.0])
    same(recs[2]["delta"], [1.0, 2.0])
    assert masks[2] == [1]


def test_zero_window_mean_and_window_shorter_than_history():
    ctrl = GNMRController(1, GNMRConfig(max_active=1, alpha=10.0, beta=10.0, window=2))
    _, recs = run(ctrl, [[4.0], [0.0], [0.0], [3.0]])
    # t=1: g 1, d 1.             win -> [1]
    # t=2: hist [4]: g 0; win [1] -> d 0.          win -> [1, 0]
    # t=3: hist [4, 0] mean 2: g 0; win [1, 0] mean 0.5 -> d 0.    win -> [0, 0] (window 2)
    # t=4: hist [4, 0, 0] mean 4/3: g = 3 / (4/3) = 2.25; win [0, 0] mean 0, g > 0 -> d = inf
    same([r["gnmr"][0] for r in recs], [1.0, 0.0, 0.0, 2.25])
    same([r["delta"][0] for r in recs], [1.0, 0.0, 0.0, INF])
    # with window 3 the window at t=4 is [1, 0, 0] -> mean 1/3 -> d = 2.25 * 3 = 6.75
    ctrl3 = GNMRController(1, GNMRConfig(max_active=1, alpha=10.0, beta=10.0, window=3))
    _, recs3 = run(ctrl3, [[4.0], [0.0], [0.0], [3.0]])
    same([r["delta"][0] for r in recs3], [1.0, 0.0, 0.0, 6.75])


def test_zero_gnmr_over_zero_window_mean_is_one():
    ctrl = GNMRController(1, GNMRConfig(window=1))
    _, recs = run(ctrl, [[4.0], [0.0], [0.0]])
    # t=3: hist [4, 0] mean 2 -> g 0; win [0] (window 1) mean 0 and g = 0 -> d = 1
    same([r["delta"][0] for r in recs], [1.0, 0.0, 1.0])


# ---------------------------------------------------------------------------- locks


LOCK_ROWS = [[1.0], [4.0], [1.0], [1.0], [1.0]]
# with alpha = 2 and beta = 100 only GNMR matters:
# t=1: g 1, R 0.5.  t=2: hist [1] -> g 4, R 2 -> risky.  t=3: hist [1, 4] mean 2.5 -> g 0.4.
# t=4: hist [1, 4, 1] mean 2 -> g 0.5.  t=5: hist [1, 4, 1, 1] mean 1.75 -> g 0.5714...


@pytest.mark.parametrize(
    "lock_steps, expected",
    [
        # selected while risky at t=2 -> L = lock_steps; each later decision keeps it while L > 0
        (0, [[], [0], [], [], []]),
        (1, [[], [0], [0], [], []]),  # held at t=3 (L 1 -> 0), expired at t=4
        (2, [[], [0], [0], [0], []]),  # held at t=3 and t=4, expired at t=5
    ],
)
def test_lock_holds_then_expires(lock_steps, expected):
    ctrl = GNMRController(1, GNMRConfig(max_active=1, lock_steps=lock_steps, alpha=2.0, beta=100.0))
    masks, recs = run(ctrl, LOCK_ROWS)
    same([r["gnmr"][0] for r in recs], [1.0, 4.0, 0.4, 0.5, 1 / 1.75])
    assert masks == expected
    assert ctrl.locks.tolist() == [0]


def test_lock_does_not_bypass_the_budget_and_unselected_lock_decays():
    ctrl = GNMRController(2, GNMRConfig(max_active=1, lock_steps=1, alpha=2.0, beta=100.0))
    masks, recs = run(ctrl, [[1.0, 1.0], [4.0, 1.0], [1.0, 3.0], [1.0, 1.0]])
    # t=2: unit 0 g 4 (R 2) -> selected, L0 = 1
    assert masks[1] == [0]
    # t=3: unit 0 g 0.4 (R 0.2) locked; unit 1 hist [1, 1] -> g 3 (R 1.5) risky
    #      candidates {0, 1}, top-1 -> unit 1; L1 = 1, L0 not selected -> 0
    same(recs[2]["risk"], [0.2, 1.5])
    assert recs[2]["candidates"] == 2 and masks[2] == [1]
    assert recs[2]["promoted"] == [1] and recs[2]["demoted"] == [0]
    # t=4: unit 0 g 0.5, L0 = 0 -> out; unit 1 hist [1, 1, 3] mean 5/3 -> g 0.6, L1 = 1 -> held
    same(recs[3]["gnmr"], [0.5, 0.6])
    assert masks[3] == [1] and recs[3]["candidates"] == 1
    assert ctrl.locks.tolist() == [0, 0]


# ---------------------------------------------------------------------------- recoverable units


@pytest.mark.parametrize("recoverable", [[0, 2], [True, False, True], torch.tensor([True, False, True])])
def test_monitored_only_unit_is_never_selected(recoverable):
    ctrl = GNMRController(3, GNMRConfig(max_active=1, alpha=2.0, beta=100.0), recoverable=recoverable)
    assert ctrl.recoverable.tolist() == [True, False, True]
    masks, recs = run(ctrl, [[1.0, 1.0, 1.0], [3.0, 10.0, 1.0]])
    # t=2: g = [3, 10, 1], R = [1.5, 5, 0.5]: unit 1 is the riskiest but has no recovery path
    same(recs[1]["risk"], [1.5, 5.0, 0.5])
    assert masks[1] == [0]
    assert recs[1]["candidates"] == 1
    assert recs[1]["over_gnmr"] == 2  # statistics still cover the monitored-only unit


def test_bad_recoverable_rejected():
    with pytest.raises(ValueError, match="recoverable"):
        GNMRController(3, recoverable=[0, 3])
    with pytest.raises(ValueError, match="recoverable"):
        GNMRController(3, recoverable=[True, False])
    with pytest.raises(ValueError, match="num_units"):
        GNMRController(0)


# ---------------------------------------------------------------------------- thresholds


def test_init_phase_alpha_switches_after_init_steps():
    cfg = GNMRConfig(max_active=1, alpha=1.1, alpha_init=1.5, beta=1.5, beta_init=None, init_steps=2)
    ctrl = GNMRController(1, cfg)
    masks, recs = run(ctrl, [[1.0], [1.3], [1.3]])
    assert [(r["alpha_t"], r["beta_t"]) for r in recs] == [(1.5, 1.5), (1.5, 1.5), (1.1, 1.5)]
    # t=2 (init phase): g = 1.3, d = 1.3; R = max(1.3/1.5, 1.3/1.5) = 0.8667 -> quiet
    same(recs[1]["gnmr"], [1.3])
    assert masks[1] == [] and recs[1]["over_gnmr"] == 0
    # t=3 (main phase): hist [1, 1.3] mean 1.15 -> g = 1.3/1.15 = 26/23 = 1.13043...;
    # win [1, 1.3] mean 1.15 -> d = (26/23) / (23/20) = 520/529 = 0.98299...;
    # R = max((26/23)/1.1, (520/529)/1.5) = 1.02767... -> risky under alpha = 1.1 (it would not be under 1.5)
    same(recs[2]["gnmr"], [26 / 23])
    same(recs[2]["delta"], [520 / 529])
    same(recs[2]["risk"], [26 / 23 / 1.1])
    assert masks[2] == [0] and recs[2]["over_gnmr"] == 1 and recs[2]["over_delta"] == 0


def test_init_phase_beta_and_none_means_main_value():
    cfg = GNMRConfig(max_active=1, alpha=100.0, alpha_init=None, beta=1.5, beta_init=3.0, init_steps=2)
    ctrl = GNMRController(1, cfg)
    masks, recs = run(ctrl, [[1.0], [2.0], [6.0]])
    # alpha_init None -> 100 in both phases; beta 3 while t <= 2, then 1.5
    assert [(r["alpha_t"], r["beta_t"]) for r in recs] == [(100.0, 3.0), (100.0, 3.0), (100.0, 1.5)]
    # t=2: g 2, d 2 -> d / 3 = 0.667 -> quiet, and 2 < beta_t = 3 is no exceedance
    assert masks[1] == [] and recs[1]["over_delta"] == 0
    # t=3: hist [1, 2] mean 1.5 -> g 4; win [1, 2] mean 1.5 -> d = 8/3; R = (8/3)/1.5 = 16/9
    same(recs[2]["gnmr"], [4.0])
    same(recs[2]["delta"], [8 / 3])
    same(recs[2]["risk"], [16 / 9])
    assert masks[2] == [0] and recs[2]["over_delta"] == 1


def test_default_alpha_init_is_unused_without_init_steps():
    assert GNMRConfig().thresholds(1) == (1.1, 1.5)
    assert GNMRConfig(init_steps=3).thresholds(3) == (1.5, 1.5)
    assert GNMRConfig(init_steps=3).thresholds(4) == (1.1, 1.5)


# ---------------------------------------------------------------------------- budget, warm-up


def test_max_active_zero_never_recovers():
    ctrl = GNMRController(3, GNMRConfig(max_active=0, alpha=0.5))
    masks, recs = run(ctrl, [[1.0, 2.0, 3.0], [9.0, NAN, 0.0], [1.0, 1.0, 1.0]])
    assert masks == [[], [], []]
    # everything is risky at t=1 (R = 1/0.5 = 2) yet nothing is selected
    assert recs[0]["candidates"] == 3
    assert all(r["hit_max"] for r in recs)  # |selected| = 0 = max_active
    assert ctrl.summary()["promotion_ratio"] == 0.0


def test_full_recovery_warmup_masks_and_statistics_as_if_no_warmup():
    rows = [[1.0, 1.0, 1.0], [4.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    base = dict(max_active=1, lock_steps=1, alpha=2.0, beta=100.0)
    rec = [True, True, False]
    # no warm-up: t=2 unit 0 g 4 -> [0] (L0 = 1); t=3 g 0.4, locked -> [0]; t=4 -> []
    plain = GNMRController(3, GNMRConfig(**base), recoverable=rec)
    plain_masks, plain_recs = run(plain, rows)
    assert plain.initial_mask().tolist() == [False, False, False]
    assert plain_masks == [[], [0], [0], []]

    # full_recovery_steps = 3: steps 1, 2, 3 run every recoverable unit; step(3) gives step 4's mask
    warm = GNMRController(3, GNMRConfig(**base, full_recovery_steps=3), recoverable=rec)
    assert warm.initial_mask().tolist() == [True, True, False]
    assert warm.active.tolist() == [True, True, False]
    warm_masks, warm_recs = run(warm, rows)
    # step(3)'s mask (for step 4) is the budgeted one: unit 0, still held by the lock it got at t=2
    # inside the warm-up, exactly as without a warm-up
    assert warm_masks == [[0, 1], [0, 1], [0], []]
    assert [r["selected"] for r in warm_recs] == [r["selected"] for r in plain_recs] == [[], [0], [0], []]
    assert [r["warmup"] for r in warm_recs] == [True, True, False, False]
    for a, b in zip(warm_recs, plain_recs):
        same(a["gnmr"], b["gnmr"])
        same(a["delta"], b["delta"])
    assert warm_recs[2]["demoted"] == [1] and warm_recs[3]["demoted"] == [0]

    # full_recovery_steps = 2: step(2) already returns the budgeted mask for step 3
    warm2 = GNMRController(3, GNMRConfig(**base, full_recovery_steps=2), recoverable=rec)
    masks2, recs2 = run(warm2, rows)
    assert masks2 == [[0, 1], [0], [0], []]
    assert recs2[1]["demoted"] == [1]
    # steps 1 and 2 ran both recoverable units, step 3 one, step 4 one: (2 + 2 + 1 + 1) / (4 * 2)
    assert warm2.summary()["promotion_ratio"] == 6 / 8


# ---------------------------------------------------------------------------- summary


def test_summary_by_hand():
    cfg = GNMRConfig(max_active=1, lock_steps=1, alpha=2.0, beta=1.5, window=2)
    ctrl = GNMRController(2, cfg)
    masks, recs = run(ctrl, [[1.0, 1.0], [4.0, 1.0], [1.0, NAN], [1.0, 1.0]])
    # t=1: g = d = 1, R = max(0.5, 0.667) = 0.667: quiet. In effect during step 1: [].
    # t=2: u0 g = 4, d = 4 (R 2.667), over both thresholds; u1 g = d = 1. -> [0], L0 = 1, cap hit.
    #      In effect during step 2: [].
    # t=3: u0 hist [1, 4] -> g 0.4; win [1, 4] -> d 0.16; R 0.2, locked. u1 NaN -> R inf.
    #      top-1 of {0, 1} -> [1] (promote 1, demote 0), L1 = 1, L0 -> 0; cap hit. In effect: [0].
    # t=4: u0 hist [1, 4, 1] -> g 0.5; win [4, 0.4] (window 2) -> d = 0.5 / 2.2; not a candidate.
    #      u1 hist [1, 1] -> g 1; win [1, 1] -> d 1; locked -> [1], L1 -> 0; cap hit. In effect: [1].
    assert masks == [[], [0], [1], [1]]
    same(recs[2]["gnmr"], [0.4, NAN])
    same(recs[2]["delta"], [0.16, NAN])
    same(recs[3]["delta"], [0.5 / 2.2, 1.0])
    assert [r["hit_max"] for r in recs] == [False, True, True, True]
    assert ctrl.summary() == {
        "steps": 4,
        "promotion_ratio": 2 / 8,  # active unit-steps 0 + 0 + 1 + 1 over 4 steps x 2 units
        "mean_active": 2 / 4,  # the same unit-steps per step
        "hit_max_rate": 3 / 4,
        "gnmr_exceedance_rate": 1 / 8,  # only u0 at t=2 (NaN does not exceed)
        "delta_exceedance_rate": 1 / 8,
        "switches": 3,  # +0 at t=2, +1 -0 at t=3
        "promotions": 2,
        "demotions": 1,
        "nonfinite": 1,
    }


def test_summary_before_any_step_is_zero():
    s = GNMRController(3).summary()
    assert s["steps"] == 0 and s["promotion_ratio"] == 0.0 and s["switches"] == 0


# ---------------------------------------------------------------------------- record, state, inputs


def test_record_is_json_safe_and_has_the_contract_keys():
    ctrl = GNMRController(3, GNMRConfig(max_active=2))
    run(ctrl, [[1.0, 2.0, 3.0], [NAN, 0.0, 30.0]])
    rec = ctrl.last_record
    keys = {"step", "active", "promoted", "demoted", "over_gnmr", "over_delta", "candidates", "hit_max",
            "nonfinite", "gnmr", "delta", "risk"}
    assert keys <= set(rec)
    back = json.loads(json.dumps(rec))
    assert back["active"] == rec["active"] == [0, 2]
    assert math.isnan(back["gnmr"][0]) and back["risk"][0] == INF
    assert all(isinstance(rec[k], int) and not isinstance(rec[k], bool)
               for k in ("step", "over_gnmr", "over_delta", "candidates", "nonfinite"))
    assert isinstance(rec["hit_max"], bool)


def test_state_dict_round_trip_mid_sequence_through_json():
    cfg = GNMRConfig(max_active=2, lock_steps=2, alpha=1.2, window=3, init_steps=2, full_recovery_steps=1)
    rows = [[1.0, 2.0, 0.0, 3.0], [1.5, NAN, 0.0, 3.0], [4.0, 2.0, 1.0, 1.0], [0.2, 2.5, 1.0, INF],
            [1.0, 7.0, 0.0, 3.0], [3.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 9.0]]
    a = GNMRController(4, cfg, recoverable=[0, 1, 3])
    run(a, rows[:3])
    text = json.dumps(a.state_dict(), allow_nan=False)  # plain JSON: no NaN/Infinity inside
    b = GNMRController(4, cfg, recoverable=[0, 1, 3])
    b.load_state_dict(json.loads(text))
    assert b.last_record is None and b.t == 3 and b.active.tolist() == a.active.tolist()
    ma, ra = run(a, rows[3:])
    mb, rb = run(b, rows[3:])
    assert ma == mb and any(ma)  # something was selected after the resume
    for x, y in zip(ra, rb):
        for key in ("gnmr", "delta", "risk"):
            assert json.dumps(x[key]) == json.dumps(y[key])  # bit-identical floats
    assert a.summary() == b.summary()
    c = GNMRController.from_state_dict(json.loads(text))
    assert run(c, rows[3:])[0] == ma


# States written by the controller before its step was reworked for speed (same rows as below, as
# JSON): they must still load, and the current controller must write them byte for byte.
SAVED_STATES = {
    1: '{"version": 1, "num_units": 4, "config": {"max_active": 2, "lock_steps": 1, "alpha": 1.1, '
       '"alpha_init": 1.5, "beta": 1.5, "beta_init": null, "window": 3, "init_steps": 2, "full_recovery_steps": 2}, '
       '"recoverable": [true, true, false, true], "t": 6, "active": [false, true, false, true], '
       '"locks": [0, 0, 0, 1], "norm_sum": [8.600000023841858, 17.5, 5.0, 7.200000047683716], '
       '"norm_count": [6, 5, 6, 5], "gnmr_window": [[2.571428571428571, 0.6153846153846154, 0.7333333492279053], '
       '[4.5, 0.46153846153846156, 0.6666666666666666], [0.0, 32.0, 0.5555555555555556], '
       '[1.2000000476837158, 0.9374999860301616, 2.8571428247049555]], "gnmr_count": [6, 5, 5, 5], '
       '"totals": {"gnmr_exceed": 7, "delta_exceed": 6, "nonfinite": 2, "active_unit_steps": 14, '
       '"promotions": 3, "demotions": 4, "hit_max_steps": 5}}',
    2: '{"version": 1, "num_units": 4, "config": {"max_active": 2, "lock_steps": 2, "alpha": 1.1, '
       '"alpha_init": 1.5, "beta": 1.5, "beta_init": null, "window": 3, "init_steps": 2, "full_recovery_steps": 2}, '
       '"recoverable": [true, true, false, true], "t": 6, "active": [true, false, false, true], '
       '"locks": [0, 1, 0, 2], "norm_sum": [8.600000023841858, 17.5, 5.0, 7.200000047683716], '
       '"norm_count": [6, 5, 6, 5], "gnmr_window": [[2.571428571428571, 0.6153846153846154, 0.7333333492279053], '
       '[4.5, 0.46153846153846156, 0.6666666666666666], [0.0, 32.0, 0.5555555555555556], '
       '[1.2000000476837158, 0.9374999860301616, 2.8571428247049555]], "gnmr_count": [6, 5, 5, 5], '
       '"totals": {"gnmr_exceed": 7, "delta_exceed": 6, "nonfinite": 2, "active_unit_steps": 14, '
       '"promotions": 4, "demotions": 5, "hit_max_steps": 5}}',
}


@pytest.mark.parametrize("lock_steps", [1, 2])
def test_states_saved_by_earlier_versions_load_and_are_reproduced(lock_steps):
    # float32 norms, a NaN and an Inf, zero norms, a monitored-only unit, the warm-up, both phases
    rows = [[1.0, 2.0, 0.0, 1.0], [1.5, 2.0, 0.0, NAN], [1.0, 9.0, 0.5, 1.0], [3.0, 2.0, 0.0, 1.2],
            [1.0, INF, 4.0, 1.0], [1.1, 2.5, 0.5, 3.0]]
    more = [[1.0, 2.0, 0.5, 1.0], [5.0, 2.0, 0.5, 1.0], [1.0, 2.0, 3.0, 1.0], [1.0, 0.0, 0.5, 9.0]]
    cfg = GNMRConfig(max_active=2, lock_steps=lock_steps, window=3, init_steps=2, full_recovery_steps=2)
    a = GNMRController(4, cfg, recoverable=[0, 1, 3])
    for row in rows:
        a.step(torch.tensor(row))  # float32, as a callback gathers them
    assert json.dumps(a.state_dict()) == SAVED_STATES[lock_steps]
    b = GNMRController.from_state_dict(json.loads(SAVED_STATES[lock_steps]))
    assert b.locks.tolist() == a.locks.tolist() == json.loads(SAVED_STATES[lock_steps])["locks"]
    for row in more:
        assert a.step(torch.tensor(row)).tolist() == b.step(torch.tensor(row)).tolist()
        assert json.dumps(a.last_record) == json.dumps(b.last_record)
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


def test_load_state_dict_rejects_mismatches():
    state = GNMRController(4, GNMRConfig(max_active=2)).state_dict()
    with pytest.raises(ValueError, match="num_units"):
        GNMRController(5, GNMRConfig(max_active=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="max_active"):
        GNMRController(4, GNMRConfig(max_active=3)).load_state_dict(state)
    with pytest.raises(ValueError, match="recoverable"):
        GNMRController(4, GNMRConfig(max_active=2), recoverable=[0]).load_state_dict(state)


@pytest.mark.parametrize("bad", [torch.ones(3), torch.ones(4, 1), torch.ones(2, 2), torch.tensor(1.0)])
def test_norms_shape_is_validated(bad):
    ctrl = GNMRController(4)
    with pytest.raises(ValueError, match=r"shape \[num_units\] = \[4\]"):
        ctrl.step(bad)
    assert ctrl.t == 0


def test_negative_norm_rejected_and_state_untouched():
    ctrl = GNMRController(2)
    ctrl.step(torch.tensor([1.0, 1.0]))
    before = json.dumps(ctrl.state_dict())
    with pytest.raises(ValueError, match=">= 0"):
        ctrl.step(torch.tensor([1.0, -0.5]))
    assert json.dumps(ctrl.state_dict()) == before


@pytest.mark.parametrize("bad", [[NAN, -1.0, 1.0], [-INF, 1.0, NAN], [1.0, 1.0, -1e-300]])
def test_negative_norm_found_beside_nonfinite_ones(bad):
    ctrl = GNMRController(3)
    ctrl.step(torch.tensor([1.0, 2.0, 3.0]))
    before = json.dumps(ctrl.state_dict())
    with pytest.raises(ValueError, match="1 negative value"):
        ctrl.step(torch.tensor(bad, dtype=torch.float64))
    assert json.dumps(ctrl.state_dict()) == before


def test_integer_norms_and_the_callers_tensor_untouched():
    ctrl = GNMRController(3, GNMRConfig(max_active=1, alpha=2.0))
    ctrl.step(torch.tensor([1, 1, 1]))
    assert ctrl.step(torch.tensor([1, 4, 1])).tolist() == [False, True, False]
    norms = torch.tensor([-0.0, 1.0, 1.0], dtype=torch.float64)
    ctrl.step(norms)
    assert math.copysign(1.0, float(norms[0])) == -1.0  # the controller worked on its own copy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_float_dtype_and_a_copy_is_returned(dtype):
    ctrl = GNMRController(3, GNMRConfig(max_active=1, alpha=2.0))
    ctrl.step(torch.tensor([1.0, 1.0, 1.0], dtype=dtype, requires_grad=dtype.is_floating_point))
    mask = ctrl.step(torch.tensor([1.0, 4.0, 1.0], dtype=dtype))
    assert mask.tolist() == [False, True, False]
    mask[:] = False  # the caller's copy; the controller's state must not change
    assert ctrl.active.tolist() == [False, True, False]


@pytest.mark.slow  # a fresh interpreter importing torch
def test_core_modules_import_no_heavy_dependency():
    code = (
        "import sys, gnmr_hf.core.controller, gnmr_hf.core.policies, gnmr_hf.core.oracle\n"
        "bad = [m for m in ('transformers', 'peft', 'bitsandbytes', 'lm_eval') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- config


BAD_CONFIG_VALUES = [
    ("max_active", -1), ("max_active", 1.5), ("max_active", True), ("max_active", "3"), ("max_active", None),
    ("lock_steps", -1), ("lock_steps", 2.0), ("lock_steps", False),
    ("alpha", 0), ("alpha", -1.0), ("alpha", INF), ("alpha", NAN), ("alpha", True), ("alpha", "1.1"),
    ("alpha", None),
    ("alpha_init", 0.0), ("alpha_init", -2.0), ("alpha_init", INF), ("alpha_init", NAN), ("alpha_init", False),
    ("beta", 0.0), ("beta", -1.5), ("beta", INF), ("beta", NAN), ("beta", None),
    ("beta_init", 0.0), ("beta_init", -1.0), ("beta_init", NAN), ("beta_init", INF), ("beta_init", True),
    ("window", 0), ("window", -1), ("window", 2.5), ("window", True), ("window", None),
    ("init_steps", -1), ("init_steps", 1.0), ("init_steps", True),
    ("full_recovery_steps", -1), ("full_recovery_steps", 0.5), ("full_recovery_steps", False),
]


@pytest.mark.parametrize("field, value", BAD_CONFIG_VALUES)
def test_invalid_config_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GNMRConfig\.{field} "):
        GNMRConfig(**{field: value})


def test_config_defaults_edges_and_dict_round_trip():
    cfg = GNMRConfig()
    assert cfg.to_dict() == dict(max_active=10, lock_steps=1, alpha=1.1, alpha_init=1.5, beta=1.5,
                                 beta_init=None, window=5, init_steps=0, full_recovery_steps=0)
    edge = GNMRConfig(max_active=0, lock_steps=0, alpha=2, alpha_init=None, window=1, beta_init=0.5)
    assert isinstance(edge.alpha, float) and edge.alpha == 2.0
    assert GNMRConfig.from_dict(json.loads(json.dumps(edge.to_dict()))) == edge
    with pytest.raises(ValueError, match="unknown field"):
        GNMRConfig.from_dict({"max_active": 3, "maxO": 3})
