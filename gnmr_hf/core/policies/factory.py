"""``make_policy``: a trigger policy by name (:data:`POLICIES`)."""

from __future__ import annotations

from collections.abc import Sequence

from gnmr_hf.core.controller import GNMRConfig, GNMRController
from gnmr_hf.core.policies.base import _THRESHOLD_FIELDS, TriggerPolicy
from gnmr_hf.core.policies.baselines import (
    GapProfilePolicy,
    GSNRPolicy,
    RandomBudgetPolicy,
    RandomPolicy,
    StaticSensitivityPolicy,
)
from gnmr_hf.core.policies.planned import StaticSetPolicy

POLICIES = ("gnmr", "adapt", "gsnr", "random", "random_budget", "static_set", "gap_profile")


def make_policy(
    name: str,
    num_units: int,
    config: GNMRConfig,
    recoverable: Sequence[bool] | None = None,
    warmup_steps: int | None = None,
    fraction: float = 0.25,
    seed: int = 0,
    *,
    units: Sequence[int] | None = None,
    mean_active: float | None = None,
    profile_steps: int | None = None,
    refresh_every: int | None = None,
    gap_window: int | None = None,
    unit_bytes: Sequence[int] | None = None,
) -> TriggerPolicy:
    """Build a trigger policy by name under the budget and thresholds of a :class:`GNMRConfig`.

    Args:
        name (`str`): one of :data:`POLICIES` (see the module docstring).
        num_units (`int`): U.
        config (`GNMRConfig`): ``max_active`` is the common budget (the cap of ``"random_budget"``, the
            size ``"gap_profile"`` keeps, the bound on a ``"static_set"``); ``alpha`` / ``beta`` /
            ``window`` / ``*_init`` / ``init_steps`` define the baselines' GNMR statistics.
        recoverable (*optional*): per-unit flags (None: all).
        warmup_steps (`int`, *optional*): the ADAPT-style profiling length (required for ``"adapt"``).
        fraction (`float`, defaults to 0.25): share of units the ADAPT-style baseline fixes.
        seed (`int`, defaults to 0): the random policies' seed.
        units (*optional*): the unit indices of ``"static_set"`` (required for it).
        mean_active (`float`, *optional*): mean recovery units per step of ``"random_budget"`` (required).
        profile_steps (`int`, *optional*): the profile length of ``"gap_profile"`` (required).
        refresh_every (`int`, *optional*): ``"gap_profile"``'s refresh period (None: no refresh).
        gap_window (`int`, *optional*): measurements ``"gap_profile"`` averages (None: ``profile_steps``).
        unit_bytes (*optional*): each unit's recovery bytes, for ``"gnmr"`` (required there when
            ``config.max_active_bytes`` is set) and ``"static_set"`` (byte figures in its records); the
            other policies ignore them.
    """
    if not isinstance(config, GNMRConfig):
        raise TypeError(f"config must be a GNMRConfig, got {type(config).__name__}")
    common = {f: getattr(config, f) for f in _THRESHOLD_FIELDS}
    K = config.max_active
    if name == "gnmr":
        return GNMRController(num_units, config, recoverable=recoverable, unit_bytes=unit_bytes)
    if name == "adapt":
        if warmup_steps is None:
            raise ValueError("the 'adapt' policy needs warmup_steps")
        return StaticSensitivityPolicy(num_units, K, warmup_steps, fraction, recoverable, **common)
    if name == "gsnr":
        return GSNRPolicy(num_units, K, recoverable, **common)
    if name == "random":
        return RandomPolicy(num_units, K, recoverable, seed=seed, **common)
    if name == "random_budget":
        if mean_active is None:
            raise ValueError("the 'random_budget' policy needs mean_active (e.g. a GNMR run's summary()['mean_active'])")
        return RandomBudgetPolicy(num_units, mean_active, recoverable, max_active=K, seed=seed, **common)
    if name == "static_set":
        if units is None:
            raise ValueError("the 'static_set' policy needs units (the unit indices to keep on the recovery path)")
        return StaticSetPolicy(num_units, units, recoverable, max_active=K, unit_bytes=unit_bytes, **common)
    if name == "gap_profile":
        if profile_steps is None:
            raise ValueError("the 'gap_profile' policy needs profile_steps")
        return GapProfilePolicy(num_units, K, profile_steps, refresh_every, gap_window, recoverable, **common)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
