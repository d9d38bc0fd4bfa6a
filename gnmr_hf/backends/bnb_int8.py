"""INT8 low-cost path / BF16 recovery path for bitsandbytes ``Linear8bitLt`` layers.

The low-cost path is the stock bitsandbytes LLM.int8() forward of the ``Linear8bitLt`` that
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))`` created. The
recovery path is ``F.linear(x, W, bias)`` with ``W`` the **original BF16 weight read from the
checkpoint's safetensors** (not a de-quantised INT8 copy); its storage modes, byte accounting and
switch are shared with the 4-bit backend (:mod:`gnmr_hf.backends.recovery`).

How it plugs into PEFT
----------------------
:func:`prepare_dual_path` turns each ``Linear8bitLt`` inside the decoder layers into a
:class:`DualPathLinear8bitLt` *in place* (``module.__class__`` is swapped, so the already-quantised
``Int8Params``, the bias and bnb's ``MatmulLtState`` stay as they are). Because the new class is a
subclass of ``bnb.nn.Linear8bitLt``, PEFT's own dispatcher (``peft.tuners.lora.bnb.dispatch_bnb_8bit``,
an ``isinstance`` check) wraps it with PEFT's stock LoRA ``Linear8bitLt``: plain
``peft.get_peft_model(model, LoraConfig(...))`` works with no registration, LoRA's forward is
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` on either path, and the saved adapter is a
stock PEFT adapter.

What PEFT reads from the base layer and why it is safe: ``in_features``/``out_features``, ``state``
and ``index`` (dispatch), ``weight.device``/``dtype`` (to place the adapter; the ``Int8Params`` are
unchanged). Refused on a dual-path layer, with an error that says what to do instead:
``merge_adapter``/``merge_and_unload`` (they rewrite the INT8 weight only; merge on a stock base) and
DoRA (its weight norm is taken from the de-quantised INT8 weight).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gnmr_hf._import_utils import require
from gnmr_hf.backends.recovery import STORAGES, CheckpointRecovery, attach_recovery

require("bitsandbytes", "The INT8/BF16 dual path")

import bitsandbytes as bnb  # noqa: E402

_LOAD_HINT = "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))"

__all__ = ["INT8_SOURCE_TOLERANCE", "STORAGES", "DualPathLinear8bitLt", "dequantize_int8", "prepare_dual_path"]

#: the source check's threshold on ``||W_int8 - W_rec|| / ||W_rec||`` (docs/design.md, section 4): the
#: checkpoint the model was loaded from gives at most 0.007 (tiny random LLaMA) and 0.012 (SmolLM2-135M),
#: a checkpoint of the same shapes with other weights at least 1.05 (1.4 typically)
INT8_SOURCE_TOLERANCE = 0.1


def dequantize_int8(module: nn.Module) -> torch.Tensor | None:
    """The weight of a ``Linear8bitLt`` as LLM.int8() computes with it: ``CB * SCB[:, None] / 127`` (float32,
    on the weight's device), the row scales read from the weight or, after a forward, from the layer's
    ``state``; the weight itself if it was kept unquantised; ``None`` if it cannot be read (meta device)."""
    w = module.weight
    if w.device.type == "meta":
        return None
    if w.dtype.is_floating_point:  # llm_int8_has_fp16_weight=True: nothing quantised
        return w.data
    scb = getattr(w, "SCB", None)
    if scb is None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    if scb is None:
        return None
    return w.data.to(torch.float32) * (scb.to(torch.float32) / 127.0)[:, None]


class DualPathLinear8bitLt(CheckpointRecovery, bnb.nn.Linear8bitLt):
    """A bitsandbytes ``Linear8bitLt`` that can run on the checkpoint's original BF16 weight instead.

    Never constructed directly: :func:`prepare_dual_path` converts existing ``Linear8bitLt`` modules in
    place, keeping their quantised weight. ``recovery`` False: the stock bnb INT8 forward.
    ``recovery`` True: ``F.linear(x, W_bf16, bias)`` (see :class:`~gnmr_hf.backends.recovery.CheckpointRecovery`).
    """

    source_tolerances = {"int8": INT8_SOURCE_TOLERANCE}

    @classmethod
    def low_weight(cls, module: nn.Module) -> tuple[str, torch.Tensor | None]:
        return "int8", dequantize_int8(module)


def prepare_dual_path(model: nn.Module, recovery_source: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Give every ``Linear8bitLt`` inside the decoder layers of an 8-bit model a BF16 recovery path.

    The usual flow, before PEFT (a PEFT-wrapped model is accepted too)::

        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.bfloat16)
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
        model = peft.get_peft_model(model, LoraConfig(...))   # stock PEFT, no registration needed
        gnmr_hf.set_active_units(model, [3, 7])               # layers 3 and 7 on BF16, others INT8

    Every layer starts on the low-cost INT8 path. The arguments (``storage``, ``units``,
    ``dtype``, ``check_source`` as keywords), storage modes and errors are those of :func:`gnmr_hf.prepare_dual_path`,
    which calls this for a model holding ``Linear8bitLt`` layers.
    """
    return attach_recovery(model, recovery_source, DualPathLinear8bitLt, _LOAD_HINT, **kwargs)
