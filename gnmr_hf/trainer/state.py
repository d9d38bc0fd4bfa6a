"""The GNMR run state in Trainer checkpoints, and the checks made before it is loaded.

The Trainer saves the ``state()`` of every ``ExportableState`` callback into ``trainer_state.json``
and, with ``restore_callback_states_from_checkpoint=True``, rebuilds each of them on resume as
``type(cb)(**state()["args"])`` and drops the original. A callback holding a policy or a units
callable cannot be rebuilt from JSON, so ``GNMRCallback`` itself is not ``ExportableState``: it keeps
its run state in a :class:`GNMRState` that it adds to the Trainer next to itself. ``GNMRState`` has
no constructor arguments, so the Trainer's rebuilt copy is complete (the callback links it back to
itself at train begin), and the saved entry is read from ``state.stateful_callbacks`` at train begin
whether or not the flag is set.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from transformers.trainer_callback import ExportableState, TrainerCallback

STATE_KEY = "GNMRState"


class GNMRState(TrainerCallback, ExportableState):
    """Carries one ``GNMRCallback``'s run state into checkpoints (no events of its own).

    Attributes:
        source: a callable returning the live run state (set by the callback that owns it).
        saved: the run state this copy was rebuilt with (set by the Trainer on resume).
    """

    def __init__(self) -> None:
        self.source: Callable[[], dict | None] | None = None
        self.saved: dict | None = None

    def state(self) -> dict:
        """``ExportableState``: no constructor arguments; the run state as the one attribute."""
        return {"args": {}, "attributes": {"saved": self.source() if self.source is not None else self.saved}}


def saved_entries(stateful_callbacks: dict | None) -> list[dict]:
    """The run states saved under :data:`STATE_KEY` in a ``TrainerState.stateful_callbacks`` dict."""
    entry = (stateful_callbacks or {}).get(STATE_KEY)
    entries = entry if isinstance(entry, list) else [entry] if entry else []
    return [e["attributes"]["saved"] for e in entries if (e.get("attributes") or {}).get("saved")]


def check_saved(saved: dict, unit_names: list[str], step: int, config: dict | None, policy: str | None,
                settings: dict | None = None) -> None:
    """Refuse a saved run state that does not belong to this run.

    Args:
        saved: the run state read from the checkpoint.
        unit_names: this run's unit names.
        step: the step the Trainer resumes at.
        config: this run's effective ``GNMRConfig`` as a dict (``None`` with a policy).
        policy: this run's policy class name (``None`` with the controller).
        settings: this run's :func:`policy_settings` (``None`` with the controller); checked against the
            saved ones when the checkpoint has them.

    Raises:
        ValueError: the units, the step, the configuration, the policy or its settings differ; the message
            names what differs.
    """
    names = saved.get("units") or []
    if names != unit_names:
        first = next((i for i, (a, b) in enumerate(zip(names, unit_names)) if a != b), min(len(names), len(unit_names)))
        raise ValueError(
            f"GNMRCallback: the checkpoint's GNMR state is for {len(names)} units, this model has {len(unit_names)}"
            + (f"; they differ from unit {first} ({names[first] if first < len(names) else '-'} vs "
               f"{unit_names[first] if first < len(unit_names) else '-'})")
            + ". Resume with the same model and units, or start a new run."
        )
    if saved.get("step") != step:
        raise ValueError(
            f"GNMRCallback: the checkpoint's GNMR state is from step {saved.get('step')}, "
            f"the Trainer resumes at step {step}"
        )
    if saved.get("policy") != policy:
        raise ValueError(
            f"GNMRCallback: the checkpoint was made with policy {saved.get('policy') or 'GNMRController'}, "
            f"this run uses {policy or 'GNMRController'}"
        )
    old_settings = saved.get("policy_settings")
    if settings is not None and old_settings is not None:
        now = json.loads(json.dumps(settings))  # as it reads back from trainer_state.json
        diff = [f"{k}: saved {old_settings.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(old_settings) | set(now))
                if old_settings.get(k) != now.get(k)]
        if diff:
            raise ValueError(
                f"GNMRCallback: the checkpoint was made with {policy} settings that differ from this run's ("
                + "; ".join(diff) + "). Resume with the same policy settings, or start a new run."
            )
    old = saved.get("config")
    if config is not None and old != config:
        diff = [f"{k}: saved {old.get(k)!r} vs {config.get(k)!r}" for k in sorted(set(old) | set(config))
                if old.get(k) != config.get(k)]
        raise ValueError(
            "GNMRCallback: the checkpoint's GNMR state was made with a different GNMRConfig (" + "; ".join(diff)
            + "). Resume with the same config (init_fraction included), or start a new run."
        )


_MISSING = object()


def policy_settings(policy: Any) -> dict[str, Any]:
    """A trigger policy's constructor settings, as JSON values, for the resume check.

    Every named constructor parameter (but ``num_units`` and ``recoverable``) that the policy keeps as an
    attribute of the same name (``max_active``, ``seed``, ``mean_active``, ``fraction``, ``warmup_steps``,
    ``units``, ``k``, ``config``, ...), and the GNMR-statistics config of a baseline's inner monitor (its
    ``state_dict()["monitor"]["config"]``, as ``statistics.<field>``). A policy's ``state_dict`` holds its
    progress, not these: loading it would silently keep the saved seed, or run the saved draws with
    another budget.
    """
    out: dict[str, Any] = {}
    try:
        params = inspect.signature(type(policy).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for name, param in params.items():
        if name in ("self", "num_units", "recoverable") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = _setting(getattr(policy, name, _MISSING))
        if value is not _MISSING:
            out[name] = value
    state = policy.state_dict() if callable(getattr(policy, "state_dict", None)) else None
    monitor = state.get("monitor") if isinstance(state, dict) else None
    if isinstance(monitor, dict) and isinstance(monitor.get("config"), dict):
        out.update({f"statistics.{k}": v for k, v in monitor["config"].items() if k != "max_active"})
    return out


def _setting(value: Any) -> Any:
    if isinstance(value, Fraction):
        return float(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if callable(getattr(value, "to_dict", None)):  # a GNMRConfig
        return value.to_dict()
    return _MISSING


def with_state_entry(stateful_callbacks: dict, carrier: Any) -> None:
    """Make sure the Trainer finds an entry for ``carrier`` when it saves (a checkpoint made without
    GNMR has none, and the Trainer updates entries by key)."""
    stateful_callbacks.setdefault(STATE_KEY, carrier.state())
