"""The controller's state as a JSON-serialisable dict (plain ints, floats, bools, lists; no NaN/Inf), and its
restore for an exact resume: :meth:`GNMRController.state_dict <gnmr_hf.core.controller.GNMRController.state_dict>`
and :meth:`~gnmr_hf.core.controller.GNMRController.load_state_dict` call these. Pure: NumPy only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np

from gnmr_hf.core.config import GNMRConfig

_STATE_VERSION = 1

# the run totals a controller keeps (Python ints), and the byte figures kept apart (only with unit_bytes)
_TOTAL_KEYS = (
    "gnmr_exceed",
    "delta_exceed",
    "nonfinite",
    "active_unit_steps",
    "promotions",
    "demotions",
    "hit_max_steps",
)
_BYTE_TOTAL_KEYS = ("active_bytes", "peak_active_bytes", "hit_bytes_steps")


def controller_state(ctrl: Any) -> dict[str, Any]:
    """The controller ``ctrl``'s JSON-serialisable snapshot (plain ints, floats, bools, lists; no NaN/Inf) for exact resume.

    ``last_record`` is not part of it: it is a view of the last step, not needed to continue.
    """
    return {
        "version": _STATE_VERSION,
        "num_units": ctrl.num_units,
        "config": ctrl.config.to_dict(),
        "recoverable": ctrl.recoverable.tolist(),
        "t": ctrl.t,
        "active": ctrl._active.tolist(),
        "locks": ctrl._lock_counters().tolist(),
        "norm_sum": ctrl._norm_sum.tolist(),
        "norm_count": ctrl._norm_count.astype(np.int64).tolist(),
        "gnmr_window": np.stack(ctrl._gnmr_window, axis=1).tolist(),  # [U][W], oldest first
        "gnmr_count": ctrl._gnmr_count.tolist(),
        "totals": dict(ctrl._totals),
        # only with unit_bytes: without them the state is the one written before they existed
        **({} if ctrl._bytes is None else {"unit_bytes": list(ctrl.unit_bytes),
                                            "byte_totals": dict(ctrl._byte_totals)}),
    }


def restore_state(ctrl: Any, state: Mapping[str, Any]) -> None:
    """Restore a :func:`controller_state` into the controller ``ctrl`` (possibly after a JSON round trip).

    The state must come from a controller with the same ``num_units``, config, recoverable
    units and ``unit_bytes``; otherwise ``ValueError`` says what differs (build a matching controller with
    :meth:`GNMRController.from_state_dict <gnmr_hf.core.controller.GNMRController.from_state_dict>`).
    """
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"unsupported GNMRController state version {state.get('version')!r}")
    if state["num_units"] != ctrl.num_units:
        raise ValueError(
            f"state is for num_units={state['num_units']}, this controller has num_units={ctrl.num_units}"
        )
    saved = GNMRConfig.from_dict(state["config"])
    if saved != ctrl.config:
        diff = [
            f"{f.name}: saved {getattr(saved, f.name)!r} vs {getattr(ctrl.config, f.name)!r}"
            for f in fields(GNMRConfig)
            if getattr(saved, f.name) != getattr(ctrl.config, f.name)
        ]
        raise ValueError("state was saved with a different GNMRConfig (" + "; ".join(diff) + ")")
    if list(state["recoverable"]) != ctrl.recoverable.tolist():
        raise ValueError("state was saved with a different set of recoverable units")
    saved_bytes = state.get("unit_bytes")
    if (None if saved_bytes is None else [int(v) for v in saved_bytes]) != (
        None if ctrl.unit_bytes is None else list(ctrl.unit_bytes)
    ):
        raise ValueError(
            f"state was saved with unit_bytes={saved_bytes!r}, this controller has unit_bytes="
            f"{None if ctrl.unit_bytes is None else list(ctrl.unit_bytes)!r}"
        )
    if saved_bytes is not None:
        missing_bytes = set(_BYTE_TOTAL_KEYS) - set(state.get("byte_totals", ()))
        if missing_bytes:
            raise ValueError(f"state byte_totals lack {sorted(missing_bytes)}")
    U, W = ctrl.num_units, ctrl.config.window
    window = np.asarray(state["gnmr_window"], dtype=np.float64)
    if window.shape != (U, W):
        raise ValueError(f"state gnmr_window has shape {tuple(window.shape)}, expected ({U}, {W})")
    missing = set(_TOTAL_KEYS) - set(state["totals"])
    if missing:
        raise ValueError(f"state totals lack {sorted(missing)}")
    for name in ("active", "locks", "norm_sum", "norm_count", "gnmr_count"):
        if len(state[name]) != U:
            raise ValueError(f"state {name} has length {len(state[name])}, expected {U}")
    ctrl.t = int(state["t"])
    ctrl._active = np.asarray(state["active"], dtype=bool)
    ctrl._n_active = int(ctrl._active.sum())
    locks = np.asarray(state["locks"], dtype=np.int64)
    ctrl._locked = locks > 0
    ctrl._locks = None if ctrl.config.lock_steps == 1 else locks
    ctrl._norm_sum = np.asarray(state["norm_sum"], dtype=np.float64)
    ctrl._norm_count = np.asarray(state["norm_count"], dtype=np.float64)
    ctrl._gnmr_window = [row.copy() for row in window.T]
    ctrl._gnmr_count = np.asarray(state["gnmr_count"], dtype=np.int64)
    ctrl._refresh_flags()
    ctrl._totals = {key: int(state["totals"][key]) for key in _TOTAL_KEYS}
    ctrl._active_bytes = ctrl._bytes_of(ctrl._active)
    ctrl._byte_totals = dict.fromkeys(_BYTE_TOTAL_KEYS, 0)
    if saved_bytes is not None:
        ctrl._byte_totals = {key: int(state["byte_totals"][key]) for key in _BYTE_TOTAL_KEYS}
    ctrl._record_arrays = None
    ctrl._record_cache = None
