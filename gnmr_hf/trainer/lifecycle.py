"""The callback's lifecycle around the paper's loop: the checks and set-up at train begin, the controller or
policy it builds, resuming a checkpoint, the low-cost path during evaluation and the end of a run.

:class:`gnmr_hf.trainer.callback.GNMRCallback` reads as the loop itself (gather the per-unit norms, step
the policy, apply its mask, log); what it must guard before, around and after that loop lives here, as
functions of the callback (``cb``), next to the Trainer plumbing of :mod:`gnmr_hf.trainer.wiring`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

from gnmr_hf.backends.base import dual_path_modules, recoverable_units, set_active_units
from gnmr_hf.core.controller import GNMRConfig, GNMRController, init_steps_from_fraction
from gnmr_hf.trainer import wiring
from gnmr_hf.trainer.grad_norms import MicroBatchNorms, UnitGradNorms
from gnmr_hf.trainer.ranks import world_size
from gnmr_hf.trainer.state import check_saved, saved_entries, with_state_entry
from gnmr_hf.trainer.trace import TRACE_NAME, TraceWriter
from gnmr_hf.units import UNIT_GRAINS, resolve_units, short_name


def checked_args(config: Any, units: Any, policy: Any, init_fraction: Any, trace: Any) -> GNMRConfig | None:
    """The callback's config (``None`` with a policy); ``ValueError``/``TypeError`` naming a bad argument."""
    if policy is not None and config is not None:
        raise ValueError("GNMRCallback: pass either config (for GNMRController) or policy, not both")
    if policy is not None and init_fraction is not None:
        raise ValueError("GNMRCallback: init_fraction applies to GNMRController's config, not to a policy")
    if isinstance(config, dict):
        config = GNMRConfig.from_dict(config)
    elif config is None and policy is None:
        config = GNMRConfig()
    elif config is not None and not isinstance(config, GNMRConfig):
        raise TypeError(f"GNMRCallback: config must be a GNMRConfig or a dict, got {type(config).__name__}")
    if init_fraction is not None:
        init_steps_from_fraction(init_fraction, 0)  # validates: ValueError naming init_fraction
        if config.init_steps:
            raise ValueError("GNMRCallback: give init_fraction or config.init_steps, not both")
    if isinstance(units, str) and units not in UNIT_GRAINS:
        raise TypeError(f"GNMRCallback: units must be one of {UNIT_GRAINS}, a list of module names or a callable, "
                        f"got the string {units!r}")
    if not isinstance(trace, (bool, str)):
        raise TypeError(f"GNMRCallback: trace must be a bool or a path, got {type(trace).__name__}")
    return config


# ---------------------------------------------------------------------------------------- train begin


def find_units(cb: Any, args: Any, trainer: Any, model: Any) -> None:
    """Refuse what the callback cannot run under, then find the units, their parameters and recovery paths."""
    if model is None:
        raise ValueError("GNMRCallback needs the model (the Trainer passes it to callbacks)")
    if trainer is not None:
        wiring.refuse_second(trainer, type(cb))
    wiring.refuse_unsupported(args, trainer, model)
    try:
        cb._units = resolve_units(model, cb.units)
    except ValueError as e:
        raise ValueError(f"GNMRCallback found no units in {type(model).__name__}: {e}") from e
    cb._norms = UnitGradNorms(cb._units)
    if not cb._norms.params:
        raise ValueError(f"GNMRCallback: none of the {len(cb._units)} units ({cb._units[0][0]}, ...) holds a "
                         "trainable parameter, so there is no gradient to monitor")
    empty = [name for (name, _), c in zip(cb._units, cb._norms.counts) if c == 0]
    if empty:
        warnings.warn(f"GNMRCallback: units without trainable parameters (norm always 0): {empty}", stacklevel=3)
    cb._recoverable = recoverable_units(model, cb._units)
    cb._dual = list(dual_path_modules(model))
    if cb.policy is None:
        wiring.refuse_unprepared(model, cb.config.max_active, cb._recoverable, cb._dual)


def unit_bytes(units: list) -> list[int]:
    """Each unit's recovery bytes: the checkpoint weights its dual-path layers hold while promoted, in the
    dtype they are kept in (an INT8 rung: its int8 weights and row scales); 0 for a unit whose dual-path layers hold no weight (activation quantisation, MX)."""
    out = []
    for _, unit in units:
        total = 0
        for m in dual_path_modules(unit):
            source = getattr(m, "_gnmr_source", None)
            if source is not None:  # the checkpoint weight in its kept dtype, or the INT8 rung's int8 + scales
                total += source.weight_bytes(m)
        out.append(total)
    return out


def build_controller(cb: Any, num_units: int, max_steps: int) -> Any:
    """The paper's ``GNMRController`` from the config (``init_fraction`` converted, unit bytes for a byte
    budget), or the user's policy (built from a class or factory) with its interface and unit count checked.
    A policy that needs micro-batch norms gets them (single process only)."""
    if cb.policy is None:
        config = cb.config
        if cb.init_fraction is not None:
            config = dataclasses.replace(config, init_steps=init_steps_from_fraction(cb.init_fraction, max_steps))
        if config.max_active_bytes is not None:
            cb._unit_bytes = cb.unit_bytes()
        return GNMRController(num_units, config, recoverable=list(cb._recoverable), unit_bytes=cb._unit_bytes)
    policy = cb.policy
    if isinstance(policy, type) or (callable(policy) and not hasattr(policy, "step")):
        policy = policy(num_units, recoverable=list(cb._recoverable))
    for name in ("step", "initial_mask", "state_dict", "load_state_dict", "summary"):
        if not callable(getattr(policy, name, None)):
            raise TypeError(f"GNMRCallback: the policy {type(policy).__name__} has no method {name}()")
    planned = getattr(policy, "num_units", None)
    if isinstance(planned, int) and planned != num_units:
        raise ValueError(f"GNMRCallback: the policy {type(policy).__name__} was built for {planned} units (a plan "
                         f"over {planned} units), but the model has {num_units} ({cb._units[0][0]}, ...): "
                         "build the plan on this model, with the same unit grain (prepare_dual_path(units=...))")
    if getattr(policy, "needs_microbatch_norms", False):
        if world_size() > 1:
            raise ValueError("GNMRCallback: a policy with needs_microbatch_norms is supported on a single process only")
        cb._micro = MicroBatchNorms(cb._norms)
    return policy


def resume(cb: Any, state: Any) -> list[int]:
    """The units on the recovery path at the resumed step: the checkpoint's, with the controller's state
    loaded, after checking the saved state is this run's (units, config, policy, effective batch)."""
    names = [name for name, _ in cb._units]
    entries = saved_entries(state.stateful_callbacks)
    saved = next((s for s in entries if s.get("units") == names), entries[0] if entries else None)
    if saved is None:
        warnings.warn(f"GNMRCallback: resuming at step {state.global_step} without a saved GNMR state (the "
                      "checkpoint was made without this callback); the controller starts from scratch", stacklevel=4)
        return cb._indices(cb.controller.initial_mask())
    config, policy = identity(cb)
    check_saved(saved, names, state.global_step, config, policy, cb._settings)
    old = saved.get("effective_batch")  # absent in checkpoints made before it was recorded: unknown
    if old is not None and old != cb._effective_batch:
        message = (f"GNMRCallback: the checkpoint's GNMR statistics were gathered with an effective batch of {old} "
                   f"samples per optimizer step, this run uses {cb._effective_batch} (per-device batch x gradient "
                   "accumulation x data-parallel processes); gradient norms at another batch size are not comparable")
        if cb.strict_resume:
            raise ValueError(message + ". strict_resume=True refuses this: resume with the same batch settings, or "
                             "pass strict_resume=False to restart the statistics.")
        warnings.warn(message + ", so the GNMR statistics restart at this step (a fresh controller: a new warm-up, "
                      "no locks, nothing on the recovery path)", stacklevel=4)
        return cb._indices(cb.controller.initial_mask())
    cb.controller.load_state_dict(saved["controller"])
    return list(saved["active"])


def identity(cb: Any) -> tuple[dict | None, str | None]:
    """What a checkpoint's GNMR state must match: the controller's config, or the policy's class name."""
    if isinstance(cb.controller, GNMRController) and cb.policy is None:
        return cb.controller.config.to_dict(), None
    return None, type(cb.controller).__name__


def connect(cb: Any, args: Any, state: Any, trainer: Any) -> None:
    """The live run's outputs and Trainer hooks: the trace (main process), the guard that ends the run if
    ``train()`` raises, the checkpoint state carrier and the clip routing (warned once when another library
    wraps ``accelerator.clip_grad_norm_``)."""
    if state.is_world_process_zero and cb.trace:
        path = cb.trace if isinstance(cb.trace, str) else os.path.join(args.output_dir, TRACE_NAME)
        cb._trace = TraceWriter(path, state.global_step)
        cb.trace_path = path
    if trainer is None:
        return
    wiring.place(trainer, cb)
    with_state_entry(state.stateful_callbacks, cb.state_carrier)
    cb._accelerator = trainer.accelerator
    if wiring.take_over_clip(trainer, cb) and not cb._warned_clip:
        cb._warned_clip = True
        warnings.warn(
            f"GNMRCallback: accelerator.clip_grad_norm_ is not accelerate's own method "
            f"({getattr(trainer.accelerator.clip_grad_norm_, 'gnmr_original', None)!r}), so another library "
            "wraps it; the callback keeps that wrapper and reads the per-unit norms of the unclipped gradients "
            "in a separate pass before each clip call (one extra norm pass over the units' gradients per "
            "optimizer step)", stacklevel=3)


# ------------------------------------------------------------------------------------- around the loop


def scale_before_step(accelerator: Any) -> float | None:
    """The fp16 loss scale before the optimizer step (None without an enabled scaler), for
    :func:`step_was_skipped`."""
    scaler = accelerator.scaler
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else None


def step_was_skipped(accelerator: Any, scale_before: float | None) -> bool:
    """Whether the fp16 loss scaler skipped this optimizer step (it found inf/NaN)."""
    if accelerator is None:
        return False
    if scale_before is not None:
        # the scaler backs off exactly when it found inf/NaN; accelerate's optimizer_step_was_skipped
        # misses it with optimizers that skip by themselves (fused AdamW, the Trainer's default)
        return accelerator.scaler.get_scale() < scale_before
    return bool(accelerator.optimizer_step_was_skipped)


@contextlib.contextmanager
def low_path_during_eval(cb: Any):
    """The body (the Trainer's ``evaluate``/``predict`` inside a run) on the low-cost path, then the training
    mask back; nothing happens outside a run or with ``eval_on_recovery=True``."""
    if not cb._live or cb.eval_on_recovery:
        yield
        return
    cb._eval_depth += 1
    try:
        if cb._eval_depth == 1 and cb._applied and any(cb._recoverable):
            set_active_units(cb._model, [], cb._units)
        yield
    finally:
        cb._eval_depth -= 1
        if cb._eval_depth == 0 and cb._live and cb._applied:
            set_active_units(cb._model, cb._applied, cb._units)


# ------------------------------------------------------------------------------------------ run end


def end_run(cb: Any, finished: bool) -> None:
    """See :meth:`GNMRCallback.end_run`."""
    if not cb._live:
        return
    cb._live = False
    if cb._guard is not None and cb in cb._guard.live:
        cb._guard.live.remove(cb)
    cb.clip_token = None
    try:
        if cb._accelerator is not None:
            wiring.give_back_clip(cb._accelerator)
        if finished and cb._ranks is not None:
            cb._ranks.flush()
    finally:
        cb._ranks = None
        try:
            if cb._trace is not None:
                summary = None
                if finished:
                    summary = {"summary": cb.controller.summary(), "steps": int(cb._last_step),
                               "units": [short_name(n) for n, _ in cb._units], "recoverable": list(cb._recoverable)}
                    if cb._unit_bytes is not None:
                        summary["unit_bytes"] = list(cb._unit_bytes)
                cb._trace.close(summary)
                cb._trace = None
        finally:
            if cb._model is not None and any(cb._recoverable):
                set_active_units(cb._model, [], cb._units)
            cb._applied = []
