"""4-bit (NF4 / FP4, QLoRA) low-cost path / BF16 recovery path for bitsandbytes ``Linear4bit`` layers.

The low-cost path is the stock bitsandbytes 4-bit forward of the ``Linear4bit`` that
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=
"nf4" | "fp4", bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=...))`` created: the weight is
de-quantised block by block and multiplied in ``bnb_4bit_compute_dtype``. The recovery path is
``F.linear(x, W, bias)`` with ``W`` the **original BF16 weight read from the checkpoint's safetensors**;
its storage modes (host / device / disk), byte accounting and switch are those of the INT8 backend
(:mod:`gnmr_hf.backends.recovery`, written once for both).

How it plugs into PEFT
----------------------
:func:`prepare_dual_path` turns each ``Linear4bit`` inside the decoder layers into a
:class:`DualPathLinear4bit` *in place* (``module.__class__`` is swapped, so the ``Params4bit`` weight
and its ``quant_state`` stay as they are). Because the new class is a subclass of ``bnb.nn.Linear4bit``,
PEFT's ``peft.tuners.lora.bnb.dispatch_bnb_4bit`` (an ``isinstance`` check that reads
``compute_dtype`` and the weight's ``compress_statistics`` / ``quant_type``) wraps it with PEFT's
stock 4-bit LoRA layer, whose forward is ``base_layer(x).clone() + lora_B(lora_A(dropout(x))) * scaling``
on either path; the saved adapter is a stock PEFT adapter that loads on a BF16 or a 4-bit base.
Refused on a dual-path layer, as for INT8: ``merge_adapter``/``merge_and_unload`` (they re-quantise
the merged weight into the 4-bit path only) and DoRA (its weight norm comes from the 4-bit weight).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from gnmr_hf._import_utils import require
from gnmr_hf.backends.recovery import STORAGES, CheckpointRecovery, attach_recovery

require("bitsandbytes", "The 4-bit/BF16 dual path")

import bitsandbytes as bnb  # noqa: E402

_LOAD_HINT = "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"

__all__ = ["STORAGES", "DualPathLinear4bit", "prepare_dual_path"]


class DualPathLinear4bit(CheckpointRecovery, bnb.nn.Linear4bit):
    """A bitsandbytes ``Linear4bit`` (NF4 or FP4) that can run on the checkpoint's original BF16 weight.

    Never constructed directly: :func:`prepare_dual_path` converts existing ``Linear4bit`` modules in
    place, keeping their quantised weight. ``recovery`` False: the stock bnb 4-bit forward.
    ``recovery`` True: ``F.linear(x, W_bf16, bias)`` (see :class:`~gnmr_hf.backends.recovery.CheckpointRecovery`).
    """


def prepare_dual_path(model: nn.Module, recovery_source: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Give every ``Linear4bit`` inside the decoder layers of a 4-bit model a BF16 recovery path.

    The usual flow, before PEFT (a PEFT-wrapped model is accepted too)::

        bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config,
                                                     dtype=torch.bfloat16)
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
        model = peft.get_peft_model(model, LoraConfig(...))   # stock PEFT (its 4-bit LoRA layer)
        gnmr_hf.set_active_units(model, [3, 7])               # layers 3 and 7 on BF16, others NF4

    Every layer starts on the low-cost 4-bit path. The arguments (``storage``, ``units``,
    ``dtype`` as keywords), storage modes and errors are those of :func:`gnmr_hf.prepare_dual_path`,
    which calls this for a model holding ``Linear4bit`` layers.
    """
    return attach_recovery(model, recovery_source, DualPathLinear4bit, _LOAD_HINT, **kwargs)
