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

bitsandbytes' CPU inference repacking
-------------------------------------
On a CPU with AVX512-BF16, bitsandbytes 0.50's ``Linear4bit.forward`` repacks the weight the first time
it runs in eval mode under ``no_grad`` (``_convert_weight_packed_for_cpu``): another nibble layout, the
block scales (``absmax``) rounded to BF16 and transposed, and from then on a BF16 kernel. So an
``evaluate()`` changes what the layer computes for the rest of the run, and the inverse that
``state_dict()`` (every checkpoint save) and ``.to()`` apply leaves ``absmax`` transposed when the
statistics are not double-quantised: the weight then de-quantises to other values (measured on a tiny
LLaMA: max weight error 0.036, against 2e-4 with double quantisation, where the BF16 rounding stays).
A dual-path layer therefore never repacks (:func:`keep_reference_layout`): training, evaluation and
checkpointing all run bitsandbytes' reference de-quantise + matmul on the weight ``from_pretrained``
made. A layer already repacked before ``prepare_dual_path`` is refused (its scales are rounded).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gnmr_hf._import_utils import require
from gnmr_hf.backends.recovery import STORAGES, CheckpointRecovery, attach_recovery

require("bitsandbytes", "The 4-bit/BF16 dual path")

import bitsandbytes as bnb  # noqa: E402

_LOAD_HINT = "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"

__all__ = [
    "FP4_SOURCE_TOLERANCE",
    "NF4_SOURCE_TOLERANCE",
    "STORAGES",
    "DualPathLinear4bit",
    "dequantize_4bit",
    "is_repacked",
    "keep_reference_layout",
    "prepare_dual_path",
]

#: the source check's thresholds on ``||W_4bit - W_rec|| / ||W_rec||`` (docs/design.md, section 4): the
#: checkpoint the model was loaded from gives at most 0.10 (NF4) and 0.15 (FP4) on a tiny random LLaMA
#: and SmolLM2-135M, a checkpoint of the same shapes with other weights at least 1.05 (1.4 typically)
NF4_SOURCE_TOLERANCE = 0.4
FP4_SOURCE_TOLERANCE = 0.4


_REPACKED = (
    "{name}: this Linear4bit was already repacked by bitsandbytes' CPU inference path (an eval-mode forward "
    "under no_grad on a CPU with AVX512-BF16), which rounds its block scales to BF16, so it no longer holds "
    "the quantisation from_pretrained made. Call prepare_dual_path right after from_pretrained, before any "
    "evaluation or generation."
)


def is_repacked(module: nn.Module) -> bool:
    """Whether bitsandbytes has repacked this ``Linear4bit``'s weight for its CPU inference kernel."""
    weight = getattr(module, "weight", None)
    return bool(getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False))


def keep_reference_layout(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking the ``Linear4bit`` layers of ``model`` for its CPU inference kernel.

    Every ``Linear4bit`` then computes with the reference de-quantise + matmul in training and evaluation
    alike (see the module docstring for why). :func:`prepare_dual_path` does this for the layers it
    converts; the recipes do it for a plain 4-bit (QLoRA) model too, so both compute the same way.

    Returns:
        How many layers were changed.

    Raises:
        ValueError: a layer was already repacked (its block scales were rounded to BF16).
    """
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    for name, m in layers:
        if is_repacked(m):
            raise ValueError(_REPACKED.format(name=name or type(m).__name__))
    for _, m in layers:
        m.support_avx512bf16_for_cpu = False  # the only switch bitsandbytes' forward reads for the repacking
    return len(layers)


def dequantize_4bit(module: nn.Module) -> tuple[str, torch.Tensor | None]:
    """The quantisation type (``"nf4"``/``"fp4"``) of a ``Linear4bit`` and its weight de-quantised by
    bitsandbytes (``bitsandbytes.functional.dequantize_4bit``, on the weight's device; reads the weight, changes
    nothing); the weight itself if it is not quantised yet; ``None`` if it cannot be read (meta device,
    repacked for the CPU inference kernel)."""
    w = module.weight
    state = getattr(w, "quant_state", None)
    quant_type = str(getattr(state, "quant_type", None) or getattr(w, "quant_type", "nf4"))
    if w.device.type == "meta" or is_repacked(module):
        return quant_type, None
    if state is None:
        return quant_type, (w.data if w.dtype.is_floating_point else None)
    return quant_type, bnb.functional.dequantize_4bit(w.data, state)


class DualPathLinear4bit(CheckpointRecovery, bnb.nn.Linear4bit):
    """A bitsandbytes ``Linear4bit`` (NF4 or FP4) that can run on the checkpoint's original BF16 weight.

    Never constructed directly: :func:`prepare_dual_path` converts existing ``Linear4bit`` modules in
    place, keeping their quantised weight. ``recovery`` False: the stock bnb 4-bit forward, never
    repacked for the CPU inference kernel (:func:`keep_reference_layout`). ``recovery`` True:
    ``F.linear(x, W_bf16, bias)`` (see :class:`~gnmr_hf.backends.recovery.CheckpointRecovery`).
    """

    source_tolerances = {"nf4": NF4_SOURCE_TOLERANCE, "fp4": FP4_SOURCE_TOLERANCE}

    @classmethod
    def check_convertible(cls, module: nn.Module, name: str) -> None:
        if is_repacked(module):
            raise ValueError(_REPACKED.format(name=name))

    @classmethod
    def low_weight(cls, module: nn.Module) -> tuple[str, torch.Tensor | None]:
        return dequantize_4bit(module)

    @classmethod
    def convert(cls, module: nn.Module, source: Any) -> nn.Module:
        module = super().convert(module, source)
        module.support_avx512bf16_for_cpu = False
        return module


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
    ``dtype``, ``check_source`` as keywords), storage modes and errors are those of :func:`gnmr_hf.prepare_dual_path`,
    which calls this for a model holding ``Linear4bit`` layers.
    """
    return attach_recovery(model, recovery_source, DualPathLinear4bit, _LOAD_HINT, **kwargs)
