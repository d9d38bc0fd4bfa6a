"""``GNMRCallback``: GNMR inside the Hugging Face ``Trainer``, on one process or many.

The callback only gathers per-unit gradient norms, calls the controller (or a user policy) and
applies its answer through :func:`gnmr_hf.set_active_units`; the statistics live in
:mod:`gnmr_hf.core.controller` and the low-cost/recovery paths in the backends. Any backend whose modules
subclass :class:`gnmr_hf.backends.base.DualPathModule` is driven the same way.

Where the Trainer's behaviour matters (transformers 5.x ``Trainer._run_epoch``):

- The Trainer clips gradients *before* ``on_pre_optimizer_step`` and reads ``args.max_grad_norm`` at
  every optimizer step. GNMR needs the norms before clipping, so the callback sets
  ``args.max_grad_norm = 0`` for the duration of each step (``on_step_begin`` .. ``on_step_end``) and
  clips itself in ``on_pre_optimizer_step`` with the user's value. With ``max_grad_norm = 0`` the
  Trainer still measures the total norm with ``accelerator.clip_grad_norm_(params, inf)`` (which
  also un-scales fp16 gradients and multiplies them by exactly 1.0), so the logged ``grad_norm`` is
  the same value the Trainer would have logged, and the clip the callback then applies,
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)``, is the call accelerate makes
  for ordinary (non-DTensor) gradients: the update is bit-identical to a run without the callback.
  Outside a step (logging, evaluation, checkpointing: ``training_args.bin``) ``args.max_grad_norm``
  holds the user's value again.
- Logs reach ``report_to`` backends through ``on_log``; the callback moves itself to the front of the
  Trainer's callback list at train begin so that TensorBoard/W&B see the ``gnmr/*`` keys it adds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import uuid
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.trainer_callback import ExportableState, TrainerCallback

from gnmr_hf.backends.base import recoverable_units, recovery_device_bytes, set_active_units
from gnmr_hf.units import Unit, resolve_units

TRACE_NAME = "gnmr_trace.jsonl"
SUMMARY_NAME = "gnmr_summary.json"
CHECKPOINT_STATE_NAME = "gnmr_state.json"

# per-step record keys that are counts (or per-unit lists whose length is the count) -> logged as gnmr/<key>
_LOGGED_KEYS = ("active", "promoted", "demoted", "over_gnmr", "over_delta", "hit_max", "nonfinite")


# ----------------------------------------------------------------------------------------------------------
# per-unit gradient norms in one fused pass
# ----------------------------------------------------------------------------------------------------------


class _UnitParams:
    """The trainable parameters of each unit, flattened for one fused norm pass.

    A parameter that belongs to several (nested or overlapping) units counts in each of them.
    """

    def __init__(self, units: Sequence[Unit]):
        self.params: list[torch.nn.Parameter] = []
        position: dict[int, int] = {}
        pair_param: list[int] = []
        pair_unit: list[int] = []
        self.counts = [0] * len(units)
        for b, (_, module) in enumerate(units):
            for p in module.parameters():
                if not p.requires_grad:
                    continue
                i = position.setdefault(id(p), len(self.params))
                if i == len(self.params):
                    self.params.append(p)
                pair_param.append(i)
                pair_unit.append(b)
                self.counts[b] += 1
        self.num_units = len(units)
        self._pair_param = torch.tensor(pair_param, dtype=torch.long)
        self._pair_unit = torch.tensor(pair_unit, dtype=torch.long)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def sq_norms(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """Per-unit squared L2 norms ``[U]`` (float64, on the tensors' device) of ``tensors``, one per
        parameter (``None`` = zero). Returns ``None`` when every entry is ``None``."""
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
        for i, t in enumerate(tensors):
            if t is not None:
                ts, pos = groups.setdefault((t.device, t.dtype), ([], []))
                ts.append(t)
                pos.append(i)
        if not groups:
            return None
        device = next(iter(groups))[0]
        sq = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        for (_, dtype), (ts, pos) in groups.items():
            # fp32 accumulation for half-precision gradients: a bf16 norm has 3 significant digits
            norms = torch._foreach_norm(ts, 2, dtype=torch.float32) if dtype in (torch.float16, torch.bfloat16) else torch._foreach_norm(ts, 2)
            vals = torch.stack([n.to(device) for n in norms]).to(torch.float64).square()
            if len(pos) == len(self.params):
                sq = vals
            else:
                sq[torch.tensor(pos, device=device)] = vals
        pair_param, pair_unit = self._index(device)
        return torch.zeros(self.num_units, dtype=torch.float64, device=device).index_add_(0, pair_unit, sq[pair_param])

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self._pair_param.to(device), self._pair_unit.to(device))
        return self._on[device]


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def _find_trainer() -> Any:
    """The ``Trainer`` whose callback handler is calling us (callbacks are not handed the Trainer).

    Walks up the call stack to the first frame whose ``self`` is a ``transformers.Trainer`` (or a
    subclass such as trl's ``SFTTrainer``). Returns ``None`` when the callback is driven by hand.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    return x


def _as_number(v: Any) -> float | None:
    """A logged scalar for a record entry: lists count their members, bools become 0/1."""
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (list, tuple, set)):
        return float(len(v))
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _is_factory(policy: Any) -> bool:
    return isinstance(policy, type) or (callable(policy) and not hasattr(policy, "step"))


def _dist_world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


# ----------------------------------------------------------------------------------------------------------
# the callback
# ----------------------------------------------------------------------------------------------------------


class GNMRCallback(TrainerCallback, ExportableState):
    """Run GNMR (Gradient Norm-to-Mean Ratio) precision control inside a ``transformers.Trainer``.

    At train begin the callback finds the units (the decoder layers by default), groups each unit's
    trainable parameters, finds which units have a recovery path (a
    :class:`~gnmr_hf.backends.base.DualPathModule` inside them) and builds the controller. At every
    optimizer step it takes each unit's gradient norm *before clipping* (after gradient accumulation
    and after the DDP all-reduce), clips with the user's ``max_grad_norm`` exactly as the Trainer would,
    steps the controller and puts the chosen units on the recovery path for the next step. On a model
    without dual-path modules it runs monitor-only: a per-layer gradient-spike monitor whose run is
    bit-identical to one without the callback.

    Outputs: ``gnmr/active``, ``gnmr/promoted``, ``gnmr/demoted``, ``gnmr/over_gnmr``,
    ``gnmr/over_delta``, ``gnmr/hit_max`` (fraction of steps), ``gnmr/nonfinite`` and
    ``gnmr/recovery_bytes`` added to the Trainer's training logs (means over the steps since the last
    log; ``recovery_bytes`` the maximum), ``gnmr/summary/*`` added to the final training metrics; on the
    main process a JSONL trace ``{output_dir}/gnmr_trace.jsonl`` (one line per optimizer step: ``step``,
    ``norms``, ``active`` = units active for the *next* step, ``gnmr``, ``delta``, ``risk``, counts,
    ``recovery_bytes``; flushed per line; non-finite values written as ``NaN``/``Infinity``) and
    ``{output_dir}/gnmr_summary.json`` at train end. The controller state is saved with every
    checkpoint (``trainer_state.json`` through ``ExportableState``, and ``gnmr_state.json`` in the
    checkpoint folder) and restored on ``resume_from_checkpoint`` whether or not
    ``restore_callback_states_from_checkpoint`` is set; the trace is truncated to the resumed step.
    (With that flag on, the Trainer replaces this instance by one rebuilt from :meth:`state`: find it in
    ``trainer.callback_handler.callbacks``. A units callable or a policy, which are not JSON-safe, are
    taken from the instance the state was saved from when it is alive, else from the last
    ``GNMRCallback`` built in this process.)

    Args:
        config (`GNMRConfig` or `dict`, *optional*): controller configuration (a dict is passed to
            ``GNMRConfig.from_dict``). Defaults to ``GNMRConfig()``.
        units (*optional*): which modules are units: ``None`` for the decoder layers, a list of module
            names, or a callable ``model -> [(name, module), ...]`` (see
            :func:`gnmr_hf.units.resolve_units`).
        policy (*optional*): a trigger policy used instead of ``GNMRController`` (baselines). Either an
            object, or a class/factory (anything callable without a ``step`` attribute, e.g.
            ``functools.partial(GSNRPolicy, max_active=10)``) called at train begin as
            ``policy(num_units, recoverable=recoverable)``, ``recoverable`` being a list of ``U`` bools.
            The object must provide:

            - ``step(norms: Tensor[U]) -> Tensor[U] (bool)``: takes this step's per-unit gradient norms
              (float64, CPU; NaN/Inf possible) and returns the units active for the *next* step;
            - ``initial_mask() -> Tensor[U] (bool)``: the units active for step 1;
            - ``state_dict() -> dict`` (JSON-serialisable) and ``load_state_dict(sd)``: exact resume;
            - ``last_record: dict``: the record of the last ``step``; must hold ``"active"`` (indices);
              ``promoted``, ``demoted``, ``over_gnmr``, ``over_delta``, ``hit_max``, ``nonfinite``,
              ``gnmr``, ``delta``, ``risk`` are logged/traced when present;
            - ``summary() -> dict[str, float]``: run summary, logged as ``gnmr/summary/<key>``;
            - optionally ``needs_microbatch_norms: bool`` and ``observe_microbatch(sq_norms: Tensor[U])``:
              when true, before each ``step`` the callback passes, for every micro-batch of the
              gradient-accumulation window in order, the per-unit *squared* L2 norm of the gradient
              that micro-batch added (float64, CPU). Single-process only.
        init_fraction (`float`, *optional*): length of the initial-threshold phase as a fraction of
            ``max_steps``; converted to ``config.init_steps = round(init_fraction * max_steps)`` at train
            begin (then ``config.init_steps`` must be left at 0).
        trace (`bool` or `str`, defaults to `True`): write the JSONL trace and summary (a string is the
            trace path; the summary goes next to it).
        check_ranks (`bool`, defaults to `True`): under ``torch.distributed``, check every step (one
            small ``all_reduce``, read back with the next step's norms) that all ranks took the same
            decision; raise ``RuntimeError`` if not.

    Not supported (``ValueError`` at train begin): DeepSpeed, FSDP, DTensor gradients. Also at train
    begin: ``ValueError`` if no units are found or no unit has a trainable parameter.

    Note:
        A non-finite total gradient norm: the Trainer's own norm pass (``clip_grad_norm_`` with
        ``max_norm=inf``, which runs even when clipping is off) multiplies every gradient by NaN
        before any callback sees it, so a NaN/Inf produced in the backward of one unit reaches GNMR as
        NaN in every unit (all escalated, up to ``max_active``, lowest indices first). The clip the
        callback applies then behaves as the Trainer's for NaN (every gradient NaN); for a +Inf total
        norm with ``max_grad_norm > 0`` the Trainer would have zeroed the finite gradients instead.
    """

    # instances built by user code, so that a copy rebuilt by the Trainer from the JSON-safe
    # ``state()["args"]`` can take the arguments that are not JSON-safe (a units callable, a policy):
    # the same instance when it is alive in this process, else the last one built (a new process)
    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _last_user_instance: weakref.ReferenceType | None = None

    def __init__(
        self,
        config: Any = None,
        units: Any = None,
        policy: Any = None,
        init_fraction: float | None = None,
        trace: bool | str = True,
        check_ranks: bool = True,
        _take_unsafe_args_from_live: bool | str = False,
    ):
        from gnmr_hf.core.controller import GNMRConfig

        self._token = uuid.uuid4().hex
        if _take_unsafe_args_from_live:
            live = GNMRCallback._live.get(_take_unsafe_args_from_live) if isinstance(_take_unsafe_args_from_live, str) else None
            if live is None and GNMRCallback._last_user_instance is not None:
                live = GNMRCallback._last_user_instance()
            if live is None:
                raise RuntimeError(
                    "GNMRCallback is being rebuilt from a checkpoint whose units or policy are not JSON-safe, "
                    "and no GNMRCallback built by user code is alive to take them from"
                )
            units = live.units if units is None else units
            policy = live.policy if policy is None else policy
            if isinstance(_take_unsafe_args_from_live, str):
                self._token = _take_unsafe_args_from_live  # a later checkpoint of this copy finds it again
        else:
            GNMRCallback._last_user_instance = weakref.ref(self)
        GNMRCallback._live[self._token] = self

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
            if isinstance(init_fraction, bool) or not isinstance(init_fraction, (int, float)) or not 0 <= init_fraction <= 1:
                raise ValueError(f"GNMRCallback: init_fraction must be a number in [0, 1], got {init_fraction!r}")
            if config.init_steps:
                raise ValueError("GNMRCallback: give init_fraction or config.init_steps, not both")
        if isinstance(units, str):
            raise TypeError("GNMRCallback: units must be a list of module names or a callable, not a single string")
        if not isinstance(trace, (bool, str)):
            raise TypeError(f"GNMRCallback: trace must be a bool or a path, got {type(trace).__name__}")

        self.config = config
        self.units = units
        self.policy = policy
        self.init_fraction = init_fraction
        self.trace = trace
        self.check_ranks = bool(check_ranks)

        # set by the Trainer (restore_callback_states_from_checkpoint=True) or read from
        # state.stateful_callbacks at train begin
        self._resume_state: dict | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self.controller: Any = None
        self._units: list[Unit] | None = None
        self._params: _UnitParams | None = None
        self._recoverable: list[bool] = []
        self._active: list[int] = []
        self._user_max_grad_norm: float | None = None
        self._took_over_clip = False
        self._args = None
        self._trace_file = None
        self._trace_path: str | None = None
        self._window: list[dict[str, float]] = []
        self._pending_check: torch.Tensor | None = None
        self._comm_device: torch.device | None = None
        self._micro_snapshot: list[torch.Tensor | None] | None = None
        self._model_for_clip: Any = None
        self._warned_clipped = False
        self._last_step = 0

    # -------------------------------------------------------------------------------------------- state

    def state(self) -> dict:
        """``ExportableState``: JSON-safe constructor arguments and the controller state."""
        unsafe = callable(self.units) or self.policy is not None or (
            self.units is not None and not all(isinstance(u, str) for u in self.units)
        )
        args = {
            "config": self.config.to_dict() if self.config is not None else None,
            "units": None if unsafe else (list(self.units) if self.units is not None else None),
            "init_fraction": self.init_fraction,
            "trace": self.trace,
            "check_ranks": self.check_ranks,
        }
        if unsafe:
            args["_take_unsafe_args_from_live"] = self._token
        return {"args": args, "attributes": {"_resume_state": self._export_run_state()}}

    def _export_run_state(self) -> dict | None:
        if self.controller is None:
            return self._resume_state  # not started yet: keep what we were given
        return {
            "controller": _jsonable(self.controller.state_dict()),
            "active": list(self._active),
            "unit_names": [name for name, _ in self._units],
            "step": int(self._last_step),
        }

    # -------------------------------------------------------------------------------------- train begin

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._reset_run()
        trainer = _find_trainer()
        self._check_supported(args, trainer)
        if model is None:
            raise ValueError("GNMRCallback needs the model (the Trainer passes it to callbacks)")
        self._args = args

        try:
            units = resolve_units(model, self.units)
        except ValueError as e:
            raise ValueError(f"GNMRCallback found no units in {type(model).__name__}: {e}") from e
        self._units = units
        self._params = _UnitParams(units)
        if not self._params.params:
            raise ValueError(
                f"GNMRCallback: none of the {len(units)} units ({units[0][0]}, ...) holds a trainable parameter, "
                "so there is no gradient to monitor"
            )
        empty = [name for (name, _), c in zip(units, self._params.counts) if c == 0]
        if empty:
            warnings.warn(f"GNMRCallback: units without trainable parameters (norm always 0): {empty}", stacklevel=2)
        self._recoverable = recoverable_units(model, units)
        self._build_controller(len(units), state)

        if getattr(self.policy, "needs_microbatch_norms", False) and _dist_world() > 1:
            raise ValueError("GNMRCallback: a policy with needs_microbatch_norms is supported on a single process only")

        saved = self._find_saved_state(state)
        self._last_step = state.global_step
        if state.global_step > 0 and saved is not None:
            names = [name for name, _ in units]
            if saved.get("unit_names") != names:
                raise ValueError(
                    "GNMRCallback: the checkpoint's units differ from this model's "
                    f"({len(saved.get('unit_names') or [])} vs {len(names)} units)"
                )
            if saved.get("step") != state.global_step:
                raise ValueError(
                    f"GNMRCallback: the saved controller state is from step {saved.get('step')}, "
                    f"the Trainer resumes at step {state.global_step}"
                )
            self.controller.load_state_dict(saved["controller"])
            active = list(saved["active"])
        else:
            if state.global_step > 0:
                warnings.warn(
                    f"GNMRCallback: resuming at step {state.global_step} without a saved GNMR state (the checkpoint "
                    "was made without this callback); the controller starts from scratch",
                    stacklevel=2,
                )
            active = self._mask_to_indices(self.controller.initial_mask())
        self._apply(model, active, force=True)
        self._resume_state = None

        self._user_max_grad_norm = float(args.max_grad_norm or 0.0)
        self._model_for_clip = getattr(trainer, "model_wrapped", None) or model
        if _dist_world() > 1:
            backend = torch.distributed.get_backend()
            self._comm_device = (
                torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            )
        if state.is_world_process_zero and self.trace:
            self._open_trace(args, state.global_step)
        if trainer is not None:
            # reporting callbacks (TensorBoard, W&B) run before user callbacks; go first so they see gnmr/*
            callbacks = trainer.callback_handler.callbacks
            if self in callbacks and callbacks[0] is not self:
                callbacks.remove(self)
                callbacks.insert(0, self)

    def _check_supported(self, args, trainer) -> None:
        if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError("GNMRCallback does not support DeepSpeed (it needs the full per-unit gradients on every rank)")
        if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError("GNMRCallback does not support FSDP (gradients are sharded); use DDP")
        accelerator = getattr(trainer, "accelerator", None)
        kind = str(getattr(accelerator, "distributed_type", ""))
        if "DEEPSPEED" in kind or "FSDP" in kind:
            raise ValueError(f"GNMRCallback does not support the {kind} accelerate setup; use DDP")

    def _build_controller(self, num_units: int, state) -> None:
        if self.policy is not None:
            self.controller = (
                self.policy(num_units, recoverable=list(self._recoverable)) if _is_factory(self.policy) else self.policy
            )
            for name in ("step", "initial_mask", "state_dict", "load_state_dict", "summary"):
                if not callable(getattr(self.controller, name, None)):
                    raise TypeError(f"GNMRCallback: the policy {type(self.controller).__name__} has no method {name}()")
            return
        from gnmr_hf.core.controller import GNMRController

        config = self.config
        if self.init_fraction is not None:
            # round half up, so 2.5% of 100 steps is 3 steps, as a reader of the paper would count
            init_steps = int(math.floor(self.init_fraction * state.max_steps + 0.5))
            config = dataclasses.replace(config, init_steps=init_steps)
        self.controller = GNMRController(num_units, config, recoverable=list(self._recoverable))

    def _find_saved_state(self, state) -> dict | None:
        if self._resume_state is not None:
            return self._resume_state
        entry = (state.stateful_callbacks or {}).get(type(self).__name__)
        entries = entry if isinstance(entry, list) else [entry] if entry else []
        names = [name for name, _ in self._units]
        for e in entries:
            saved = (e.get("attributes") or {}).get("_resume_state")
            if saved and saved.get("unit_names") == names:
                return saved
        for e in entries:  # units changed: let on_train_begin report it
            saved = (e.get("attributes") or {}).get("_resume_state")
            if saved:
                return saved
        return None

    def _open_trace(self, args, resume_step: int) -> None:
        path = self.trace if isinstance(self.trace, str) else os.path.join(args.output_dir, TRACE_NAME)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept: list[str] = []
        if resume_step > 0 and os.path.exists(path):
            # lines past the resumed step belong to the lost part of an interrupted run
            with open(path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        break  # a line cut short by a crash ends the usable trace
                    if step <= resume_step:
                        kept.append(line)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(tmp, path)
        self._trace_path = path
        self._trace_file = open(path, "a", encoding="utf-8")

    # ---------------------------------------------------------------------------------------- each step

    def on_step_begin(self, args, state, control, **kwargs):
        if self.controller is None:
            return
        if self._user_max_grad_norm > 0:
            # the Trainer clips before on_pre_optimizer_step; with 0 it only measures the norm
            args.max_grad_norm = 0.0
            self._took_over_clip = True

    def on_substep_end(self, args, state, control, **kwargs):
        if self.controller is not None and getattr(self.controller, "needs_microbatch_norms", False):
            self._observe_microbatch()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.controller is None:
            return
        step = state.global_step + 1
        if getattr(self.controller, "needs_microbatch_norms", False):
            self._observe_microbatch(last=True)

        sq = self._params.sq_norms(self._params.grads())
        if sq is None:
            raise RuntimeError(f"GNMRCallback: no unit parameter has a gradient at step {step}")
        norms = sq.sqrt()
        # a single device->host transfer: this step's norms plus the previous step's rank check
        if self._pending_check is not None:
            both = torch.cat([norms, self._pending_check.to(norms.device, torch.float64)]).cpu()
            norms_cpu, check = both[: len(norms)], both[len(norms) :]
            self._pending_check = None
            self._verify_ranks(check)
        else:
            norms_cpu = norms.cpu()

        self._clip(args)

        mask = self.controller.step(norms_cpu)
        active = self._mask_to_indices(mask)
        if len(active) and not all(self._recoverable[i] for i in active):
            raise RuntimeError(f"GNMRCallback: the controller chose units without a recovery path: {active}")
        self._apply(model, active)
        self._launch_rank_check(step, active)
        self._last_step = step
        self._record(step, norms_cpu, model)

    def on_step_end(self, args, state, control, **kwargs):
        if self._took_over_clip:
            args.max_grad_norm = self._user_max_grad_norm
            self._took_over_clip = False

    def _clip(self, args) -> None:
        if self._took_over_clip:
            if self._user_max_grad_norm > 0:
                params = self._model_for_clip.parameters()
                torch.nn.utils.clip_grad_norm_(params, self._user_max_grad_norm)
        elif float(args.max_grad_norm or 0.0) > 0 and not self._warned_clipped:
            # on_step_begin did not run for this step (callbacks driven by hand?): the Trainer has clipped
            self._warned_clipped = True
            warnings.warn("GNMRCallback: gradients were clipped before the callback saw them; norms are post-clip", stacklevel=2)

    def _observe_microbatch(self, last: bool = False) -> None:
        grads = self._params.grads()
        if self._micro_snapshot is None:
            added = grads
        else:
            added = [
                g if s is None else (-s if g is None else g - s) for g, s in zip(grads, self._micro_snapshot)
            ]
        sq = self._params.sq_norms(added)
        if sq is None:
            sq = torch.zeros(self._params.num_units, dtype=torch.float64)
        self.controller.observe_microbatch(sq.cpu())
        # the next window starts from zeroed gradients
        self._micro_snapshot = None if last else [None if g is None else g.detach().clone() for g in grads]

    def _mask_to_indices(self, mask: Any) -> list[int]:
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool or mask.shape != (self._params.num_units,):
            raise TypeError(
                f"GNMRCallback: the controller must return a bool tensor of shape [{self._params.num_units}], "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        return torch.nonzero(mask.cpu()).flatten().tolist()

    def _apply(self, model, active: list[int], force: bool = False) -> None:
        if force or active != self._active:
            if any(self._recoverable):
                set_active_units(model, active, self._units)
            elif active:
                raise RuntimeError(f"GNMRCallback: units {active} chosen but the model has no dual-path modules")
        self._active = active

    # ------------------------------------------------------------------------------------ rank agreement

    def _launch_rank_check(self, step: int, active: list[int]) -> None:
        if not self.check_ranks or self._comm_device is None:
            return
        v = torch.zeros(self._params.num_units + 1, dtype=torch.float64)
        v[0] = step
        v[1:][active] = 1.0
        buf = torch.cat([v, -v])
        if self._comm_device.type == "cuda":
            # pinned + non_blocking: a pageable host->device copy would wait for the stream
            buf = buf.pin_memory().to(self._comm_device, non_blocking=True)
        # MAX of (v, -v) gives max and -min over ranks in one collective
        torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
        self._pending_check = buf

    def _verify_ranks(self, check: torch.Tensor) -> None:
        n = len(check) // 2
        hi, lo = check[:n], -check[n:]
        if not torch.equal(hi, lo):
            differ = torch.nonzero(hi != lo).flatten().tolist()
            units = [i - 1 for i in differ if i > 0]
            raise RuntimeError(
                f"GNMRCallback: ranks disagree on the GNMR decision of step {int(hi[0])}"
                + (f" (units {units})" if units else " (step counters differ)")
                + "; gradients or controller states differ between processes"
            )

    def _flush_rank_check(self) -> None:
        if self._pending_check is not None:
            check = self._pending_check.cpu()
            self._pending_check = None
            self._verify_ranks(check)

    # ------------------------------------------------------------------------------------------ logging

    def _record(self, step: int, norms: torch.Tensor, model) -> None:
        record = dict(getattr(self.controller, "last_record", None) or {})
        record["active"] = list(self._active)
        rec_bytes = int(recovery_device_bytes(model)) if any(self._recoverable) else 0
        scalars = {}
        for key in _LOGGED_KEYS:
            if key in record:
                v = _as_number(record[key])
                if v is not None:
                    scalars[key] = v
        scalars["recovery_bytes"] = float(rec_bytes)
        self._window.append(scalars)
        if self._trace_file is not None:
            line = {"step": step}
            if "step" in record and record["step"] != step:
                line["controller_step"] = record["step"]
            record.pop("step", None)
            line["norms"] = norms.tolist()
            line.update(_jsonable(record))
            line["recovery_bytes"] = rec_bytes
            self._trace_file.write(json.dumps(line) + "\n")
            self._trace_file.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.controller is None or logs is None:
            return
        added: dict[str, float] = {}
        if "loss" in logs and self._window:
            keys = {k for s in self._window for k in s}
            for k in sorted(keys):
                vals = [s[k] for s in self._window if k in s]
                added[f"gnmr/{k}"] = max(vals) if k == "recovery_bytes" else sum(vals) / len(vals)
            self._window = []
        elif "train_runtime" in logs:
            for k, v in self._summary().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    added[f"gnmr/summary/{k}"] = float(v)
        if added:
            logs.update(added)
            # the Trainer appended a copy of ``logs`` to the history before calling on_log
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                if all(k in state.log_history[-1] for k in logs if k not in added):
                    state.log_history[-1].update(added)

    def _summary(self) -> dict:
        return _jsonable(dict(self.controller.summary()))

    # ---------------------------------------------------------------------------------- save / train end

    def on_save(self, args, state, control, **kwargs):
        if self.controller is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            with open(os.path.join(folder, CHECKPOINT_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(self._export_run_state(), f)

    def on_train_end(self, args, state, control, **kwargs):
        if self.controller is None:
            return
        if self._user_max_grad_norm is not None:
            args.max_grad_norm = self._user_max_grad_norm
        self._took_over_clip = False
        self._flush_rank_check()
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None
            with open(os.path.join(os.path.dirname(self._trace_path), SUMMARY_NAME), "w", encoding="utf-8") as f:
                json.dump(
                    {"summary": self._summary(), "steps": int(self._last_step), "units": [n for n, _ in self._units],
                     "recoverable": list(self._recoverable)},
                    f,
                    indent=2,
                )

    # ------------------------------------------------------------------------------------------ helpers

    @property
    def unit_names(self) -> list[str]:
        """Qualified names of the units (available after train begin)."""
        return [name for name, _ in self._units] if self._units else []

    @property
    def active(self) -> list[int]:
        """Units on the recovery path for the next step."""
        return list(self._active)
