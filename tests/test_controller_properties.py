"""Property tests of the GNMR controller, and a check against a loop-based reference.

`Reference` below is written from the rules in docs/design.md, one unit at a time, with Python
lists for the histories: deliberately simple, sharing nothing with the vectorised controller. On
random sequences (NaN, Inf and zero norms included) both must give the same masks, GNMR, Delta
and risk values, bit for bit (both add the histories oldest-first), and the same run summary.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnmr_hf.core import selection as controller_module  # the top-K cut lives in the selection module
from gnmr_hf.core.controller import GNMRConfig, GNMRController

# The top-K cut sorts up to _TOP_K_SORT_MAX candidates and partitions more; the reference checks run
# once with each (the scenarios are too small to reach the partition at the default bound).
TOP_K_PATHS = pytest.mark.parametrize("sort_max", [10**9, 0], ids=["sort", "partition"])


@contextlib.contextmanager
def top_k_sort_max(value: int):
    saved = controller_module._TOP_K_SORT_MAX
    controller_module._TOP_K_SORT_MAX = value
    try:
        yield
    finally:
        controller_module._TOP_K_SORT_MAX = saved


def left_sum(values: list[float]) -> float:
    """Plain left-to-right float sum (the builtin sum() compensates its rounding from Python 3.12 on)."""
    total = 0.0
    for v in values:
        total += v
    return total


class Reference:
    """The rules of docs/design.md, literally, one unit at a time."""

    def __init__(self, num_units: int, cfg: GNMRConfig, recoverable: list[bool]):
        self.U, self.cfg, self.rec = num_units, cfg, recoverable
        self.norms = [[] for _ in range(num_units)]  # finite past norms per unit
        self.gnmrs = [[] for _ in range(num_units)]  # finite past GNMR values per unit
        self.locks = [0] * num_units
        self.t = 0
        self.active = list(recoverable) if cfg.full_recovery_steps > 0 else [False] * num_units
        self.active_unit_steps = self.hit = self.over_g = self.over_d = self.nonfinite = 0
        self.promotions = self.demotions = 0

    def step(self, norms: list[float]):
        cfg = self.cfg
        self.t += 1
        t = self.t
        if t <= cfg.init_steps:
            alpha = cfg.alpha if cfg.alpha_init is None else cfg.alpha_init
            beta = cfg.beta if cfg.beta_init is None else cfg.beta_init
        else:
            alpha, beta = cfg.alpha, cfg.beta
        g, d, r = [], [], []
        norms = [x + 0.0 for x in norms]  # -0.0 is the norm 0 (the controller reports it as +0.0)
        for b in range(self.U):
            x = norms[b]
            if not math.isfinite(x):
                g.append(math.nan)
                d.append(math.nan)
                r.append(math.inf)
                self.nonfinite += 1
                continue
            past = self.norms[b]
            if not past:
                gb = 1.0
            else:
                mean = left_sum(past) / len(past)
                gb = (1.0 if x == 0 else math.inf) if mean == 0 else x / mean
            win = self.gnmrs[b][-cfg.window:]
            if not win:
                db = 1.0
            else:
                wmean = left_sum(win) / len(win)
                db = (1.0 if gb == 0 else math.inf) if wmean == 0 else gb / wmean
            g.append(gb)
            d.append(db)
            r.append(max(gb / alpha, db / beta))
            self.over_g += gb >= alpha
            self.over_d += db >= beta
        risky = [rb >= 1 for rb in r]
        pool = [b for b in range(self.U) if (risky[b] or self.locks[b] > 0) and self.rec[b]]
        chosen = sorted(pool, key=lambda b: (-r[b], b))[: cfg.max_active]
        selected = [b in chosen for b in range(self.U)]
        for b in range(self.U):
            if selected[b] and risky[b]:
                self.locks[b] = cfg.lock_steps
            elif self.locks[b] > 0:
                self.locks[b] -= 1
            if math.isfinite(norms[b]):
                self.norms[b].append(norms[b])
                if math.isfinite(g[b]):
                    self.gnmrs[b].append(g[b])
        new = list(self.rec) if t + 1 <= cfg.full_recovery_steps else selected
        self.active_unit_steps += sum(self.active)
        self.promotions += sum(n and not o for n, o in zip(new, self.active))
        self.demotions += sum(o and not n for n, o in zip(new, self.active))
        self.hit += len(chosen) == cfg.max_active
        self.active = new
        return new, g, d, r

    def summary(self) -> dict:
        t, n_rec = self.t, sum(self.rec)
        return {
            "steps": t,
            "promotion_ratio": self.active_unit_steps / (t * n_rec) if n_rec else 0.0,
            "mean_active": self.active_unit_steps / t,
            "hit_max_rate": self.hit / t,
            "gnmr_exceedance_rate": self.over_g / (self.U * t),
            "delta_exceedance_rate": self.over_d / (self.U * t),
            "switches": self.promotions + self.demotions,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "nonfinite": self.nonfinite,
        }


def bits(values: list[float]) -> list[str]:
    """Floats as exact strings (NaN == NaN here), for bit-for-bit comparison."""
    return [float(v).hex() for v in values]


# norms: exact repeats (ties, equal histories), zeros, NaN/Inf and arbitrary magnitudes
norm_values = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 3.0]),
    st.sampled_from([math.nan, math.inf]),
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False),
)
thresholds = st.sampled_from([0.5, 0.9, 1.0, 1.1, 1.5, 2.0, 3.0])
configs = st.builds(
    GNMRConfig,
    max_active=st.integers(0, 5),
    lock_steps=st.integers(0, 3),
    alpha=thresholds,
    alpha_init=st.none() | thresholds,
    beta=thresholds,
    beta_init=st.none() | thresholds,
    window=st.integers(1, 6),
    init_steps=st.integers(0, 6),
    full_recovery_steps=st.integers(0, 4),
)


@st.composite
def scenarios(draw):
    U = draw(st.integers(1, 8))
    T = draw(st.integers(1, 24))
    cfg = draw(configs)
    recoverable = draw(st.lists(st.booleans(), min_size=U, max_size=U))
    rows = draw(st.lists(st.lists(norm_values, min_size=U, max_size=U), min_size=T, max_size=T))
    return U, cfg, recoverable, rows


# the fast tier draws 40 scenarios per property; the slow tier checks the loop reference on 600 more
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@TOP_K_PATHS
@SETTINGS
@given(scenarios())
def test_matches_loop_reference(sort_max, scenario):
    with top_k_sort_max(sort_max):
        check_against_reference(scenario)


@pytest.mark.slow
@TOP_K_PATHS
@THOROUGH
@given(scenarios())
def test_matches_loop_reference_thoroughly(sort_max, scenario):
    with top_k_sort_max(sort_max):
        check_against_reference(scenario)


@TOP_K_PATHS
def test_history_mean_that_underflows_to_zero(sort_max):
    # unit 2's only positive norm is the smallest subnormal: its history sum stays positive while
    # the mean (sum / 2, sum / 3) rounds to 0, so a zero norm is 0/0 and its GNMR must be 1
    cfg = GNMRConfig(max_active=0, lock_steps=0, alpha=0.5, beta=0.5, window=1)
    rows = [
        [0.0, 0.0, 0.0, 0.0, 0.5],
        [0.0, 0.0, 5e-324, 0.0, 0.0],
        [0.5, 0.5, 0.0, 0.5, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert 5e-324 > 0 and 5e-324 / 2 == 0.0  # the premise: the mean underflows
    with top_k_sort_max(sort_max):
        check_against_reference((5, cfg, [False] * 5, rows))
    ctrl = GNMRController(5, cfg)
    for row in rows:
        ctrl.step(torch.tensor(row, dtype=torch.float64))
    assert ctrl.last_record["gnmr"][2] == 1.0


def check_against_reference(scenario):
    U, cfg, recoverable, rows = scenario
    ctrl = GNMRController(U, cfg, recoverable=recoverable)
    ref = Reference(U, cfg, recoverable)
    assert ctrl.initial_mask().tolist() == ref.active
    for row in rows:
        mask = ctrl.step(torch.tensor(row, dtype=torch.float64))
        rmask, g, d, r = ref.step(row)
        rec = ctrl.last_record
        assert mask.tolist() == rmask
        assert bits(rec["gnmr"]) == bits(g)
        assert bits(rec["delta"]) == bits(d)
        assert bits(rec["risk"]) == bits(r)
        assert ctrl.locks.tolist() == ref.locks
    assert ctrl.summary() == ref.summary()


@SETTINGS
@given(scenarios())
def test_budget_and_recoverable_invariants(scenario):
    U, cfg, recoverable, rows = scenario
    ctrl = GNMRController(U, cfg, recoverable=recoverable)
    rec = torch.tensor(recoverable, dtype=torch.bool)
    assert not (ctrl.initial_mask() & ~rec).any()
    for t, row in enumerate(rows, start=1):
        mask = ctrl.step(torch.tensor(row, dtype=torch.float64))
        assert not (mask & ~rec).any()  # only recoverable units, warm-up included
        if t + 1 > cfg.full_recovery_steps:  # the mask is for step t + 1
            assert int(mask.sum()) <= cfg.max_active
        else:
            assert mask.tolist() == recoverable
        record = ctrl.last_record
        assert len(record["selected"]) <= cfg.max_active
        assert record["hit_max"] == (len(record["selected"]) == cfg.max_active)
        assert record["active"] == mask.nonzero().flatten().tolist()


@SETTINGS
@given(scenarios(), st.data())
def test_state_round_trip_through_json_changes_nothing(scenario, data):
    U, cfg, recoverable, rows = scenario
    split = data.draw(st.integers(0, len(rows)))
    a = GNMRController(U, cfg, recoverable=recoverable)
    for row in rows[:split]:
        a.step(torch.tensor(row, dtype=torch.float64))
    text = json.dumps(a.state_dict(), allow_nan=False)
    b = GNMRController(U, cfg, recoverable=recoverable)
    b.load_state_dict(json.loads(text))
    assert b.summary() == a.summary()
    for row in rows[split:]:
        norms = torch.tensor(row, dtype=torch.float64)
        assert a.step(norms).tolist() == b.step(norms).tolist()
        for key in ("gnmr", "delta", "risk"):
            assert bits(a.last_record[key]) == bits(b.last_record[key])
    assert a.summary() == b.summary()
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


@TOP_K_PATHS
def test_matches_loop_reference_at_large_u(sort_max, monkeypatch):
    """Hundreds of units, so the top-K cut, the tie handling and the fast paths run at a size the
    hypothesis scenarios do not reach: spikes, exact ties, zeros and non-finite norms included."""
    monkeypatch.setattr(controller_module, "_TOP_K_SORT_MAX", sort_max)
    U, T = 300, 40
    gen = torch.Generator().manual_seed(0)
    cfg = GNMRConfig(max_active=12, lock_steps=2, alpha=1.2, alpha_init=1.6, beta=1.4, window=4, init_steps=5)
    recoverable = (torch.rand(U, generator=gen) < 0.9).tolist()
    ctrl, ref = GNMRController(U, cfg, recoverable=recoverable), Reference(U, cfg, recoverable)
    selected = 0
    for t in range(T):
        row = (1.0 + 0.2 * torch.rand(U, generator=gen, dtype=torch.float64)).tolist()
        if t % 5 == 4:  # a burst: more risky units than max_active, some of them tied
            for b in torch.randperm(U, generator=gen)[:40].tolist():
                row[b] = 4.0
        if t == 20:
            row[3], row[7], row[11] = math.nan, math.inf, 0.0
        mask = ctrl.step(torch.tensor(row, dtype=torch.float64))
        rmask, g, d, r = ref.step(row)
        assert mask.tolist() == rmask
        assert bits(ctrl.last_record["risk"]) == bits(r) and bits(ctrl.last_record["delta"]) == bits(d)
        selected += int(mask.sum())
    assert ctrl.summary() == ref.summary()
    assert ctrl.summary()["hit_max_rate"] > 0 and selected > 0
