"""Preparing a quantised (or mixed) model for LoRA training without upcasting what it keeps in BF16.

``peft.prepare_model_for_kbit_training``, which most QLoRA tutorials call, freezes the base, enables
gradient checkpointing and input gradients, and casts *every* BF16/FP16 parameter that is not 4-bit
to FP32: on a planned mixed model that doubles the bytes of every linear the plan kept on BF16 (and of
the embeddings and the output head). ``prepare_for_training`` does the rest of what PEFT's does and
leaves every dtype as loaded; measured in tests/test_training_prep.py and docs/profile.md.
"""

from __future__ import annotations

from typing import Any


def prepare_for_training(model, use_gradient_checkpointing: bool = True,
                         gradient_checkpointing_kwargs: dict[str, Any] | None = None):
    """``peft.prepare_model_for_kbit_training`` without its FP32 upcast: freeze every parameter, and
    with ``use_gradient_checkpointing`` make the input embeddings' output require grad (so the frozen
    embeddings do not cut the checkpointed graph) and enable gradient checkpointing. Dtypes are left
    as loaded (LLaMA-style RMSNorms compute their statistics in FP32 internally anyway). Returns
    ``model``. Call it before ``peft.get_peft_model``."""
    for param in model.parameters():
        param.requires_grad = False
    if use_gradient_checkpointing:
        kwargs = dict(gradient_checkpointing_kwargs or {})
        if kwargs.get("use_reentrant", True):
            model.enable_input_require_grads()
        enable_checkpointing(model, kwargs or None)
    return model


def enable_checkpointing(model, kwargs: dict[str, Any] | None = None) -> None:
    """Activation (gradient) checkpointing on ``model`` through the current transformers API:
    ``activation_checkpointing_enable`` where the release has it (``gradient_checkpointing_enable`` is its
    deprecated alias there, with a ``FutureWarning``), else ``gradient_checkpointing_enable`` (older releases).
    ``kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (None: transformers' default)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def linear_weight_bytes(model, names) -> dict[str, int]:
    """Bytes of the weight of each named linear (what the tests and docs compare before and after)."""
    modules = dict(model.named_modules())
    return {n: modules[n].weight.nelement() * modules[n].weight.element_size() for n in names}
