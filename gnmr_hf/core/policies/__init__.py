"""Trigger policies: who goes on the recovery path next step, GNMR and the baselines it is compared with.

Every policy satisfies :class:`TriggerPolicy`, the interface :class:`gnmr_hf.GNMRCallback` (``policy=``)
and the stress recipes drive, so all of them act through the same dual-path actuator:

- ``initial_mask() -> bool[U]``: the units on the recovery path during step 1;
- ``step(norms[U]) -> bool[U]``: given step t's per-unit gradient norms (pre-clip, after accumulation),
  the units on the recovery path during step t + 1;
- ``state_dict()`` / ``load_state_dict(state)``: a JSON-safe snapshot for exact resume;
- ``last_record``: the record of the last step (the controller's keys: ``active``, ``promoted``,
  ``demoted``, ``over_gnmr``, ``over_delta``, ``hit_max``, ``nonfinite``, ``gnmr``, ``delta``, ``risk``);
- ``summary()``: run figures with the controller's definitions (promotion ratio, mean active units,
  hit-maxO rate, exceedance rates, switches).

Two optional extensions, each with its own protocol: :class:`MicrobatchPolicy` (``needs_microbatch_norms``
and ``observe_microbatch(sq_norms)``: the callback reports every micro-batch's squared per-unit gradient
norms before ``step``) and :class:`GapPolicy` (``wants_gap(step)`` and ``observe_gap(gaps)``: the caller
measures the per-unit recovery gap of :mod:`gnmr_hf.core.oracle` at the steps the policy asks for).

The policies, by the name :func:`make_policy` knows them:

- ``"gnmr"``: GNMR + Delta-GNMR under the ``max_active`` budget with locks, i.e.
  :class:`gnmr_hf.core.controller.GNMRController` itself (the paper's method; rules in docs/design.md).
- ``"adapt"``: :class:`StaticSensitivityPolicy`, an ADAPT-style static baseline (paper Appendix E.4):
  profile each unit's GNMR over a BF16 warm-up, then fix the top 25 % (capped by ``max_active``) on the
  recovery path for the rest of the run.
- ``"gsnr"``: :class:`GSNRPolicy`, the gradient signal-to-noise ranking (paper Appendix E.5): every step
  the ``max_active`` units with the lowest GSNR over the accumulation window's micro-batches.
- ``"random"``: :class:`RandomPolicy`, a seeded uniform draw of ``max_active`` units every step (a
  project baseline, not in the paper: the budget always full, no signal).
- ``"random_budget"``: :class:`RandomBudgetPolicy`, a seeded uniform draw whose size follows a
  deterministic schedule with a given, possibly fractional, mean number of recovery units per step:
  the "same budget as GNMR actually used" baseline of the NF4 comparison.
- ``"static_set"``: :class:`StaticSetPolicy`, a fixed set of units on the recovery path every step
  (for instance the units GNMR promoted most, see :func:`most_active_units`, or the first and last
  layers, see :func:`edge_units`): does *which* units matter, or only how many?
- ``"gap_profile"``: :class:`GapProfilePolicy`, the top-k units by their measured recovery gap (the
  relative gradient error of the low path, :func:`gnmr_hf.core.oracle.recovery_gap`) averaged over a
  window of measurements: a trigger that knows the gap, profiled over the first steps and optionally
  refreshed every N steps; with a window of 1 refreshed every step it is the previous
  step's gap.

Outside :func:`make_policy` (they take a planned unit set, which the recipes choose):

- :class:`StaticPolicy` (= :class:`StaticSetPolicy`): a planned set on the recovery path at every step.
- :class:`HybridPolicy`: a planned set always on the recovery path, plus an exact
  :class:`~gnmr_hf.core.controller.GNMRController` choosing among the other recoverable units under its
  own budget (``max_active`` and optionally ``max_active_bytes`` of its config).

The baselines report GNMR, Delta-GNMR and their exceedance counts like the controller does, so their
records and summaries compare line for line; those figures come from an inner
:class:`~gnmr_hf.core.controller.GNMRController` with ``max_active=0`` (one implementation of GNMR) and
do not influence the selections, except the ADAPT-style profile, which *is* mean GNMR.

Where they live: :mod:`.base` (the protocols and the shared baseline machinery), :mod:`.baselines`
(ADAPT-style, GSNR, random, random budget, gap profile), :mod:`.planned` (static and hybrid sets),
:mod:`.factory` (:func:`make_policy`); the paper's controller is :mod:`gnmr_hf.core.controller`. A new
trigger is one class in :mod:`.baselines` (a subclass of ``_BaselinePolicy`` with its ``_select``) and one
line in :func:`make_policy`.
"""

from gnmr_hf.core.policies.base import GapPolicy, MicrobatchPolicy, TriggerPolicy
from gnmr_hf.core.policies.baselines import (
    GapProfilePolicy,
    GSNRPolicy,
    RandomBudgetPolicy,
    RandomPolicy,
    StaticSensitivityPolicy,
)
from gnmr_hf.core.policies.factory import POLICIES, make_policy
from gnmr_hf.core.policies.planned import (
    HybridPolicy,
    StaticPolicy,
    StaticSetPolicy,
    edge_units,
    most_active_units,
)

__all__ = [
    "POLICIES",
    "GSNRPolicy",
    "GapPolicy",
    "GapProfilePolicy",
    "HybridPolicy",
    "MicrobatchPolicy",
    "RandomBudgetPolicy",
    "RandomPolicy",
    "StaticPolicy",
    "StaticSensitivityPolicy",
    "StaticSetPolicy",
    "TriggerPolicy",
    "edge_units",
    "make_policy",
    "most_active_units",
]
