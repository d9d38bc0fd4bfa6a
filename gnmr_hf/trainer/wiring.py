"""How ``GNMRCallback`` plugs into a ``transformers.Trainer``: finding it, its place in the callback
list, the clip call it answers, the Trainer calls it guards, and the set-ups it refuses.

Callbacks are not handed the Trainer. :func:`gnmr_hf.trainer.callback.attach` gives it explicitly; the
drop-in ``callbacks=[GNMRCallback()]`` finds it on the call stack (:func:`find_trainer`) at
``on_init_end`` and ``on_train_begin``.

The Trainer has no event for "train() raised" nor for "evaluation begins", so :func:`guard` wraps the
Trainer's own ``train``, ``evaluate`` and ``predict`` (instance attributes, once per Trainer): a run
that raises ends with every unit on the low-cost path and the clip call given back, and evaluation
inside a run runs on the low-cost path (docs/design.md, "Outside the training steps").
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch

from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.trainer.state import GNMRState

_GUARD = "_gnmr_guard"


def find_trainer(callback: Any) -> Any:
    """The ``Trainer`` whose callback handler is calling ``callback``, or ``None`` (driven by hand).

    Walks up the call stack to the first frame whose ``self`` is a ``transformers.Trainer`` (or a
    subclass such as trl's ``SFTTrainer``) holding ``callback``.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer) and callback in obj.callback_handler.callbacks:
            return obj
        frame = frame.f_back
    return None


def place(trainer: Any, callback: Any) -> None:
    """Put ``callback`` first in the Trainer's callback list (reporting callbacks such as TensorBoard's
    are added before user callbacks; going first lets them see the ``gnmr/*`` keys), and its
    ``state_carrier`` in the list, in place of a copy the Trainer rebuilt from a checkpoint."""
    callbacks = trainer.callback_handler.callbacks
    if callbacks[:1] != [callback]:
        if callback in callbacks:
            callbacks.remove(callback)
        callbacks.insert(0, callback)
    if callback.state_carrier not in callbacks:
        orphan = next((i for i, cb in enumerate(callbacks) if isinstance(cb, GNMRState) and cb.source is None), None)
        if orphan is None:
            callbacks.append(callback.state_carrier)
        else:
            callbacks[orphan] = callback.state_carrier
    guard(trainer)


class _Guard:
    """What :func:`guard` keeps on one Trainer.

    Attributes:
        live: the callbacks whose run on this Trainer has begun and not yet ended.
    """

    def __init__(self) -> None:
        self.live: list[Any] = []

    def end_runs(self) -> None:
        """End every live run as a run that did not finish (low-cost path, clip given back)."""
        for callback in list(self.live):
            callback.end_run(finished=False)


def guard(trainer: Any) -> _Guard:
    """Wrap the Trainer's ``train``, ``evaluate`` and ``predict`` once (instance attributes).

    - ``train``: before the call, a run left live by an earlier call (one that raised past a callback
      added after the Trainer was built) is ended, and state carriers whose callback was removed are
      dropped; after the call, normally or by an exception, every run still live is ended: its units go
      back to the low-cost path and the clip call is given back. On a normal return ``on_train_end`` has
      already done this.
    - ``evaluate`` / ``predict``: every live run's callback puts its units on the low-cost path for the
      call and its training mask back after it (unless it was built with ``eval_on_recovery=True``).

    Returns:
        The guard (the live runs), shared by every callback of this Trainer.
    """
    found = trainer.__dict__.get(_GUARD)
    if found is not None:
        return found
    kept = _Guard()
    train, evaluate, predict = trainer.train, trainer.evaluate, trainer.predict

    @functools.wraps(train)
    def guarded_train(*args, **kwargs):
        kept.end_runs()  # train() is not re-entrant: whatever is live now is left over
        drop_orphan_carriers(trainer)
        try:
            return train(*args, **kwargs)
        finally:
            kept.end_runs()

    def on_low_path(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                for callback in list(kept.live):
                    stack.enter_context(callback.inference_path())
                return fn(*args, **kwargs)

        return run

    trainer.train, trainer.evaluate, trainer.predict = guarded_train, on_low_path(evaluate), on_low_path(predict)
    trainer.__dict__[_GUARD] = kept
    return kept


def drop_orphan_carriers(trainer: Any) -> None:
    """Remove the state carriers whose callback is no longer in the Trainer's list (the user removed the
    callback): a run without it then saves checkpoints as a plain Trainer does."""
    callbacks = trainer.callback_handler.callbacks
    for carrier in [cb for cb in callbacks if isinstance(cb, GNMRState)]:
        owner = getattr(carrier.source, "__self__", None)
        if owner is not None and owner not in callbacks:
            callbacks.remove(carrier)


def is_accelerate_clip(accelerator: Any) -> bool:
    """Whether ``accelerator.clip_grad_norm_`` is accelerate's own method (not replaced on the instance nor
    overridden by a subclass)."""
    from accelerate import Accelerator

    if getattr(type(accelerator), "clip_grad_norm_", None) is not Accelerator.clip_grad_norm_:
        return False
    own = vars(accelerator).get("clip_grad_norm_")
    # an instance attribute holding the method bound to this accelerator is still accelerate's own
    return own is None or (getattr(own, "__func__", None) is Accelerator.clip_grad_norm_
                           and getattr(own, "__self__", None) is accelerator)


def take_over_clip(trainer: Any, callback: Any) -> bool:
    """Route the Trainer's clip call (``accelerator.clip_grad_norm_``, its one norm pass per step) through
    ``callback`` for the run that begins.

    With accelerate's own method in place, the call is answered by ``callback.clip_grad_norm_`` (the fused
    clip that yields the per-unit norms; 2-norms). When something else already replaced the method (another
    library's wrapper), that wrapper is kept and called as before, once per call, with the same arguments;
    ``callback.read_norms()`` first reads the per-unit norms of the unclipped gradients in a separate pass.
    The routing passes calls straight on once the run has ended or the callback left the Trainer.

    Returns:
        ``True`` when the norms are read in a separate pass (a foreign clip method).
    """
    accelerator = trainer.accelerator
    give_back_clip(accelerator)  # a run that raised leaves its routing behind
    foreign = not is_accelerate_clip(accelerator)
    original = accelerator.clip_grad_norm_
    token = object()

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        if callback.clip_token is not token or callback not in trainer.callback_handler.callbacks:
            return original(parameters, max_norm, norm_type=norm_type)
        if foreign or norm_type != 2:
            callback.read_norms()
            return original(parameters, max_norm, norm_type=norm_type)
        return callback.clip_grad_norm_(parameters, max_norm)

    clip_grad_norm_.gnmr_original = original
    clip_grad_norm_.gnmr_on_instance = "clip_grad_norm_" in vars(accelerator)
    accelerator.clip_grad_norm_ = clip_grad_norm_
    callback.clip_token = token
    return foreign


def give_back_clip(accelerator: Any) -> None:
    """Undo :func:`take_over_clip` (when the routing is still the outermost replacement of the method): the
    instance attribute it replaced is put back, or removed when there was none (the class's method again)."""
    routing = vars(accelerator).get("clip_grad_norm_")
    original = getattr(routing, "gnmr_original", None)
    if original is None:
        return
    if routing.gnmr_on_instance:
        accelerator.clip_grad_norm_ = original
    else:
        del accelerator.clip_grad_norm_


def effective_batch(args: Any, trainer: Any) -> int:
    """Samples per optimizer step: per-device batch x gradient accumulation x data-parallel processes (the
    Trainer's own count when there is a Trainer: the batch ``auto_find_batch_size`` settled on, without
    tensor/context/sequence-parallel ranks)."""
    if trainer is not None and callable(getattr(trainer, "get_total_train_batch_size", None)):
        return int(trainer.get_total_train_batch_size(args))
    return int(args.train_batch_size * args.gradient_accumulation_steps * args.world_size)


def loss_scale(accelerator: Any) -> float:
    """The fp16 loss scale the gradients are multiplied by until unscaled (1.0 without a scaler)."""
    scaler = getattr(accelerator, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


def refuse_second(trainer: Any, kind: type) -> None:
    """``ValueError`` naming them when the Trainer holds more than one callback of ``kind``: two would both
    answer the clip call and switch the same layers."""
    found = [(i, cb) for i, cb in enumerate(trainer.callback_handler.callbacks) if isinstance(cb, kind)]
    if len(found) > 1:
        named = " and ".join(f"callbacks[{i}] = {cb!r}" for i, cb in found)
        raise ValueError(
            f"{kind.__name__}: this Trainer has {len(found)} {kind.__name__}s ({named}); a Trainer takes one "
            f"{kind.__name__} (two would both answer the clip call and switch the same layers). Remove one with "
            "trainer.remove_callback(callback)."
        )


def refuse_unprepared(model: torch.nn.Module, max_active: int, recoverable: list[bool], dual: list) -> None:
    """``ValueError`` for a controller that may put units on the recovery path (``max_active > 0``) when no
    unit has one: most likely ``prepare_dual_path`` was forgotten (``max_active=0`` is a monitor)."""
    if max_active == 0 or any(recoverable):
        return
    where = ("none of its units holds a dual-path module" if dual
             else f"the model ({type(model).__name__}) has no dual-path module")
    raise ValueError(
        f"GNMRCallback: GNMRConfig(max_active={max_active}) puts up to {max_active} units on the recovery path, "
        f"but {where}. Load the model in 8-bit or 4-bit and call gnmr_hf.prepare_dual_path(model, "
        "recovery_source=..., storage=...) before peft.get_peft_model(...); for a deliberate monitor-only run "
        "(a per-layer gradient-spike monitor) pass GNMRConfig(max_active=0)."
    )


BNB_FSDP_REFUSED = (
    "GNMRCallback: bitsandbytes dual-path layers ({names}) cannot run under FSDP: {why}. Shard a 4-bit base "
    "stored in a float dtype (BitsAndBytesConfig(bnb_4bit_quant_storage=<compute dtype>), FSDP2: docs/fsdp2.md, "
    "recipes/accelerate/fsdp2-qlora.yaml; a uint8-stored 4-bit weight is what accelerate issue #3983 / PR #3987 "
    "keep out of the sharding), or train with DDP: accelerate launch --multi_gpu --num_processes N "
    "(recipes/accelerate/2gpu-ddp.yaml), each GPU holding the quantised model."
)

#: why each bitsandbytes dual path that stays refused under FSDP is refused (one line each)
BNB_FSDP_WHY = {
    "int8": "an INT8 base (Int8Params: integer weights with their row scales beside them) cannot be sharded by FSDP",
    "uint8": "its 4-bit weights are stored as uint8, which FSDP cannot shard (a float bnb_4bit_quant_storage can be)",
    "fsdp1": "FSDP1 (flat parameters) is not supported; the 4-bit dual path shards under FSDP2 only",
}


def bnb_dual_path(model: torch.nn.Module) -> list[str]:
    """Names of the dual-path modules built on a bitsandbytes layer (INT8 ``Linear8bitLt``, 4-bit ``Linear4bit``)."""
    return [name for name, m in model.named_modules() if isinstance(m, DualPathModule)
            and any(c.__module__.split(".")[0] == "bitsandbytes" for c in type(m).__mro__)]


def bnb_unshardable(model: torch.nn.Module) -> tuple[list[str], str]:
    """The bitsandbytes dual-path modules FSDP cannot shard and why (:data:`BNB_FSDP_WHY`'s key): INT8 bases, and
    4-bit bases whose packed weight is not a float tensor (the default uint8 ``bnb_4bit_quant_storage``). A 4-bit
    base stored in a float dtype shards as an ordinary tensor under FSDP2 (its quantisation state stays on the
    module, where bitsandbytes restores it after the all-gather); an INT8 *rung* of the ladder is a plain attribute,
    not a parameter, and stays whole on every rank."""
    from torch.distributed.tensor import DTensor

    names = bnb_dual_path(model)
    mods = dict(model.named_modules())
    int8 = [n for n in names if not any(c.__name__ == "Linear4bit" for c in type(mods[n]).__mro__)]
    if int8:
        return int8, "int8"

    def floating(w: torch.Tensor) -> bool:
        return (w.to_local() if isinstance(w, DTensor) else w).is_floating_point()

    return [n for n in names if not floating(mods[n].weight)], "uint8"


def fsdp_requested(args: Any, trainer: Any) -> bool:
    """Whether the run asks for FSDP: ``TrainingArguments(fsdp=...)``, an accelerate FSDP plugin or state."""
    kind = str(getattr(getattr(trainer, "accelerator", None), "distributed_type", ""))
    return bool(getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False) or "FSDP" in kind)


def _fsdp1_requested(args: Any, trainer: Any) -> bool:
    acc = getattr(trainer, "accelerator", None)
    if acc is not None and getattr(acc, "state", None) is not None and "FSDP" in str(acc.distributed_type):
        return not getattr(acc, "is_fsdp2", False)
    config = getattr(args, "fsdp_config", None) or {}
    version = config.get("version", config.get("fsdp_version", 1)) if isinstance(config, dict) else 1
    return bool(getattr(args, "fsdp", None)) and int(version) != 2


def refuse_bnb_sharded(args: Any, trainer: Any, model: torch.nn.Module) -> None:
    """``ValueError`` (:data:`BNB_FSDP_REFUSED`) for bitsandbytes dual-path layers that FSDP cannot shard, in a run
    that asks for FSDP or whose parameters are already ``DTensor`` s: INT8 bases, uint8-stored 4-bit bases, and any
    of them under FSDP1 (:data:`BNB_FSDP_WHY`). A 4-bit base stored in a float dtype is sharded by FSDP2.
    Checked when the callback joins the Trainer (before accelerate shards the model) and again at train begin."""
    if model is None:
        return
    sharded = fsdp_requested(args, trainer) or _any_dtensor(model)
    if not sharded:
        return
    names, why = bnb_unshardable(model)
    if not names and bnb_dual_path(model) and _fsdp1_requested(args, trainer):
        names, why = bnb_dual_path(model), "fsdp1"
    if names:
        shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        raise ValueError(BNB_FSDP_REFUSED.format(names=shown, why=BNB_FSDP_WHY[why]))


def _any_dtensor(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def fsdp2_mesh(model: torch.nn.Module) -> Any:
    """The 1-D device mesh of an FSDP2 model whose trainable parameters are all ``DTensor`` shards on it (``None``
    for a model without ``DTensor`` parameters).

    Raises:
        ValueError: ``DTensor`` parameters that are not such FSDP2 shards: tensor parallelism (replicated or
            partial placements, no ``fully_shard``), a mesh of more than one dimension (HSDP, FSDP x TP), several
            meshes, or trainable plain tensors beside the shards (the Trainer measures such a run's norm outside
            ``accelerator.clip_grad_norm_``, which the callback answers).
    """
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = [(n, p) for n, p in trainable if isinstance(p, DTensor)]
    if not sharded:
        return None
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    mesh = sharded[0][1].device_mesh
    odd = [n for n, p in sharded if p.device_mesh != mesh or not all(isinstance(pl, Shard) for pl in p.placements)]
    if not fsdp or odd or mesh.ndim != 1:
        name = odd[0] if odd else sharded[0][0]
        raise ValueError(
            f"GNMRCallback does not support DTensor (tensor-parallel) parameters ({name}, ...): per-unit norms of "
            "local shards would be wrong; FSDP2 (fully_shard, every trainable parameter sharded on one 1-D mesh) is "
            "supported, otherwise use DDP (tp_size=1)"
        )
    plain = [n for n, p in trainable if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"GNMRCallback: under FSDP2 the trainable parameters {plain[:3]} are plain tensors beside the DTensor "
            "shards (added after fully_shard?); the Trainer then measures the gradient norm outside "
            "accelerator.clip_grad_norm_, where the callback takes the per-unit norms. Shard every trainable "
            "parameter (add adapters before the model is prepared) or use DDP"
        )
    return mesh


def refuse_unsupported(args: Any, trainer: Any, model: torch.nn.Module) -> None:
    """``ValueError`` for set-ups where per-unit norms of the local gradients would be wrong or absent:
    DeepSpeed, FSDP1 (flat parameters) or FSDP that did not shard the model, XLA, DTensor parameters that are
    not FSDP2 shards (tensor parallelism, HSDP), and bitsandbytes dual-path layers under FSDP
    (:data:`BNB_FSDP_REFUSED`). FSDP2 (``fully_shard``: every trainable parameter a ``Shard`` on one 1-D mesh) is
    supported: the callback reduces the per-unit norms of the local shards over the mesh."""
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("GNMRCallback does not support DeepSpeed (it needs the full per-unit gradients on every rank)")
    kind = str(getattr(getattr(trainer, "accelerator", None), "distributed_type", ""))
    if "DEEPSPEED" in kind or "XLA" in kind:
        raise ValueError(f"GNMRCallback does not support the {kind} accelerate setup; use DDP")
    refuse_bnb_sharded(args, trainer, model)
    mesh = fsdp2_mesh(model)
    if fsdp_requested(args, trainer) and mesh is None:
        fsdp2 = getattr(getattr(trainer, "accelerator", None), "is_fsdp2", False)
        why = ("FSDP2 left no trainable parameter sharded" if fsdp2 else
               "the model's parameters are not FSDP2 DTensor shards: FSDP1 (flat parameters) or an FSDP request "
               "accelerate did not apply (it runs FSDP on GPUs only; on a CPU it falls back to plain processes)")
        raise ValueError(f"GNMRCallback does not support FSDP here: {why}. Use FSDP2 (fsdp_version: 2, "
                         "recipes/accelerate/fsdp2.yaml; docs/fsdp2.md) or DDP")
