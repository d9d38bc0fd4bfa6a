"""Trigger policies (gnmr_hf.core.policies): the protocol, the budget, every baseline on hand-worked
sequences (static warm-up, GSNR, random, random at a mean budget, fixed set, gap profile), state."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gnmr_hf.core.controller import GNMRConfig, GNMRController
from gnmr_hf.core.policies import (
    POLICIES,
    GapPolicy,
    GapProfilePolicy,
    GSNRPolicy,
    MicrobatchPolicy,
    RandomBudgetPolicy,
    RandomPolicy,
    StaticSensitivityPolicy,
    StaticSetPolicy,
    TriggerPolicy,
    edge_units,
    make_policy,
    most_active_units,
)

U = 10


def _norm_stream(steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        n = 1.0 + 0.3 * torch.rand(U, generator=g, dtype=torch.float64)
        if t % 7 == 6:  # occasional spikes so GNMR has something to react to
            n[t % U] *= 4
        out.append(n)
    return out


def _gap_stream(t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + t)
    return torch.rand(U, generator=g, dtype=torch.float64)


def _drive(policy, steps=30, seed=0):
    masks = [policy.initial_mask()]
    for n in _norm_stream(steps, seed):
        t = policy.summary()["steps"] + 1
        if isinstance(policy, GapPolicy) and policy.wants_gap(t):
            policy.observe_gap(_gap_stream(t, seed))
        if getattr(policy, "needs_microbatch_norms", False):
            # two micro-batches whose contributions add up to n: ||d1||^2 + ||d2||^2 with d1 = d2 = n/2
            # would be noise-free; use unequal halves so the variance is positive
            policy.observe_microbatch((0.7 * n) ** 2)
            policy.observe_microbatch((0.3 * n) ** 2 + 0.01)
        masks.append(policy.step(n))
    return masks


# the options each policy needs; the others ignore them
OPTIONS = {"units": [0, 5, 9], "mean_active": 2.5, "profile_steps": 3, "refresh_every": 4}


def test_every_policy_satisfies_the_protocol():
    cfg = GNMRConfig(max_active=3)
    for name in POLICIES:
        policy = make_policy(name, U, cfg, warmup_steps=5, **OPTIONS)
        assert isinstance(policy, TriggerPolicy), name
        assert isinstance(policy, MicrobatchPolicy) == (name == "gsnr"), name
        assert isinstance(policy, GapPolicy) == (name == "gap_profile"), name
    assert isinstance(GNMRController(U), TriggerPolicy)

    class NoSummary:
        num_units = U
        last_record = None

        def initial_mask(self):
            return torch.zeros(U, dtype=torch.bool)

        def step(self, norms):
            return torch.zeros(U, dtype=torch.bool)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert not isinstance(NoSummary(), TriggerPolicy)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_stays_within_budget(name):
    cfg = GNMRConfig(max_active=3, alpha=1.1, alpha_init=1.5, beta=1.3, window=5)
    recoverable = [True] * U
    recoverable[4] = False  # a monitored-only unit must never be selected
    policy = make_policy(name, U, cfg, recoverable=recoverable, warmup_steps=5, seed=3, **OPTIONS)
    assert isinstance(policy, TriggerPolicy)
    masks = _drive(policy)
    for m in masks:
        assert m.dtype == torch.bool and m.shape == (U,)
        assert int(m.sum()) <= 3 and not m[4]
    s = policy.summary()
    assert s["steps"] == 30
    for key in ("promotion_ratio", "hit_max_rate", "switches", "gnmr_exceedance_rate", "delta_exceedance_rate"):
        assert key in s
    assert 0 < s["promotion_ratio"] <= 3 / 9
    assert s["mean_active"] == pytest.approx(s["promotion_ratio"] * 9)
    assert s["switches"] > 0 or name == "static_set"
    rec = policy.last_record
    for key in ("step", "active", "promoted", "demoted", "over_gnmr", "over_delta", "candidates", "hit_max",
                "nonfinite", "gnmr", "delta", "risk"):
        assert key in rec
    assert rec["active"] == masks[-1].nonzero().flatten().tolist()
    json.dumps(policy.state_dict())  # JSON-safe


def test_full_budget_rankers_fill_every_step():
    for policy in (GSNRPolicy(U, 4), RandomPolicy(U, 4, seed=0)):
        masks = _drive(policy)
        assert all(int(m.sum()) == 4 for m in masks[1:])
        assert policy.summary()["hit_max_rate"] == 1.0
        # promotion ratio counts the masks in effect during steps 1..30: step 1 has none active
        assert policy.summary()["promotion_ratio"] == pytest.approx(29 * 4 / (30 * U))


def test_static_never_changes_after_warmup_and_picks_top_mean_gnmr():
    W = 4
    p = StaticSensitivityPolicy(6, max_active=5, warmup_steps=W, fraction=0.25)
    # step 1: GNMR = 1 everywhere. Steps 2-4: unit 2 and unit 5 grow, unit 0 shrinks.
    seq = [
        [1, 1, 1, 1, 1, 1],
        [0.5, 1, 3, 1, 1, 2],
        [0.5, 1, 3, 1, 1, 2],
        [0.5, 1, 3, 1, 1, 2],
    ]
    masks = []
    for t, n in enumerate(seq, 1):
        assert p.in_warmup
        m = p.step(torch.tensor(n, dtype=torch.float64))
        masks.append(m)
        if t < W:
            assert not m.any()  # warm-up decisions run in BF16 anyway; nothing is fixed yet
    assert not p.in_warmup
    # by hand: unit 2 GNMR = 1, 3, 3/((1+3)/2)=1.5, 3/((1+3+3)/3)=9/7 -> mean 1.6964
    #          unit 5 GNMR = 1, 2, 2/1.5=1.333, 2/(5/3)=1.2 -> mean 1.3833; the others <= 1
    # top ceil(0.25 * 6) = 2 units, within max_active = 5
    assert masks[-1].nonzero().flatten().tolist() == [2, 5]
    mean2 = (1 + 3 + 1.5 + 9 / 7) / 4
    assert p.last_record["risk"][2] == pytest.approx(mean2)
    fixed = masks[-1].clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = torch.rand(6, generator=g, dtype=torch.float64) * 10  # wild norms: the set must not move
        n[0] = 100.0
        assert torch.equal(p.step(n), fixed)
    s = p.summary()
    assert s["switches"] == 2 and s["promotions"] == 2 and s["demotions"] == 0


def test_static_capped_by_max_active():
    p = StaticSensitivityPolicy(20, max_active=2, warmup_steps=2, fraction=0.25)
    p.step(torch.ones(20))
    m = p.step(torch.arange(1, 21, dtype=torch.float64))
    assert m.nonzero().flatten().tolist() == [18, 19]  # 25 % would be 5 units, the cap is 2


def test_gsnr_by_hand():
    # 3 units, K = 2 micro-batches. unit 0: d = (1, 1) -> ||G|| = 2, sum sq = 2 -> var = 0 -> GSNR inf
    # unit 1: d = (3, 1) in one dimension -> G = 4; mean 2, var = ((3-2)^2 + (1-2)^2)/1 = 2 -> GSNR 4/2 = 2
    # unit 2: d = (1, -1) -> G = 0, sum sq = 2 -> signal 0 -> GSNR 0
    p = GSNRPolicy(3, max_active=2)
    assert p.needs_microbatch_norms
    p.observe_microbatch(torch.tensor([1.0, 9.0, 1.0]))
    p.observe_microbatch(torch.tensor([1.0, 1.0, 1.0]))
    m = p.step(torch.tensor([2.0, 4.0, 0.0]))
    r = p.last_record["risk"]
    assert r[0] == math.inf and r[1] == pytest.approx(2.0) and r[2] == pytest.approx(0.0)
    assert m.tolist() == [False, True, True]  # the two lowest GSNR
    # formula with K = 3: ||G||^2/9 / ((S - ||G||^2/3)/2)
    assert GSNRPolicy.gsnr(3.0, 5.0, 3) == pytest.approx((9 / 9) / ((5 - 3) / 2))
    # the window resets after each step
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        p.step(torch.tensor([2.0, 4.0, 0.0]))


def test_gsnr_nonfinite_ranks_first():
    p = GSNRPolicy(3, max_active=1)
    for _ in range(2):
        p.observe_microbatch(torch.tensor([1.0, 1.0, float("nan")]))
    assert p.step(torch.tensor([0.1, 0.1, float("nan")])).tolist() == [False, False, True]


def test_random_is_seeded_and_varies():
    a = _drive(RandomPolicy(U, 3, seed=7))
    b = _drive(RandomPolicy(U, 3, seed=7))
    c = _drive(RandomPolicy(U, 3, seed=8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert len({tuple(m.tolist()) for m in a[1:]}) > 5  # it really re-draws every step


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "gnmr"])
def test_state_round_trip_is_exact(name):
    cfg = GNMRConfig(max_active=3)
    p = make_policy(name, U, cfg, warmup_steps=4, seed=1, **OPTIONS)
    _drive(p, steps=12)
    sd = json.loads(json.dumps(p.state_dict(), allow_nan=False))
    q = make_policy(name, U, cfg, warmup_steps=4, seed=1, **OPTIONS)
    q.load_state_dict(sd)
    assert q.initial_mask().tolist() == p.initial_mask().tolist()
    assert q.summary() == p.summary()
    tail_p = _drive(p, steps=10, seed=5)[1:]
    tail_q = _drive(q, steps=10, seed=5)[1:]
    assert all(torch.equal(x, y) for x, y in zip(tail_p, tail_q))
    with pytest.raises(ValueError):
        make_policy("random" if name != "random" else "gsnr", U, cfg, warmup_steps=4).load_state_dict(sd)
    assert len({tuple(m.tolist()) for m in tail_p}) > 1 or name in ("adapt", "static_set")


def test_baseline_gnmr_statistics_match_controller():
    cfg = GNMRConfig(max_active=2, alpha=1.1, alpha_init=1.6, beta=1.3, beta_init=1.4, window=3, init_steps=6)
    ctrl = GNMRController(U, cfg)
    rnd = make_policy("random", U, cfg)
    for n in _norm_stream(25, seed=2):
        ctrl.step(n)
        rnd.step(n)
        for key in ("gnmr", "delta"):  # one implementation of GNMR: the same bits
            assert [v.hex() for v in rnd.last_record[key]] == [v.hex() for v in ctrl.last_record[key]]
        assert rnd.last_record["over_gnmr"] == ctrl.last_record["over_gnmr"]
    for key in ("gnmr_exceedance_rate", "delta_exceedance_rate"):
        assert rnd.summary()[key] == pytest.approx(ctrl.summary()[key])
    assert ctrl.summary()["gnmr_exceedance_rate"] > 0


def test_make_policy_gnmr_is_the_controller_and_errors():
    cfg = GNMRConfig(max_active=2)
    assert isinstance(make_policy("gnmr", U, cfg), GNMRController)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_policy("adapt", U, cfg)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("jacobian", U, cfg)
    with pytest.raises(ValueError, match="max_active"):
        RandomPolicy(U, -1)
    with pytest.raises(ValueError, match=r"\[num_units\] = \[10\]"):
        RandomPolicy(U, 1).step(torch.ones(3))
    for name, missing in (("random_budget", "mean_active"), ("static_set", "units"), ("gap_profile", "profile_steps")):
        with pytest.raises(ValueError, match=missing):
            make_policy(name, U, cfg)
    with pytest.raises(ValueError, match="unknown argument"):
        RandomPolicy(U, 1, max_steps=3)
    with pytest.raises(ValueError, match="GNMRConfig.window"):
        GSNRPolicy(U, 1, window=0)


def test_baseline_statistics_come_from_an_inner_controller_on_nonfinite_norms():
    # the same inner controller, so NaN / Inf norms and zero histories are handled identically
    cfg = GNMRConfig(max_active=1, window=2)
    ctrl, pol = GNMRController(3, cfg), make_policy("static_set", 3, cfg, units=[1])
    for row in ([0.0, 1.0, 2.0], [0.0, math.nan, 2.0], [1.0, 1.0, math.inf], [0.0, 3.0, 2.0]):
        ctrl.step(torch.tensor(row))
        pol.step(torch.tensor(row))
        for key in ("gnmr", "delta"):
            assert [float(v).hex() for v in pol.last_record[key]] == [float(v).hex() for v in ctrl.last_record[key]]
        assert pol.last_record["nonfinite"] == ctrl.last_record["nonfinite"]
    assert pol.summary()["nonfinite"] == ctrl.summary()["nonfinite"] == 2
    assert pol.summary()["gnmr_exceedance_rate"] == ctrl.summary()["gnmr_exceedance_rate"] > 0


# ---------------------------------------------------------------------------- random at a mean budget


def test_random_budget_schedule_by_hand():
    p = RandomBudgetPolicy(U, 2.4, seed=0)
    # k_s = floor(2.4 s) - floor(2.4 (s - 1)): 2, 2, 3, 2, 3 (sum 12 = 2.4 * 5)
    assert [p.count(s) for s in range(1, 6)] == [2, 2, 3, 2, 3]
    masks = _drive(p, steps=9)  # the masks for steps 1..10
    assert [int(m.sum()) for m in masks] == [2, 2, 3, 2, 3, 2, 2, 3, 2, 3]
    # steps 1..9 were in effect for the 9 steps taken: floor(2.4 * 9) = 21 unit-steps
    assert p.summary()["mean_active"] == pytest.approx(21 / 9)
    assert p.summary()["hit_max_rate"] == pytest.approx(4 / 9)  # max_active = ceil(2.4) = 3, filled at t = 3, 5, 8, 10
    # 0.29 is 29/100 exactly, not the binary double below it: 29 unit-steps in the first 100 steps
    q = RandomBudgetPolicy(U, 0.29)
    assert sum(q.count(s) for s in range(1, 101)) == 29
    assert sum(RandomBudgetPolicy(U, 0.0).count(s) for s in range(1, 50)) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 100 * U), st.integers(1, 300))
def test_random_budget_schedule_holds_the_mean(hundredths, steps):
    m = hundredths / 100  # a float like a summary's mean; read as the exact hundredths
    p = RandomBudgetPolicy(U, m)
    counts = [p.count(s) for s in range(1, steps + 1)]
    assert sum(counts) == hundredths * steps // 100  # floor(m * T), exactly
    assert set(counts) <= {math.floor(m), math.ceil(m)}


def test_random_budget_matches_a_gnmr_run_and_draws_recoverable_units_only():
    cfg = GNMRConfig(max_active=3, alpha=1.05, beta=1.2)
    gnmr = GNMRController(U, cfg)
    _drive(gnmr, steps=40)
    m = gnmr.summary()["mean_active"]
    assert 0 < m < 3
    recoverable = [b != 2 for b in range(U)]
    p = make_policy("random_budget", U, cfg, recoverable=recoverable, mean_active=m, seed=4)
    masks = _drive(p, steps=40)
    assert abs(p.summary()["mean_active"] - m) <= 1 / 40
    assert not any(bool(mask[2]) for mask in masks)
    assert all(math.floor(m) <= int(mask.sum()) <= math.ceil(m) for mask in masks)
    assert len({tuple(mask.tolist()) for mask in masks}) > 10  # a fresh draw every step
    same = _drive(make_policy("random_budget", U, cfg, recoverable=recoverable, mean_active=m, seed=4), steps=40)
    assert all(torch.equal(a, b) for a, b in zip(masks, same))


def test_random_budget_errors():
    with pytest.raises(ValueError, match="mean_active"):
        RandomBudgetPolicy(U, -1.0)
    with pytest.raises(ValueError, match="mean_active"):
        RandomBudgetPolicy(U, math.nan)
    with pytest.raises(ValueError, match="budget"):
        RandomBudgetPolicy(U, 3.5, max_active=3)
    with pytest.raises(ValueError, match="recoverable units=1"):
        RandomBudgetPolicy(2, 1.5, recoverable=[True, False])


# ---------------------------------------------------------------------------- fixed set


def test_static_set_holds_its_units_from_step_one():
    p = StaticSetPolicy(6, units=[4, 1], recoverable=[True, True, False, True, True, True])
    assert p.initial_mask().nonzero().flatten().tolist() == [1, 4]
    masks = _drive_rows(p, [[1.0] * 6, [5.0] * 6, [1.0, 9.0, 1.0, 1.0, 1.0, 1.0]])
    assert all(m.nonzero().flatten().tolist() == [1, 4] for m in masks)
    s = p.summary()
    assert s["promotion_ratio"] == pytest.approx(2 / 5) and s["mean_active"] == 2.0
    assert s["switches"] == 0 and s["hit_max_rate"] == 1.0
    assert p.last_record["active"] == [1, 4] and p.last_record["promoted"] == []


def test_static_set_errors():
    with pytest.raises(ValueError, match="no recovery path"):
        StaticSetPolicy(3, units=[2], recoverable=[True, True, False])
    with pytest.raises(ValueError, match="distinct"):
        StaticSetPolicy(3, units=[1, 1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        StaticSetPolicy(3, units=[3])
    with pytest.raises(ValueError, match="max_active=1"):
        make_policy("static_set", 3, GNMRConfig(max_active=1), units=[0, 2])


def test_unit_set_helpers_by_hand():
    # unit 3 active at 3 steps, units 0 and 5 at 2 (tie: lower index first), unit 1 at 1
    trace = [[3], [0, 3], [3, 5], [0, 5, 1], []]
    assert most_active_units(trace, 6, 2) == [0, 3]
    assert most_active_units(trace, 6, 3) == [0, 3, 5]
    assert edge_units(30, 7) == [0, 1, 2, 3, 27, 28, 29]
    assert edge_units(5, 1) == [0] and edge_units(5, 0) == []
    with pytest.raises(ValueError, match="outside"):
        most_active_units([[6]], 6, 1)
    with pytest.raises(ValueError, match="k must lie"):
        edge_units(4, 5)


# ---------------------------------------------------------------------------- gap profile


def _drive_rows(policy, rows):
    return [policy.step(torch.tensor(r, dtype=torch.float64)) for r in rows]


def test_gap_profile_by_hand():
    p = GapProfilePolicy(4, k=2, profile_steps=2, refresh_every=3, gap_window=2)
    assert [p.wants_gap(s) for s in range(1, 10)] == [True, True, False, False, True, False, False, True, False]
    ones = torch.ones(4)
    p.observe_gap(torch.tensor([1.0, 3.0, 2.0, 0.0]))
    assert p.step(ones).nonzero().flatten().tolist() == [1, 2]  # top 2 of [1, 3, 2, 0]
    p.observe_gap(torch.tensor([5.0, 1.0, 2.0, 0.0]))
    # window mean [3, 2, 2, 0]: unit 0, then the tie at 2 goes to the lower index
    assert p.step(ones).nonzero().flatten().tolist() == [0, 1]
    assert p.last_record["risk"] == [3.0, 2.0, 2.0, 0.0]
    for _ in range(2):  # steps 3 and 4 measure nothing: the set holds
        assert p.step(ones).nonzero().flatten().tolist() == [0, 1]
    p.observe_gap(torch.tensor([0.0, 0.0, 9.0, 9.0]))
    # window of 2: [5, 1, 2, 0] and [0, 0, 9, 9] -> [2.5, 0.5, 5.5, 4.5]
    assert p.step(ones).nonzero().flatten().tolist() == [2, 3]
    s = p.summary()
    assert s["switches"] == 2 + 2 + 4 and s["mean_active"] == pytest.approx(8 / 5)


def test_gap_profile_fixed_after_profile_and_previous_step_variant():
    fixed = GapProfilePolicy(3, k=1, profile_steps=2)
    assert [fixed.wants_gap(s) for s in (1, 2, 3, 50)] == [True, True, False, False]
    fixed.observe_gap([0.5, 0.1, 0.2])
    fixed.step(torch.ones(3))
    fixed.observe_gap([0.1, 0.1, 0.6])
    # mean over both: [0.3, 0.1, 0.4]
    assert all(fixed.step(torch.ones(3)).tolist() == [False, False, True] for _ in range(3))
    prev = GapProfilePolicy(3, k=1, profile_steps=1, refresh_every=1)
    chosen = []
    for gaps in ([0.5, 0.1, 0.2], [0.1, 0.7, 0.2], [0.1, 0.1, math.nan]):
        prev.observe_gap(gaps)
        chosen.append(prev.step(torch.ones(3)).nonzero().flatten().tolist())
    assert chosen == [[0], [1], [2]]  # each step the previous gap; a NaN gap ranks as the largest
    json.dumps(prev.state_dict(), allow_nan=False)


def test_gap_profile_errors():
    p = GapProfilePolicy(3, k=1, profile_steps=1, recoverable=[True, False, True])
    with pytest.raises(ValueError, match="observe_gap"):
        p.step(torch.ones(3))
    assert p.summary()["steps"] == 0  # the failed call changed nothing
    with pytest.raises(ValueError, match=">= 0"):
        p.observe_gap([0.1, -0.2, 0.3])
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        p.observe_gap([0.1, 0.2])
    p.observe_gap([0.1, 0.9, 0.3])
    with pytest.raises(ValueError, match="already observed"):
        p.observe_gap([0.1, 0.9, 0.3])
    assert p.step(torch.ones(3)).tolist() == [False, False, True]  # unit 1 is not recoverable
    with pytest.raises(ValueError, match="profile_steps"):
        GapProfilePolicy(3, k=1, profile_steps=0)
    with pytest.raises(ValueError, match="refresh_every"):
        GapProfilePolicy(3, k=1, profile_steps=1, refresh_every=0)
