"""How ``GNMRCallback`` plugs into a ``transformers.Trainer``: finding it, its place in the callback
list, the clip call it answers, and the set-ups it refuses.

Callbacks are not handed the Trainer. :func:`gnmr_hf.trainer.callback.attach` gives it explicitly; the
drop-in ``callbacks=[GNMRCallback()]`` finds it on the call stack (:func:`find_trainer`) at
``on_init_end`` and ``on_train_begin``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from gnmr_hf.trainer.state import GNMRState


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


def take_over_clip(accelerator: Any, callback: Any) -> None:
    """Route ``accelerator.clip_grad_norm_`` (the Trainer's one norm pass per step) through
    ``callback.clip_grad_norm_`` while ``callback`` runs on this accelerator (2-norms only)."""
    give_back_clip(accelerator)  # a run that raised leaves its routing behind
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        if norm_type != 2 or callback._accelerator is not accelerator or callback._norms is None:
            return original(parameters, max_norm, norm_type=norm_type)
        return callback.clip_grad_norm_(parameters, max_norm)

    clip_grad_norm_.gnmr_original = original
    accelerator.clip_grad_norm_ = clip_grad_norm_


def give_back_clip(accelerator: Any) -> None:
    """Undo :func:`take_over_clip`."""
    original = getattr(accelerator.clip_grad_norm_, "gnmr_original", None)
    if original is not None:
        accelerator.clip_grad_norm_ = original


def loss_scale(accelerator: Any) -> float:
    """The fp16 loss scale the gradients are multiplied by until unscaled (1.0 without a scaler)."""
    scaler = getattr(accelerator, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


def refuse_unsupported(args: Any, trainer: Any, model: torch.nn.Module) -> None:
    """``ValueError`` for set-ups where per-unit norms of the local gradients would be wrong or absent:
    DeepSpeed, FSDP, XLA, and DTensor (tensor-parallel) parameters."""
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("GNMRCallback does not support DeepSpeed (it needs the full per-unit gradients on every rank)")
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("GNMRCallback does not support FSDP (gradients are sharded); use DDP")
    kind = str(getattr(getattr(trainer, "accelerator", None), "distributed_type", ""))
    if "DEEPSPEED" in kind or "FSDP" in kind or "XLA" in kind:
        raise ValueError(f"GNMRCallback does not support the {kind} accelerate setup; use DDP")
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        sharded = [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, DTensor)]
        if sharded:
            raise ValueError(
                f"GNMRCallback does not support DTensor (tensor-parallel) parameters ({sharded[0]}, ...): per-unit "
                "norms of local shards would be wrong; use DDP (tp_size=1)"
            )
