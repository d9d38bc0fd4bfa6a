"""``GNMRCallback``: GNMR inside the Hugging Face ``Trainer``, on one process or many.

The callback gathers per-unit gradient norms, steps the controller (or a user policy) and applies its
answer through :func:`gnmr_hf.set_active_units`; statistics live in :mod:`gnmr_hf.core`, the low-cost
and recovery paths in :mod:`gnmr_hf.backends`, the Trainer plumbing in :mod:`gnmr_hf.trainer.wiring`, the
checks and set-up around the loop (train begin, resume, evaluation, run end) in :mod:`gnmr_hf.trainer.lifecycle`.
The clipping contract, the fp16 skip rule and the trace format are in docs/design.md. In short: the
Trainer calls ``accelerator.clip_grad_norm_`` once per optimizer step (with ``max_grad_norm``, or
``inf`` to only measure); during a run the callback answers that call with
:meth:`~gnmr_hf.trainer.grad_norms.UnitGradNorms.clip_`, which clips bit-identically and yields the
pre-clip per-unit norms from the same pass. ``TrainingArguments`` are never modified. The controller
steps in ``on_optimizer_step``, after the optimizer, so that a step the fp16 loss scaler skipped is
traced as ``"skipped": true`` and never reaches it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from transformers.trainer_callback import TrainerCallback

from gnmr_hf.backends.base import set_active_units
from gnmr_hf.core.controller import GNMRConfig
from gnmr_hf.trainer import lifecycle, wiring
from gnmr_hf.trainer.grad_norms import MicroBatchNorms, UnitGradNorms
from gnmr_hf.trainer.ranks import RankAgreement, world_size
from gnmr_hf.trainer.state import GNMRState, policy_settings
from gnmr_hf.trainer.trace import LogWindow, TraceWriter, jsonable
from gnmr_hf.units import Unit

# per-step record keys that are counts (or lists whose length is the count), logged as gnmr/<key>
_LOGGED_KEYS = ("active", "promoted", "demoted", "over_gnmr", "over_delta", "hit_max", "nonfinite", "skipped")


class GNMRCallback(TrainerCallback):
    """Run GNMR (Gradient Norm-to-Mean Ratio) precision control inside a ``transformers.Trainer``.

    At train begin the callback finds the units (the decoder layers by default), their trainable
    parameters and which units have a recovery path (a :class:`~gnmr_hf.backends.base.DualPathModule`
    inside them), and builds the controller. At every optimizer step it takes each unit's gradient norm
    *before clipping* (after gradient accumulation and the DDP all-reduce; under FSDP2 the local shards'
    squares summed over the mesh in the clip's one all-reduce) in the Trainer's own norm pass, steps the
    controller and puts the chosen units on the recovery path for the next step. On a
    model without dual-path modules it runs monitor-only with ``GNMRConfig(max_active=0)`` (a per-layer
    gradient-spike monitor whose run is bit-identical to one without the callback). Use it as
    ``Trainer(..., callbacks=[GNMRCallback()])`` or with :func:`attach`.

    Outputs: ``gnmr/active``, ``gnmr/promoted``, ``gnmr/demoted``, ``gnmr/over_gnmr``, ``gnmr/over_delta``,
    ``gnmr/hit_max``, ``gnmr/nonfinite``, ``gnmr/skipped`` (means over the steps since the last log) and
    ``gnmr/recovery_bytes`` (their maximum) in the training logs, except under a policy whose mask never changes
    (``static = True``, e.g. :class:`~gnmr_hf.core.policies.StaticPolicy`); ``gnmr/summary/*`` in the final
    metrics; on the main process the trace ``{output_dir}/gnmr_trace.jsonl`` (one JSON line per
    optimizer step, format in docs/design.md) and ``gnmr_summary.json`` at train end. The run state is
    saved in every checkpoint (``trainer_state.json``) and restored exactly on ``resume_from_checkpoint``
    with ``restore_callback_states_from_checkpoint`` on or off; the trace is cut back to the resumed step.

    Outside the training steps the model runs on the low-cost path: after ``train()`` returns or raises,
    and during the Trainer's evaluation inside a run (``evaluate``/``predict``; the training mask is put
    back afterwards). One ``GNMRCallback`` per Trainer.

    Args:
        config (`GNMRConfig` or `dict`, *optional*): controller configuration (a dict goes through
            ``GNMRConfig.from_dict``). Defaults to ``GNMRConfig()``.
        units (*optional*): ``None`` for the decoder layers, a list of module names, or a callable
            ``model -> [(name, module), ...]``, or ``"layers"`` / ``"linears"`` (one unit per linear); None
            follows the grain ``prepare_dual_path(..., units=...)`` recorded (see :func:`gnmr_hf.units.resolve_units`).
            With ``config.max_active_bytes`` the controller gets each unit's recovery bytes (:meth:`unit_bytes`).
        policy (*optional*): a trigger policy used instead of ``GNMRController`` (baselines, see
            :mod:`gnmr_hf.core.policies` for the interface): an object, or a class/factory (callable
            without a ``step`` attribute) called at train begin as ``policy(U, recoverable=[bool] * U)``.
            A policy with ``needs_microbatch_norms`` gets, before each ``step``, the per-unit squared
            norm of what each micro-batch of the accumulation window added (unscaled; single process).
        init_fraction (`float`, *optional*): length of the initial-threshold phase as a fraction of
            ``max_steps``, converted at train begin by
            :func:`gnmr_hf.core.controller.init_steps_from_fraction` (``config.init_steps`` must be 0).
        trace (`bool` or `str`, defaults to `True`): write the trace and summary (a string: the trace path).
        check_ranks (`bool`, defaults to `True`): under ``torch.distributed``, check every step that all
            ranks took the same decision (``RuntimeError`` if not).
        eval_on_recovery (`bool`, defaults to `False`): evaluate inside a run with the current training mask
            (the units the last step promoted) instead of the low-cost path.
        strict_resume (`bool`, defaults to `False`): refuse (``ValueError``) to resume a checkpoint made with
            another effective batch (per-device batch x gradient accumulation x data-parallel processes)
            instead of warning and restarting the GNMR statistics.

    Refused at train begin with ``ValueError``: a second ``GNMRCallback`` on the same Trainer, DeepSpeed,
    FSDP1, DTensor parameters other than FSDP2 shards (tensor parallelism, HSDP), bitsandbytes dual-path
    layers under FSDP (already when the Trainer is built; use DDP), no units,
    no trainable parameter in any unit, a ``GNMRConfig`` with ``max_active > 0`` on a model without
    dual-path modules (forgotten :func:`gnmr_hf.prepare_dual_path`; ``max_active=0`` is a monitor), and a
    checkpoint whose GNMR state differs from this run (units, config, policy or policy settings).
    """

    def __init__(
        self,
        config: GNMRConfig | dict | None = None,
        units: Any = None,
        policy: Any = None,
        init_fraction: float | None = None,
        trace: bool | str = True,
        check_ranks: bool = True,
        eval_on_recovery: bool = False,
        strict_resume: bool = False,
    ) -> None:
        config = lifecycle.checked_args(config, units, policy, init_fraction, trace)
        for name, value in (("eval_on_recovery", eval_on_recovery), ("strict_resume", strict_resume)):
            if not isinstance(value, bool):
                raise TypeError(f"GNMRCallback: {name} must be a bool, got {type(value).__name__}")
        self.config, self.units, self.policy = config, units, policy
        self.init_fraction, self.trace, self.check_ranks = init_fraction, trace, bool(check_ranks)
        self.eval_on_recovery, self.strict_resume = eval_on_recovery, strict_resume
        self.state_carrier = GNMRState()
        self.state_carrier.source = self._run_state
        self.clip_token: object | None = None  # the clip routing of the current run (wiring.take_over_clip)
        self._warned_clip = False
        self._live = False
        self._reset_run()

    def __repr__(self) -> str:
        if self.policy is None:
            return f"GNMRCallback(config={self.config!r})"
        policy = self.policy
        if isinstance(policy, functools.partial):
            name = f"{getattr(policy.func, '__name__', type(policy.func).__name__)}(**{policy.keywords!r})"
        else:
            name = getattr(policy, "__name__", None) or type(policy).__name__
        return f"GNMRCallback(policy={name})"

    def _reset_run(self) -> None:
        self.controller: Any = None
        self._unit_bytes: list[int] | None = None  # with a byte budget: each unit's recovery bytes
        self._units: list[Unit] = []
        self._norms: UnitGradNorms | None = None
        self._recoverable: list[bool] = []
        self._active: list[int] = []
        self._applied: list[int] | None = None  # what the model runs
        self._dual: list = []  # the model's dual-path modules, for the recovery bytes
        self._accelerator: Any = None
        self._step_sq: torch.Tensor | None = None  # this step's per-unit squared norms, from the clip
        self._scale_before: float | None = None  # the fp16 loss scale before this step's optimizer step
        self._micro: MicroBatchNorms | None = None  # for policies that need micro-batch norms
        self._trace: TraceWriter | None = None
        self.trace_path: str | None = None  # the trace this process writes in the current/last run
        self._ranks: RankAgreement | None = None
        self._window = LogWindow(_LOGGED_KEYS)
        self._last_step = 0
        self._model: Any = None  # the model of the live run, put back on the low-cost path when it ends
        self._guard: Any = None  # the Trainer's wiring.guard, which ends the run if train() raises
        self._eval_depth = 0
        self._effective_batch: int | None = None
        self._settings: dict | None = None  # a policy's constructor settings, checked on resume

    @property
    def active(self) -> list[int]:
        """Units on the recovery path for the next step."""
        return list(self._active)

    # ------------------------------------------------------------------------------------ set-up

    def on_init_end(self, args, state, control, model=None, **kwargs):
        trainer = wiring.find_trainer(self)
        if trainer is not None:
            wiring.refuse_bnb_sharded(args, trainer, model)  # before accelerate shards the model in train()
            wiring.place(trainer, self)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.end_run(finished=False)  # a run that raised (or the Trainer's batch-size retry) left it live
        self._reset_run()
        trainer = wiring.find_trainer(self)
        lifecycle.find_units(self, args, trainer, model)  # refusals first, then units, norms, recovery paths
        self.controller = lifecycle.build_controller(self, len(self._units), state.max_steps)
        self._effective_batch = wiring.effective_batch(args, trainer)
        self._settings = policy_settings(self.controller) if self.policy is not None else None
        self._last_step = state.global_step
        resumed = state.global_step > 0
        self._active = lifecycle.resume(self, state) if resumed else self._indices(self.controller.initial_mask())
        self._model, self._live = model, True
        if trainer is not None:
            self._guard = wiring.guard(trainer)
            self._guard.live.append(self)
        self._apply(model, force=True)
        if world_size() > 1 and self.check_ranks:
            self._ranks = RankAgreement.for_current_group(len(self._units))
        lifecycle.connect(self, args, state, trainer)

    def unit_bytes(self) -> list[int]:
        """Each unit's recovery bytes: the checkpoint weights its dual-path layers hold while promoted, in the
        dtype they are kept in (``prepare_dual_path(dtype=...)``, BF16 by default); 0 for a unit whose
        dual-path layers hold no weight (activation quantisation, MX)."""
        return lifecycle.unit_bytes(self._units)

    def _run_state(self) -> dict | None:
        if self.controller is None:
            return None
        config, policy = lifecycle.identity(self)
        return {"units": [name for name, _ in self._units], "step": int(self._last_step), "active": list(self._active),
                "controller": jsonable(self.controller.state_dict()), "config": config, "policy": policy,
                "policy_settings": self._settings, "effective_batch": self._effective_batch}

    # ---------------------------------------------------------------------------------- each step

    def on_substep_end(self, args, state, control, **kwargs):
        if self._micro is not None:
            self._micro.observe(last=False, scale=wiring.loss_scale(self._accelerator))

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """The Trainer's clip (through ``accelerator.clip_grad_norm_``), taking the per-unit norms too."""
        if self._micro is not None:
            self._micro.observe(last=True, scale=wiring.loss_scale(self._accelerator))  # still scaled, as the others
        self._accelerator.unscale_gradients()
        total, self._step_sq = self._norms.clip_(parameters, max_norm)
        self._scale_before = lifecycle.scale_before_step(self._accelerator)
        return total

    def read_norms(self) -> None:
        """Take this step's per-unit norms from the gradients as they are, in a separate pass, right before a
        clip call that is not the callback's to answer (another library's wrapper, or a norm type other than
        2): unclipped, still multiplied by an fp16 loss scale, which is divided out."""
        scale = wiring.loss_scale(self._accelerator)
        if self._micro is not None:
            self._micro.observe(last=True, scale=scale)
        sq = self._norms.sq_norms(self._norms.grads())
        if sq is None:
            sq = torch.zeros(len(self._units), dtype=torch.float64)
        self._step_sq = sq / scale**2 if scale != 1.0 else sq
        self._scale_before = lifecycle.scale_before_step(self._accelerator)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.controller is None or self._step_sq is not None:
            return
        # the clip was not ours (the callback is driven without a Trainer): norms as the gradients are now
        if self._micro is not None:
            self._micro.observe(last=True)
        self._step_sq = self._norms.sq_norms(self._norms.grads())
        if self._step_sq is None:
            raise RuntimeError(f"GNMRCallback: no unit parameter has a gradient at step {state.global_step + 1}")
        if float(args.max_grad_norm or 0) > 0:
            warnings.warn("GNMRCallback: not driven by a Trainer; norms are read after any clipping", stacklevel=2)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.controller is None:
            return
        step = state.global_step + 1
        norms = self._step_sq.sqrt()
        self._step_sq = None
        check = self._ranks.take() if self._ranks is not None else None
        if check is not None:  # one device->host transfer: this step's norms and the last rank check
            both = torch.cat([norms, check.to(norms.device, torch.float64)]).cpu()
            norms, check = both[: len(norms)], both[len(norms):]
            RankAgreement.verify(check)
        else:
            norms = norms.cpu()
        micro = self._micro.take() if self._micro is not None else []
        if lifecycle.step_was_skipped(self._accelerator, self._scale_before):
            # the loss scaler found inf/NaN and skipped the update: not a gradient spike, not a statistic
            record = {"skipped": True}
        else:
            for sq in micro:
                self.controller.observe_microbatch(sq)
            self._active = self._indices(self.controller.step(norms))
            if not all(self._recoverable[i] for i in self._active):
                raise RuntimeError(f"GNMRCallback: the controller chose units without a recovery path: {self._active}")
            self._apply(model)
            record = dict(getattr(self.controller, "last_record", None) or {})
        if self._ranks is not None:
            self._ranks.launch(step, self._active)
        self._last_step = step
        self._record(step, norms, record, model)

    def _indices(self, mask: Any) -> list[int]:
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool or mask.shape != (len(self._units),):
            raise TypeError(f"GNMRCallback: the controller must return a bool tensor of shape [{len(self._units)}], "
                            f"got {mask.dtype} {tuple(mask.shape)}")
        return torch.nonzero(mask.cpu()).flatten().tolist()

    def _apply(self, model, force: bool = False) -> None:
        if any(self._recoverable) and (force or self._active != self._applied):
            set_active_units(model, self._active, self._units)
        elif self._active and not any(self._recoverable):
            raise RuntimeError(f"GNMRCallback: units {self._active} chosen but the model has no dual-path modules")
        self._applied = list(self._active)

    # ------------------------------------------------------------------------------------ logging

    def _record(self, step: int, norms: torch.Tensor, record: dict, model) -> None:
        record["active"] = list(self._active)
        rec_bytes = sum(int(m.recovery_device_bytes()) for m in self._dual)
        self._window.add(record, rec_bytes)
        if self._trace is not None:
            line = {"step": step}
            if "step" in record and record["step"] != step:
                line["controller_step"] = record["step"]  # a policy counting its own steps
            record.pop("step", None)
            self._trace.write({**line, "norms": norms.tolist(), **record, "recovery_bytes": rec_bytes})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.controller is None or logs is None:
            return
        added: dict[str, float] = {}
        if "loss" in logs:
            added = self._window.drain()
            if getattr(self.controller, "static", False):
                added = {}  # a static plan: the same counts at every step (they are in the trace and the summary)
        elif "train_runtime" in logs:
            added = {f"gnmr/summary/{k}": float(v) for k, v in jsonable(dict(self.controller.summary())).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if added:
            logs.update(added)
            # the Trainer appended a copy of ``logs`` to the history before calling on_log
            last = state.log_history[-1] if state.log_history else {}
            if last.get("step") == state.global_step and all(k in last for k in logs if k not in added):
                last.update(added)

    # ---------------------------------------------------------------------------------- train end

    def on_train_end(self, args, state, control, **kwargs):
        self.end_run(finished=True)

    def end_run(self, finished: bool = True) -> None:
        """End the live run (no-op without one): give the clip call back, put every unit on the low-cost path
        (no recovery bytes held), close the trace; a finished run also checks the last rank agreement and
        writes the summary. The controller, ``active`` (the decision for the next step) and the checkpointed
        state stay. ``on_train_end`` calls it, and the Trainer guard when ``train()`` raises."""
        lifecycle.end_run(self, finished)

    def inference_path(self):
        """A context: the body (the Trainer's ``evaluate``/``predict`` inside a run) on the low-cost path, then
        the training mask back; nothing happens outside a run or with ``eval_on_recovery=True``."""
        return lifecycle.low_path_during_eval(self)

def attach(trainer: Any, config: GNMRConfig | dict | None = None, **kwargs: Any) -> GNMRCallback:
    """Add a :class:`GNMRCallback` to ``trainer``, first in its callback list (ahead of the reporting
    callbacks), with its checkpoint state carrier.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) not yet trained with a ``GNMRCallback``.
        config: the controller configuration (see :class:`GNMRCallback`).
        **kwargs: the other :class:`GNMRCallback` arguments.

    Returns:
        The callback (its ``controller`` is built at train begin).
    """
    if any(isinstance(cb, GNMRCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("attach: this Trainer already has a GNMRCallback")
    callback = GNMRCallback(config, **kwargs)
    wiring.place(trainer, callback)
    return callback

