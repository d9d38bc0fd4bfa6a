"""Trigger policies (gnmr_hf.core.policies): budget, static warm-up, GSNR by hand, seeded random, state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController
from gnmr_hf.core.policies import (
    POLICIES,
    GSNRPolicy,
    RandomPolicy,
    StaticSensitivityPolicy,
    make_policy,
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


def _drive(policy, steps=30, seed=0):
    masks = [policy.initial_mask()]
    for n in _norm_stream(steps, seed):
        if getattr(policy, "needs_microbatch_norms", False):
            # two micro-batches whose contributions add up to n: ||d1||^2 + ||d2||^2 with d1 = d2 = n/2
            # would be noise-free; use unequal halves so the variance is positive
            policy.observe_microbatch((0.7 * n) ** 2)
            policy.observe_microbatch((0.3 * n) ** 2 + 0.01)
        masks.append(policy.step(n))
    return masks


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_stays_within_budget(name):
    cfg = GNMRConfig(max_active=3, alpha=1.1, alpha_init=1.5, beta=1.3, window=5)
    recoverable = [True] * U
    recoverable[4] = False  # a monitored-only unit must never be selected
    policy = make_policy(name, U, cfg, recoverable=recoverable, warmup_steps=5, seed=3)
    masks = _drive(policy)
    for m in masks:
        assert m.dtype == torch.bool and m.shape == (U,)
        assert int(m.sum()) <= 3 and not m[4]
    s = policy.summary()
    assert s["steps"] == 30
    for key in ("promotion_ratio", "hit_max_rate", "switches", "gnmr_exceedance_rate", "delta_exceedance_rate"):
        assert key in s
    assert 0 < s["promotion_ratio"] <= 3 / 9 and s["switches"] > 0
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


@pytest.mark.parametrize("name", ["adapt", "gsnr", "random"])
def test_state_round_trip_is_exact(name):
    cfg = GNMRConfig(max_active=3)
    p = make_policy(name, U, cfg, warmup_steps=4, seed=1)
    _drive(p, steps=12)
    sd = json.loads(json.dumps(p.state_dict()))
    q = make_policy(name, U, cfg, warmup_steps=4, seed=1)
    q.load_state_dict(sd)
    assert q.summary() == p.summary()
    tail_p = _drive(p, steps=10, seed=5)[1:]
    tail_q = _drive(q, steps=10, seed=5)[1:]
    assert all(torch.equal(x, y) for x, y in zip(tail_p, tail_q))
    with pytest.raises(ValueError):
        make_policy("random" if name != "random" else "gsnr", U, cfg, warmup_steps=4).load_state_dict(sd)


def test_baseline_gnmr_statistics_match_controller():
    cfg = GNMRConfig(max_active=2, alpha=1.1, alpha_init=1.6, beta=1.3, beta_init=1.4, window=3, init_steps=6)
    ctrl = GNMRController(U, cfg)
    rnd = make_policy("random", U, cfg)
    for n in _norm_stream(25, seed=2):
        ctrl.step(n)
        rnd.step(n)
        torch.testing.assert_close(torch.tensor(rnd.last_record["gnmr"]), torch.tensor(ctrl.last_record["gnmr"]),
                                   rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.tensor(rnd.last_record["delta"]), torch.tensor(ctrl.last_record["delta"]),
                                   rtol=1e-12, atol=0)
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
    with pytest.raises(ValueError, match="expected 10 norms"):
        RandomPolicy(U, 1).step(torch.ones(3))
