"""Planned-set policies (gnmr_hf.core.policies): StaticPolicy (a fixed set every step) and HybridPolicy
(a planned set plus an exact GNMR controller over the other units), on hand-worked sequences."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnmr_hf
from gnmr_hf.core.controller import GNMRConfig, GNMRController
from gnmr_hf.core.policies import HybridPolicy, StaticPolicy, StaticSetPolicy, TriggerPolicy, make_policy

# Step 1 is quiet (GNMR = Delta = 1 < alpha = 1.1). At step 2 all history and window means are 1, so
# GNMR = Delta = n and R = n / 1.1: rank 3 (n=5), 0 (4), 1 (3), 2 (2), all risky. Step 3: nobody is
# risky (GNMR 1 / mean(1, n) < 1.1), only the units locked at step 2 are candidates; step 4 is quiet.
BYTES = [10, 1, 1, 5]
ROWS = [[1.0, 1.0, 1.0, 1.0], [4.0, 3.0, 2.0, 5.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def drive(policy, rows):
    masks, records = [], []
    for row in rows:
        masks.append(policy.step(torch.tensor(row, dtype=torch.float64)).nonzero().flatten().tolist())
        records.append(policy.last_record)
    return masks, records


def indices(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def test_exported_names():
    assert gnmr_hf.StaticPolicy is gnmr_hf.core.StaticPolicy is StaticPolicy is StaticSetPolicy
    assert gnmr_hf.HybridPolicy is gnmr_hf.core.HybridPolicy is HybridPolicy
    assert "HybridPolicy" in gnmr_hf.__all__ and "StaticPolicy" in gnmr_hf.core.__all__


# ---------------------------------------------------------------------------- StaticPolicy


def test_static_policy_by_hand():
    p = StaticPolicy(5, units=[3, 0], recoverable=[True, True, False, True, True])
    assert isinstance(p, TriggerPolicy)
    assert indices(p.initial_mask()) == [0, 3]
    masks, recs = drive(p, [[1.0] * 5, [9.0, 1.0, 1.0, 1.0, 9.0], [1.0] * 5])
    assert masks == [[0, 3]] * 3
    assert [r["promoted"] for r in recs] == [[]] * 3 and [r["demoted"] for r in recs] == [[]] * 3
    s = p.summary()
    # masks in effect during steps 1..3: {0, 3} each time; 4 recoverable units
    assert s["steps"] == 3 and s["promotion_ratio"] == pytest.approx(6 / 12) and s["mean_active"] == 2.0
    assert s["switches"] == 0 and s["hit_max_rate"] == 1.0  # max_active defaults to the set's size
    # the GNMR statistics are still reported: step 2's GNMR is 9 for units 0 and 4
    assert recs[1]["over_gnmr"] == 2 and recs[1]["gnmr"][4] == 9.0
    assert "active_bytes" not in recs[1] and "mean_active_bytes" not in s


def test_static_policy_bytes_and_state():
    p = StaticPolicy(4, units=[1, 3], unit_bytes=BYTES)
    assert p.set_bytes == 6
    assert p.summary()["peak_active_bytes"] == 0 and p.summary()["mean_active_bytes"] == 0.0
    masks, recs = drive(p, ROWS[:2])
    assert masks == [[1, 3], [1, 3]]
    assert recs[-1]["active_bytes"] == 6 and recs[-1]["budget_bytes"] is None and recs[-1]["hit_bytes"] is False
    s = p.summary()
    assert s["mean_active_bytes"] == 6.0 and s["peak_active_bytes"] == 6 and s["hit_bytes_rate"] == 0.0
    text = json.dumps(p.state_dict(), allow_nan=False)
    q = StaticPolicy(4, units=[1, 3], unit_bytes=BYTES)
    q.load_state_dict(json.loads(text))
    assert drive(p, ROWS[2:]) == drive(q, ROWS[2:])
    assert p.summary() == q.summary()


def test_static_policy_errors():
    with pytest.raises(ValueError, match=r"units \[2\] have no recovery path"):
        StaticPolicy(3, units=[2], recoverable=[True, True, False])
    with pytest.raises(ValueError, match="distinct"):
        StaticPolicy(3, units=[1, 1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        StaticPolicy(3, units=[3])
    with pytest.raises(ValueError, match=r"unit_bytes\[0\] = -1"):
        StaticPolicy(3, units=[1], unit_bytes=[-1, 0, 0])
    with pytest.raises(ValueError, match="one entry per unit"):
        StaticPolicy(3, units=[1], unit_bytes=[1, 2])


def test_make_policy_passes_unit_bytes():
    cfg = GNMRConfig(max_active=4, max_active_bytes=6)
    gnmr = make_policy("gnmr", 4, cfg, unit_bytes=BYTES)
    assert drive(gnmr, ROWS[:2])[0][1] == [1, 3]  # the byte-budgeted choice of the controller tests
    with pytest.raises(ValueError, match="needs unit_bytes"):
        make_policy("gnmr", 4, cfg)
    static = make_policy("static_set", 4, cfg, units=[0], unit_bytes=BYTES)
    assert drive(static, ROWS[:1])[1][0]["active_bytes"] == 10


# ---------------------------------------------------------------------------- HybridPolicy


def test_hybrid_by_hand_with_a_byte_budget():
    # planned {0} (10 bytes); GNMR may add 3 units and 6 bytes among 1, 2, 3.
    # step 2: GNMR's candidates in rank order 3, 1, 2 (unit 0 ranks 2nd overall but is planned):
    # take 3 (5 bytes), take 1 (6), skip 2 (7 > 6). Step 3: 1 and 3 locked, still fit: kept; their
    # locks run out. Step 4: GNMR selects nothing.
    cfg = GNMRConfig(max_active=3, max_active_bytes=6)
    p = HybridPolicy(4, planned=[0], config=cfg, unit_bytes=BYTES)
    assert isinstance(p, TriggerPolicy) and p.planned_bytes == 10
    assert p.last_record is None
    assert indices(p.initial_mask()) == [0]
    masks, recs = drive(p, ROWS)
    assert masks == [[0], [0, 1, 3], [0, 1, 3], [0]]
    r = recs[1]
    assert r["active"] == [0, 1, 3] and r["gnmr_active"] == [1, 3] and r["planned"] == [0]
    assert r["selected"] == [1, 3] and r["promoted"] == [1, 3] and r["demoted"] == []
    assert r["active_bytes"] == 16 and r["gnmr_active_bytes"] == 6 and r["budget_bytes"] == 6
    assert r["candidates"] == 3 and r["hit_bytes"] and r["hit_max"]
    assert r["over_gnmr"] == 4  # the planned unit is monitored too
    assert r["risk"] == pytest.approx([4 / 1.1, 3 / 1.1, 2 / 1.1, 5 / 1.1])
    assert recs[3]["active"] == [0] and recs[3]["demoted"] == [1, 3] and recs[3]["active_bytes"] == 10

    s = p.summary()
    # whole masks in effect during steps 1..4: {0}, {0}, {0, 1, 3}, {0, 1, 3}: 8 unit-steps of 16
    assert s["policy"] == "hybrid" and s["planned"] == 1 and s["steps"] == 4
    assert s["promotion_ratio"] == 0.5 and s["mean_active"] == 2.0
    # GNMR's part: {}, {}, {1, 3}, {1, 3}: 4 unit-steps of 4 * 3 selectable, 0 / 0 / 6 / 6 bytes
    g = s["gnmr"]
    assert g["promotion_ratio"] == pytest.approx(4 / 12) and g["mean_active"] == 1.0
    assert g["mean_active_bytes"] == 3.0 and g["peak_active_bytes"] == 6
    assert s["mean_active_bytes"] == 13.0 and s["peak_active_bytes"] == 16 and s["planned_bytes"] == 10
    assert s["switches"] == 4 and s["hit_max_rate"] == 0.25 and s["hit_bytes_rate"] == 0.25


def test_hybrid_gnmr_part_is_the_exact_controller():
    # the GNMR part equals a controller whose recoverable units exclude the planned ones
    cfg = GNMRConfig(max_active=1)
    p = HybridPolicy(4, planned=[0, 2], config=cfg)
    ctrl = GNMRController(4, cfg, recoverable=[1, 3])
    masks, recs = drive(p, ROWS)
    for row, mask, rec in zip(ROWS, masks, recs):
        inner = indices(ctrl.step(torch.tensor(row, dtype=torch.float64)))
        assert mask == sorted(inner + [0, 2])
        assert rec["gnmr_active"] == inner == ctrl.last_record["active"]
        assert [v.hex() for v in rec["risk"]] == [v.hex() for v in ctrl.last_record["risk"]]
    # step 2: the top 1 of {1, 3} by R is 3 (R 5 / 1.1), though unit 0 outranks unit 1
    assert masks == [[0, 2], [0, 2, 3], [0, 2, 3], [0, 2]]
    assert recs[1]["active_bytes"] is None and recs[1]["gnmr_active_bytes"] is None
    s = p.summary()
    assert s["gnmr"] == ctrl.summary()
    assert "mean_active_bytes" not in s and "planned_bytes" not in s


def test_hybrid_warmup_puts_every_recoverable_unit_on_the_recovery_path():
    cfg = GNMRConfig(max_active=1, full_recovery_steps=2)
    p = HybridPolicy(4, planned=[1], config=cfg, recoverable=[True, True, False, True])
    assert indices(p.initial_mask()) == [0, 1, 3]
    masks, recs = drive(p, ROWS[:3])
    # step(1)'s mask is for step 2 (warm-up); step(2)'s is GNMR's top 1 of {0, 3} (R: 3 > 0) plus 1
    assert masks == [[0, 1, 3], [1, 3], [1, 3]]
    assert recs[0]["warmup"] and not recs[1]["warmup"]


def test_hybrid_monitored_only_and_empty_plan():
    p = HybridPolicy(4, planned=[], config=GNMRConfig(max_active=4), recoverable=[True, False, True, True])
    masks, _ = drive(p, ROWS[:2])
    assert masks == [[], [0, 2, 3]]  # unit 1 is monitored only
    assert p.summary()["planned"] == 0


def test_hybrid_errors():
    with pytest.raises(ValueError, match=r"planned \[2\] have no recovery path"):
        HybridPolicy(3, planned=[2], recoverable=[True, True, False])
    with pytest.raises(ValueError, match="planned must be distinct"):
        HybridPolicy(3, planned=[1, 1])
    with pytest.raises(ValueError, match=r"planned must be indices in \[0, 3\)"):
        HybridPolicy(3, planned=[-1])
    with pytest.raises(ValueError, match="planned must be a sequence"):
        HybridPolicy(3, planned=2)
    with pytest.raises(ValueError, match="needs unit_bytes"):
        HybridPolicy(3, planned=[0], config=GNMRConfig(max_active_bytes=5))
    with pytest.raises(ValueError, match="num_units"):
        HybridPolicy(0, planned=[])


def test_hybrid_state_round_trip_through_json():
    cfg = GNMRConfig(max_active=3, max_active_bytes=6, lock_steps=2)
    a = HybridPolicy(4, planned=[0], config=cfg, unit_bytes=BYTES)
    drive(a, ROWS[:2])
    text = json.dumps(a.state_dict(), allow_nan=False)
    b = HybridPolicy(4, planned=[0], config=cfg, unit_bytes=BYTES)
    b.load_state_dict(json.loads(text))
    assert b.last_record is None and b.summary() == a.summary()
    ma, ra = drive(a, ROWS[2:])
    mb, rb = drive(b, ROWS[2:])
    assert ma == mb == [[0, 1, 3], [0, 1, 3]]  # lock_steps 2 keeps 1 and 3 one step longer
    assert json.dumps(ra) == json.dumps(rb)
    assert a.summary() == b.summary() and json.dumps(a.state_dict()) == json.dumps(b.state_dict())
    with pytest.raises(ValueError, match="planned set"):
        HybridPolicy(4, planned=[1], config=cfg, unit_bytes=BYTES).load_state_dict(json.loads(text))
    with pytest.raises(ValueError, match="max_active_bytes"):
        other = GNMRConfig(max_active=3, max_active_bytes=7, lock_steps=2)
        HybridPolicy(4, planned=[0], config=other, unit_bytes=BYTES).load_state_dict(json.loads(text))
    with pytest.raises(ValueError, match="policy"):
        HybridPolicy(4, planned=[0], config=cfg, unit_bytes=BYTES).load_state_dict(
            StaticPolicy(4, units=[0]).state_dict())


@st.composite
def hybrid_scenarios(draw):
    U = draw(st.integers(1, 7))
    recoverable = draw(st.lists(st.booleans(), min_size=U, max_size=U))
    rec_idx = [b for b in range(U) if recoverable[b]]
    planned = draw(st.lists(st.sampled_from(rec_idx), unique=True)) if rec_idx else []
    unit_bytes = draw(st.lists(st.integers(0, 12), min_size=U, max_size=U))
    cfg = GNMRConfig(max_active=draw(st.integers(0, 4)), lock_steps=draw(st.integers(0, 2)), alpha=1.1,
                     beta=1.3, window=draw(st.integers(1, 4)), full_recovery_steps=draw(st.integers(0, 2)),
                     max_active_bytes=draw(st.none() | st.integers(0, 30)))
    norm = st.one_of(st.sampled_from([0.0, 1.0, 2.0, math.nan]), st.floats(0.0, 10.0))
    rows = draw(st.lists(st.lists(norm, min_size=U, max_size=U), min_size=1, max_size=10))
    return U, recoverable, planned, unit_bytes, cfg, rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_scenarios())
def test_hybrid_is_planned_or_controller_within_its_budget(scenario):
    U, recoverable, planned, unit_bytes, cfg, rows = scenario
    p = HybridPolicy(U, planned=planned, config=cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    gnmr_rec = [r and b not in planned for b, r in enumerate(recoverable)]
    ctrl = GNMRController(U, cfg, recoverable=gnmr_rec, unit_bytes=unit_bytes)
    assert indices(p.initial_mask()) == sorted(set(planned) | set(indices(ctrl.initial_mask())))
    for t, row in enumerate(rows, start=1):
        norms = torch.tensor(row, dtype=torch.float64)
        mask, inner = indices(p.step(norms)), indices(ctrl.step(norms))
        assert mask == sorted(set(planned) | set(inner))
        assert p.last_record["active"] == mask and p.last_record["active_bytes"] == sum(unit_bytes[b] for b in mask)
        added = [b for b in mask if b not in planned]
        assert all(recoverable[b] for b in mask)
        if t + 1 > cfg.full_recovery_steps:  # the mask is for step t + 1
            assert len(added) <= cfg.max_active
            if cfg.max_active_bytes is not None:
                assert sum(unit_bytes[b] for b in added) <= cfg.max_active_bytes
    assert p.summary()["gnmr"] == ctrl.summary()
