"""The GNMR controller's configuration (:class:`GNMRConfig`, each field checked in ``__post_init__``) and the
checks of what a controller is built over: the recoverable units (:func:`unit_mask`), each unit's recovery bytes
and the init phase's length (:func:`init_steps_from_fraction`). Pure: torch and NumPy only."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; True as a step count is always a mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"GNMRConfig.{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"GNMRConfig.{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_int_or_none(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"GNMRConfig.{name} must be an integer >= {minimum} or None, got {value!r}")
    return int(value)


def _check_positive(name: str, value: Any, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        extra = " (or None)" if allow_none else ""
        raise ValueError(f"GNMRConfig.{name} must be a finite number > 0{extra}, got {value!r}")
    return float(value)


@dataclass
class GNMRConfig:
    """Configuration of the GNMR controller.

    Args:
        max_active (`int`, defaults to 10):
            The paper's maxO: at most this many units run on the recovery path at one step (outside
            the ``full_recovery_steps`` warm-up). 0 means never recover (monitor only).
        lock_steps (`int`, defaults to 1):
            The paper's T_lock: a unit selected while risky stays in the candidate pool for this many
            further decisions. 0 disables locking.
        alpha (`float`, defaults to 1.1):
            The paper's alpha_t after the init phase: a unit is risky when GNMR >= alpha.
        alpha_init (`float` or `None`, defaults to 1.5):
            The GNMR threshold during the first ``init_steps`` steps; None means "same as ``alpha``".
        beta (`float`, defaults to 1.5):
            The paper's beta_t after the init phase: a unit is risky when Delta-GNMR >= beta.
        beta_init (`float` or `None`, defaults to `None`):
            The Delta-GNMR threshold during the first ``init_steps`` steps; None means "same as ``beta``".
        window (`int`, defaults to 5):
            The paper's delta: how many recent finite GNMR values Delta-GNMR divides by.
        init_steps (`int`, defaults to 0):
            Steps t <= init_steps use ``alpha_init`` / ``beta_init`` (the two-stage threshold).
        full_recovery_steps (`int`, defaults to 0):
            High-fidelity warm-up: the first ``full_recovery_steps`` steps run every recoverable unit on
            the recovery path regardless of ``max_active``; statistics and lock counters evolve as if
            there were no warm-up.
        max_active_bytes (`int` or `None`, defaults to `None`):
            A byte budget beside the count cap: the units on the recovery path at one step (outside the
            warm-up) hold at most this many recovery bytes, each unit's bytes given to the controller as
            ``unit_bytes``. The candidates are taken in rank order (R descending, ties to the lower
            index), a unit whose bytes would overflow the budget is skipped (a smaller one further down
            may still fit), and never more than ``max_active`` are taken. None means no byte budget (the
            paper's count-only selection, unchanged).
    """

    max_active: int = 10
    lock_steps: int = 1
    alpha: float = 1.1
    alpha_init: float | None = 1.5
    beta: float = 1.5
    beta_init: float | None = None
    window: int = 5
    init_steps: int = 0
    full_recovery_steps: int = 0
    max_active_bytes: int | None = None

    def __post_init__(self) -> None:
        self.max_active = _check_int("max_active", self.max_active, 0)
        self.lock_steps = _check_int("lock_steps", self.lock_steps, 0)
        self.alpha = _check_positive("alpha", self.alpha)
        self.alpha_init = _check_positive("alpha_init", self.alpha_init, allow_none=True)
        self.beta = _check_positive("beta", self.beta)
        self.beta_init = _check_positive("beta_init", self.beta_init, allow_none=True)
        self.window = _check_int("window", self.window, 1)
        self.init_steps = _check_int("init_steps", self.init_steps, 0)
        self.full_recovery_steps = _check_int("full_recovery_steps", self.full_recovery_steps, 0)
        self.max_active_bytes = _check_int_or_none("max_active_bytes", self.max_active_bytes, 0)

    def thresholds(self, t: int) -> tuple[float, float]:
        """Return ``(alpha_t, beta_t)`` for step ``t`` (1-based)."""
        if t <= self.init_steps:
            alpha = self.alpha if self.alpha_init is None else self.alpha_init
            beta = self.beta if self.beta_init is None else self.beta_init
            return alpha, beta
        return self.alpha, self.beta

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-safe dict (ints, floats and None).

        ``max_active_bytes`` appears only when it is set: a config without a byte budget writes the
        same dict (and a controller the same state) as before the field existed, and a reader that
        does not know the field refuses a config whose byte budget it could not honour.
        """
        data = asdict(self)
        if data["max_active_bytes"] is None:
            del data["max_active_bytes"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GNMRConfig:
        """Build a config from :meth:`to_dict` output; unknown keys raise ``ValueError``, missing ones
        take their defaults (so dicts written before ``max_active_bytes`` existed load)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"GNMRConfig.from_dict: unknown field(s) {unknown}")
        return cls(**dict(data))


def init_steps_from_fraction(init_fraction: float, total_steps: int) -> int:
    """The ``init_steps`` for an initial-threshold phase of ``init_fraction`` of ``total_steps`` steps.

    The one place this conversion happens (callback, recipes, stress bench): the product rounded half
    up, and at least one step for a positive fraction, so "the first 2.5% of 100 steps" is 3 steps and
    2.5% of 20 steps is 1.

    Args:
        init_fraction (`float`): the fraction of training, in [0, 1].
        total_steps (`int`): the run's number of optimizer steps (``max_steps``), >= 0.
    """
    if isinstance(init_fraction, bool) or not isinstance(init_fraction, numbers.Real) or not 0 <= init_fraction <= 1:
        raise ValueError(f"init_fraction must be a number in [0, 1], got {init_fraction!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) or total_steps < 0:
        raise ValueError(f"total_steps must be an integer >= 0, got {total_steps!r}")
    if init_fraction == 0 or total_steps == 0:
        return 0
    return max(1, math.floor(init_fraction * total_steps + 0.5))


def unit_mask(units: Any, num_units: int, name: str = "recoverable") -> torch.Tensor:
    """A set of units as a bool mask [U], from a bool mask or from unit indices.

    Args:
        units: a bool tensor or list of ``num_units`` bools, or unit indices (an int tensor or an
            iterable of ints; an empty one is the empty set).
        num_units (`int`): U.
        name (`str`, defaults to ``"recoverable"``): what the units are, for the error messages.

    Returns:
        `torch.BoolTensor` [U] on the CPU (a new tensor).
    """
    U = num_units
    if isinstance(units, torch.Tensor):
        values = units.detach().cpu()
    else:
        values = list(units)
        if values and all(isinstance(v, bool) for v in values):
            values = torch.tensor(values, dtype=torch.bool)
        else:
            if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
                raise ValueError(f"{name} must be a bool mask of length {U} or unit indices, got {values!r}")
            values = torch.tensor(values, dtype=torch.long)
    if values.dtype == torch.bool:
        if values.shape != (U,):
            raise ValueError(f"{name} mask must have shape ({U},), got {tuple(values.shape)}")
        return values.clone()
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dim() != 1:
        raise ValueError(f"{name} must be a bool mask of length {U} or a 1-D tensor of unit indices")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= U):
        raise ValueError(f"{name} indices must lie in [0, {U}), got {values.tolist()}")
    mask = torch.zeros(U, dtype=torch.bool)
    mask[values.long()] = True
    return mask


def _check_unit_bytes(unit_bytes: Any, num_units: int) -> tuple[int, ...]:
    """Each unit's recovery bytes as a tuple of U Python ints >= 0 (``ValueError`` naming ``unit_bytes``)."""
    if isinstance(unit_bytes, (torch.Tensor, np.ndarray)):
        if unit_bytes.ndim != 1:
            raise ValueError(f"unit_bytes must be 1-D (one entry per unit), got shape {tuple(unit_bytes.shape)}")
        values = unit_bytes.tolist()
    elif isinstance(unit_bytes, (str, bytes, Mapping)) or not isinstance(unit_bytes, Iterable):
        raise ValueError(f"unit_bytes must be a sequence of {num_units} integers >= 0, got {unit_bytes!r}")
    else:
        values = list(unit_bytes)
    if len(values) != num_units:
        raise ValueError(f"unit_bytes must have one entry per unit (num_units={num_units}), got {len(values)}")
    for b, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"unit_bytes must be integers >= 0, got unit_bytes[{b}] = {v!r}")
    return tuple(int(v) for v in values)
