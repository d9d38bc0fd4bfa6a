"""The byte budget of the GNMR controller (GNMRConfig.max_active_bytes, GNMRController(unit_bytes=...)).

The selection under a byte budget B: the candidates in rank order (R descending, ties to the lower
index), a unit skipped when its bytes would take the running total over B, at most max_active taken.
Checked on hand-worked examples and, on random scenarios, against `ByteReference`: a plain loop that
redoes the selection, the locks, the warm-up masks and the byte figures from the R values the
controller reports (R itself is checked bit for bit against an independent reference in
test_controller_properties.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnmr_hf.core.controller import GNMRConfig, GNMRController

NAN, INF = math.nan, math.inf
BYTE_KEYS = ("hit_bytes", "active_bytes", "budget_bytes")


def run(ctrl: GNMRController, rows):
    masks, records = [], []
    for row in rows:
        masks.append(ctrl.step(torch.tensor(row, dtype=torch.float64)).nonzero().flatten().tolist())
        records.append(ctrl.last_record)
    return masks, records


# ---------------------------------------------------------------------------- hand-worked examples

# Step 1 is quiet (GNMR = Delta = 1 < alpha = 1.1). At step 2 every history mean and window mean is
# 1, so GNMR = Delta = n and R = max(n / 1.1, n / 1.5) = n / 1.1: rank 3 (n=5), 0 (4), 1 (3), 2 (2),
# all risky.
BYTES = [10, 1, 1, 5]
ROWS = [[1.0, 1.0, 1.0, 1.0], [4.0, 3.0, 2.0, 5.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_hand_worked_budget_six_skips_the_units_that_do_not_fit():
    # budget 6, max_active 4, rank 3, 0, 1, 2: take 3 (5 bytes, total 5); 0 (10) would make 15:
    # skip; take 1 (1 byte, total 6); 2 (1) would make 7: skip. Chosen {1, 3}, 6 bytes.
    ctrl = GNMRController(4, GNMRConfig(max_active=4, max_active_bytes=6), unit_bytes=BYTES)
    masks, recs = run(ctrl, ROWS[:2])
    assert recs[1]["risk"] == pytest.approx([4 / 1.1, 3 / 1.1, 2 / 1.1, 5 / 1.1])
    assert masks[1] == [1, 3]
    assert recs[1]["selected"] == [1, 3] and recs[1]["candidates"] == 4
    assert recs[1]["active_bytes"] == 6 and recs[1]["budget_bytes"] == 6
    assert recs[1]["hit_bytes"] is True and recs[1]["hit_max"] is True  # bound by bytes, not by count
    assert ctrl.locks.tolist() == [0, 1, 0, 1]  # the skipped risky units 0 and 2 get no lock


def test_hand_worked_same_step_under_other_budgets():
    def chosen(max_active, budget):
        cfg = GNMRConfig(max_active=max_active, max_active_bytes=budget)
        ctrl = GNMRController(4, cfg, unit_bytes=BYTES)
        masks, recs = run(ctrl, ROWS[:2])
        return masks[1], recs[1]["active_bytes"], recs[1]["hit_bytes"], recs[1]["hit_max"]

    # budget 10: 3 (5), skip 0 (15), 1 (6), 2 (7): all but unit 0
    assert chosen(4, 10) == ([1, 2, 3], 7, True, True)
    # count cap 1: unit 3 is taken and the walk stops there; nothing was skipped for bytes
    assert chosen(1, 6) == ([3], 5, False, True)
    # count cap 2: 3, skip 0, then 1 fills the cap (so 2 is never looked at)
    assert chosen(2, 6) == ([1, 3], 6, True, True)
    # budget 15: 3 and 0 fit exactly (15), then 1 and 2 do not
    assert chosen(4, 15) == ([0, 3], 15, True, True)
    # a budget holding everything: the count-only selection, nothing skipped, cap not filled
    assert chosen(4, 17) == ([0, 1, 2, 3], 17, False, True)
    assert chosen(5, 17) == ([0, 1, 2, 3], 17, False, False)
    # budget 0: no unit here has 0 bytes, every candidate is skipped
    assert chosen(4, 0) == ([], 0, True, True)
    # no byte budget, unit_bytes only reported: the top 2 by R
    assert chosen(2, None) == ([0, 3], 15, False, True)


def test_hand_worked_locks_and_summary_bytes():
    # step 3 (norms back to 1): nobody is risky; the locked units 1 and 3 are the candidates.
    # unit 1: GNMR = 1 / mean(1, 3) = 0.5, Delta = 0.5 / mean(1, 3) = 0.25, R = 0.5 / 1.1;
    # unit 3: GNMR = 1 / 3, Delta = (1 / 3) / 3, R = (1 / 3) / 1.1. Both fit (6 bytes): kept, and
    # their locks (lock_steps = 1) run out, so step 4 selects nothing.
    ctrl = GNMRController(4, GNMRConfig(max_active=4, max_active_bytes=6), unit_bytes=BYTES)
    masks, recs = run(ctrl, ROWS)
    assert masks == [[], [1, 3], [1, 3], []]
    assert recs[2]["candidates"] == 2 and recs[2]["over_gnmr"] == 0 and recs[2]["over_delta"] == 0
    assert recs[2]["risk"][1] == pytest.approx(0.5 / 1.1) and recs[2]["risk"][3] == pytest.approx(1 / 3 / 1.1)
    assert [r["hit_bytes"] for r in recs] == [False, True, False, False]
    assert [r["hit_max"] for r in recs] == [False, True, False, False]
    assert [r["active_bytes"] for r in recs] == [0, 6, 6, 0]
    assert ctrl.locks.tolist() == [0, 0, 0, 0]
    s = ctrl.summary()
    # masks in effect during steps 1..4: {}, {}, {1, 3}, {1, 3} -> bytes 0, 0, 6, 6
    assert s["mean_active_bytes"] == 3.0 and s["peak_active_bytes"] == 6
    assert s["hit_bytes_rate"] == 0.25 and s["hit_max_rate"] == 0.25
    assert s["promotion_ratio"] == pytest.approx(4 / 16) and s["switches"] == 4


def test_unit_over_the_budget_alone_is_never_selected_and_its_lock_decays():
    # unit 0 (10 bytes) never fits budget 6; unit 2 has 0 bytes and always fits, even at budget 0
    cfg = GNMRConfig(max_active=3, lock_steps=2, max_active_bytes=6)
    ctrl = GNMRController(3, cfg, unit_bytes=[10, 6, 0])
    masks, recs = run(ctrl, [[1.0, 1.0, 1.0], [9.0, 1.0, 1.0], [9.0, 9.0, 9.0]])
    assert masks[1] == [] and recs[1]["hit_bytes"] and recs[1]["candidates"] == 1
    # step 3: R: unit 0 GNMR 9/5 = 1.8 (over 1.1), units 1, 2 GNMR 9; rank 1, 2 (tie, lower index), 0
    assert masks[2] == [1, 2] and recs[2]["active_bytes"] == 6 and recs[2]["hit_bytes"]
    assert ctrl.locks.tolist() == [0, 2, 2]
    zero = GNMRController(3, GNMRConfig(max_active=3, max_active_bytes=0), unit_bytes=[10, 6, 0])
    assert run(zero, [[1.0, 1.0, 1.0], [9.0, 9.0, 9.0]])[0][1] == [2]


def test_warmup_ignores_the_byte_budget():
    cfg = GNMRConfig(max_active=1, max_active_bytes=2, full_recovery_steps=2)
    ctrl = GNMRController(4, cfg, recoverable=[0, 1, 3], unit_bytes=BYTES)
    assert ctrl.initial_mask().nonzero().flatten().tolist() == [0, 1, 3]
    masks, recs = run(ctrl, ROWS[:3])
    # step(1) returns the mask for step 2 (still warm-up); step(2) the first budgeted one: of the
    # candidates 3, 0, 1 (unit 2 is monitored only) 3 and 0 do not fit 2 bytes, 1 does
    assert masks == [[0, 1, 3], [1], [1]]
    assert recs[0]["warmup"] and recs[0]["active_bytes"] == 16 and recs[0]["budget_bytes"] == 2
    assert recs[1]["selected"] == [1] and recs[1]["hit_bytes"]
    s = ctrl.summary()
    # masks in effect during steps 1..3: {0, 1, 3} twice (16 bytes), then {1}
    assert s["peak_active_bytes"] == 16 and s["mean_active_bytes"] == pytest.approx(33 / 3)


def test_record_without_unit_bytes_has_the_byte_keys_as_none_and_summary_is_unchanged():
    ctrl = GNMRController(4, GNMRConfig(max_active=2))
    run(ctrl, ROWS[:2])
    rec = ctrl.last_record
    assert rec["active_bytes"] is None and rec["budget_bytes"] is None and rec["hit_bytes"] is False
    assert not {"mean_active_bytes", "peak_active_bytes", "hit_bytes_rate"} & set(ctrl.summary())
    state = ctrl.state_dict()
    assert "unit_bytes" not in state and "byte_totals" not in state
    assert "max_active_bytes" not in state["config"]


def test_unit_bytes_as_a_tensor():
    ctrl = GNMRController(4, GNMRConfig(max_active=4, max_active_bytes=6), unit_bytes=torch.tensor(BYTES))
    assert ctrl.unit_bytes == tuple(BYTES)
    assert run(ctrl, ROWS[:2])[0][1] == [1, 3]


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [-1, 1.5, 6.0, True, "6", [6]])
def test_invalid_max_active_bytes_names_the_field(value):
    with pytest.raises(ValueError, match=r"GNMRConfig\.max_active_bytes "):
        GNMRConfig(max_active_bytes=value)


def test_byte_budget_needs_unit_bytes():
    with pytest.raises(ValueError, match=r"max_active_bytes=6 needs unit_bytes"):
        GNMRController(4, GNMRConfig(max_active_bytes=6))


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1, 2, 3], r"unit_bytes must have one entry per unit \(num_units=4\), got 3"),
        ([1, 2, 3, 4, 5], r"got 5"),
        ([1, -2, 3, 4], r"unit_bytes\[1\] = -2"),
        ([1, 2, 3.0, 4], r"unit_bytes\[2\] = 3.0"),
        ([1, 2, 3, True], r"unit_bytes\[3\] = True"),
        ([1, 2, None, 4], r"unit_bytes\[2\] = None"),
        ("1234", r"unit_bytes must be a sequence"),
        (7, r"unit_bytes must be a sequence"),
        (torch.ones(2, 2, dtype=torch.long), r"unit_bytes must be 1-D"),
        (torch.tensor([1.0, 2.0, 3.0, 4.0]), r"unit_bytes\[0\] = 1.0"),
    ],
)
def test_bad_unit_bytes_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        GNMRController(4, GNMRConfig(max_active_bytes=6), unit_bytes=bad)
    with pytest.raises(ValueError, match=message):  # also without a budget: the values are still checked
        GNMRController(4, GNMRConfig(), unit_bytes=bad)


def test_config_dict_with_and_without_the_byte_budget():
    cfg = GNMRConfig(max_active=3, max_active_bytes=1 << 40)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["max_active_bytes"] == 1 << 40
    assert GNMRConfig.from_dict(data) == cfg
    # without a budget the dict is the one written before the field existed, and such dicts load
    old = GNMRConfig(max_active=3).to_dict()
    assert "max_active_bytes" not in old
    assert GNMRConfig.from_dict(old).max_active_bytes is None
    assert GNMRConfig.from_dict(old) == GNMRConfig(max_active=3)


def test_load_state_dict_rejects_other_unit_bytes():
    cfg = GNMRConfig(max_active=2, max_active_bytes=6)
    state = GNMRController(4, cfg, unit_bytes=BYTES).state_dict()
    with pytest.raises(ValueError, match="unit_bytes"):
        GNMRController(4, cfg, unit_bytes=[1, 1, 1, 1]).load_state_dict(state)
    with pytest.raises(ValueError, match="max_active_bytes"):
        GNMRController(4, GNMRConfig(max_active=2, max_active_bytes=7), unit_bytes=BYTES).load_state_dict(state)
    plain = GNMRController(4, GNMRConfig(max_active=2)).state_dict()
    with pytest.raises(ValueError, match="unit_bytes"):  # a state without unit_bytes into one with them
        GNMRController(4, GNMRConfig(max_active=2), unit_bytes=BYTES).load_state_dict(plain)
    with pytest.raises(ValueError, match="byte_totals"):
        broken = dict(state)
        del broken["byte_totals"]
        GNMRController(4, cfg, unit_bytes=BYTES).load_state_dict(broken)


def test_state_round_trip_hand_worked():
    cfg = GNMRConfig(max_active=4, max_active_bytes=6, full_recovery_steps=1)
    a = GNMRController(4, cfg, unit_bytes=BYTES)
    run(a, ROWS[:2])
    text = json.dumps(a.state_dict(), allow_nan=False)
    b = GNMRController.from_state_dict(json.loads(text))
    assert b.unit_bytes == tuple(BYTES) and b.config == cfg
    assert b.summary() == a.summary()
    ma, ra = run(a, ROWS[2:])
    mb, rb = run(b, ROWS[2:])
    assert ma == mb == [[1, 3], []]
    assert json.dumps(ra) == json.dumps(rb)
    assert a.summary() == b.summary() and json.dumps(a.state_dict()) == json.dumps(b.state_dict())


# ---------------------------------------------------------------------------- the loop reference


class ByteReference:
    """Selection, locks, warm-up masks and byte figures, one unit at a time, from the reported R."""

    def __init__(self, num_units: int, cfg: GNMRConfig, recoverable: list[bool], unit_bytes: list[int]):
        self.U, self.cfg, self.rec, self.bytes = num_units, cfg, recoverable, unit_bytes
        self.locks = [0] * num_units
        self.t = 0
        self.active = list(recoverable) if cfg.full_recovery_steps > 0 else [False] * num_units
        self.hit = self.hit_bytes_steps = self.byte_sum = self.peak = self.active_unit_steps = 0

    def step(self, risk: list[float]):
        cfg, B = self.cfg, self.cfg.max_active_bytes
        self.t += 1
        risky = [r >= 1 for r in risk]
        pool = [b for b in range(self.U) if (risky[b] or self.locks[b] > 0) and self.rec[b]]
        ranked = sorted(pool, key=lambda b: (-risk[b], b))
        chosen, total, skipped = [], 0, False
        for b in ranked:
            if len(chosen) == cfg.max_active:
                break
            if B is not None and total + self.bytes[b] > B:
                skipped = True
                continue
            chosen.append(b)
            total += self.bytes[b]
        for b in range(self.U):
            if b in chosen and risky[b]:
                self.locks[b] = cfg.lock_steps
            elif self.locks[b] > 0:
                self.locks[b] -= 1
        hit_max = len(chosen) == cfg.max_active or skipped
        in_effect = sum(self.bytes[b] for b in range(self.U) if self.active[b])
        self.byte_sum += in_effect
        self.peak = max(self.peak, in_effect)
        self.active_unit_steps += sum(self.active)
        self.hit += hit_max
        self.hit_bytes_steps += skipped
        warm = self.t + 1 <= cfg.full_recovery_steps
        self.active = list(self.rec) if warm else [b in chosen for b in range(self.U)]
        active_bytes = sum(self.bytes[b] for b in range(self.U) if self.active[b])
        return self.active, sorted(chosen), total, skipped, hit_max, active_bytes


norm_values = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
    st.sampled_from([NAN, INF]),
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False),
)
thresholds = st.sampled_from([0.5, 0.9, 1.0, 1.1, 1.5, 2.0])
configs = st.builds(
    GNMRConfig,
    max_active=st.integers(0, 6),
    lock_steps=st.integers(0, 3),
    alpha=thresholds,
    alpha_init=st.none() | thresholds,
    beta=thresholds,
    beta_init=st.none() | thresholds,
    window=st.integers(1, 5),
    init_steps=st.integers(0, 4),
    full_recovery_steps=st.integers(0, 3),
    max_active_bytes=st.integers(0, 40),
)


@st.composite
def scenarios(draw):
    U = draw(st.integers(1, 8))
    T = draw(st.integers(1, 16))
    cfg = draw(configs)
    recoverable = draw(st.lists(st.booleans(), min_size=U, max_size=U))
    # small byte values with repeats and zeros, so budgets bind, ties and zero-byte units occur
    unit_bytes = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13]) | st.integers(0, 50), min_size=U, max_size=U))
    rows = draw(st.lists(st.lists(norm_values, min_size=U, max_size=U), min_size=T, max_size=T))
    return U, cfg, recoverable, unit_bytes, rows


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_byte_budget_matches_loop_reference(scenario):
    U, cfg, recoverable, unit_bytes, rows = scenario
    ctrl = GNMRController(U, cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    ref = ByteReference(U, cfg, recoverable, unit_bytes)
    assert ctrl.initial_mask().tolist() == ref.active
    for row in rows:
        mask = ctrl.step(torch.tensor(row, dtype=torch.float64))
        rec = ctrl.last_record
        active, chosen, total, skipped, hit_max, active_bytes = ref.step(rec["risk"])
        assert mask.tolist() == active
        assert rec["selected"] == chosen
        assert total <= cfg.max_active_bytes and len(chosen) <= cfg.max_active
        assert rec["hit_bytes"] == skipped and rec["hit_max"] == hit_max
        assert rec["active_bytes"] == active_bytes and rec["budget_bytes"] == cfg.max_active_bytes
        assert ctrl.locks.tolist() == ref.locks
    s, t = ctrl.summary(), len(rows)
    assert s["peak_active_bytes"] == ref.peak
    assert s["mean_active_bytes"] == ref.byte_sum / t
    assert s["hit_bytes_rate"] == ref.hit_bytes_steps / t and s["hit_max_rate"] == ref.hit / t
    assert s["mean_active"] == ref.active_unit_steps / t


@SETTINGS
@given(scenarios())
def test_controller_unchanged_without_a_byte_budget(scenario):
    # unit_bytes without a budget, or a budget that holds every unit: the count-only decisions
    U, cfg, recoverable, unit_bytes, rows = scenario
    plain_cfg = GNMRConfig.from_dict({**cfg.to_dict(), "max_active_bytes": None})
    plain = GNMRController(U, plain_cfg, recoverable=recoverable)
    reported = GNMRController(U, plain_cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    roomy_cfg = GNMRConfig.from_dict({**cfg.to_dict(), "max_active_bytes": sum(unit_bytes)})
    roomy = GNMRController(U, roomy_cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    for row in rows:
        norms = torch.tensor(row, dtype=torch.float64)
        masks = [c.step(norms).tolist() for c in (plain, reported, roomy)]
        assert masks[0] == masks[1] == masks[2]
        base = plain.last_record
        for other in (reported, roomy):
            rec = other.last_record
            assert json.dumps({k: v for k, v in rec.items() if k not in BYTE_KEYS}) == json.dumps(
                {k: v for k, v in base.items() if k not in BYTE_KEYS}
            )
            assert rec["hit_bytes"] is False
        assert plain.locks.tolist() == reported.locks.tolist() == roomy.locks.tolist()
    byte_figures = ("mean_active_bytes", "peak_active_bytes", "hit_bytes_rate")
    for other in (reported, roomy):
        assert {k: v for k, v in other.summary().items() if k not in byte_figures} == plain.summary()
    state = reported.state_dict()
    del state["unit_bytes"], state["byte_totals"]
    assert json.dumps(state) == json.dumps(plain.state_dict())


@SETTINGS
@given(scenarios(), st.data())
def test_state_round_trip_through_json_is_exact(scenario, data):
    U, cfg, recoverable, unit_bytes, rows = scenario
    split = data.draw(st.integers(0, len(rows)))
    a = GNMRController(U, cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    run(a, rows[:split])
    text = json.dumps(a.state_dict(), allow_nan=False)
    b = GNMRController(U, cfg, recoverable=recoverable, unit_bytes=unit_bytes)
    b.load_state_dict(json.loads(text))
    c = GNMRController.from_state_dict(json.loads(text))
    assert b.summary() == a.summary() == c.summary()
    for row in rows[split:]:
        norms = torch.tensor(row, dtype=torch.float64)
        assert a.step(norms).tolist() == b.step(norms).tolist() == c.step(norms).tolist()
        assert json.dumps(a.last_record) == json.dumps(b.last_record) == json.dumps(c.last_record)
    assert a.summary() == b.summary() == c.summary()
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict()) == json.dumps(c.state_dict())
