"""Plans for one GGUF file (``gnmr-hf profile --serve gguf``): the ladder priced and profiled against the GGUF
quantisers themselves, so that the gains it ranks are the ones the served file has.

A GGUF plan's low is a ggml type the installed ``gguf`` package quantises (:data:`GGUF_LOWS`: ``q4_0`` by default,
``q4_1``, ``q5_0``, ``q5_1``); its rungs are the export's (:data:`RUNG_TYPES`: ``int8`` is written as ``Q8_0``,
``bf16`` as ``BF16``, :data:`gnmr_hf.export_gguf.DEFAULT_RUNG_TYPES`). Everything here is what
:func:`gnmr_hf.export_gguf.export_gguf` writes:

- :func:`gguf_fake_quant`: a weight quantised and dequantised by ``gguf.quants`` (the reference quantisers of
  ggml's blocks, the very calls the export makes on the same float32 values of the BF16 weight), so a model
  swapped to it computes with the served file's weights, bit for bit (tests/test_profile_gguf.py reads them back
  from an exported file);
- :func:`gguf_tensor_bytes`, :func:`gguf_rung_prices`, :func:`gguf_model_bytes`: the bytes of the file's tensor
  data (each ggml block's bytes from ``gguf.GGML_QUANT_SIZES``; 2-D tensors that are no decoder linear at the
  embedding type, BF16; 1-D ones in F32), a rung's price is what it adds over the low type;
- :func:`gguf_rung_gains`: each decoder linear's first-order gain on each rung at the uniform-low point
  (:func:`gnmr_hf.planning.int4.fake_quant_rung_gains`, the same estimate the INT4 plans use).

A LLaMA export permutes the rows of ``q_proj`` / ``k_proj`` (llama.cpp's rotary layout): ggml's blocks run along a
row, so the permutation moves whole rows and the fake-quantised weight is the served one permuted back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gnmr_hf.planning.groups import decoder_linears
from gnmr_hf.planning.int4 import fake_quant_rung_gains
from gnmr_hf.planning.plan import GGUF_LOWS  # a GGUF plan's low (``Plan.low``) -> its ggml type

#: the rungs above a GGUF low and the type each is written at (the export's defaults)
RUNG_TYPES = {"int8": "Q8_0", "bf16": "BF16"}
#: the type of the token embedding (and an untied ``lm_head``) in the export's file
EMBEDDING_TYPE = "BF16"


def is_gguf_low(low: str | None) -> bool:
    """True for a GGUF plan's low (:data:`GGUF_LOWS`)."""
    return low in GGUF_LOWS


def block(type_name: str) -> tuple[int, int]:
    """``(values per block, bytes per block)`` of a ggml type (BF16 / F16: ``(1, 2)``, F32: ``(1, 4)``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return tuple(GGML_QUANT_SIZES[GGMLQuantizationType[type_name]])


def gguf_tensor_bytes(numel: int, type_name: str) -> int:
    """The bytes a tensor of ``numel`` values takes in a GGUF file at ``type_name`` (its data, no header)."""
    size, nbytes = block(type_name)
    if numel % size:
        raise ValueError(f"{numel} values are not whole {type_name} blocks of {size}")
    return numel // size * nbytes


def gguf_fake_quant(weight, type_name: str):
    """``weight`` as a GGUF file stores it at ``type_name``, dequantised: the float32 values of its BF16 form
    quantised by ``gguf.quants.quantize`` and read back by ``gguf.quants.dequantize`` (BF16: the BF16 value).
    Returns a tensor of ``weight``'s dtype and device."""
    import torch

    bf16 = weight.detach().to(torch.bfloat16)
    if type_name == "BF16":
        return bf16.to(weight.dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    values = bf16.to(torch.float32).cpu().numpy()
    out = dequantize(quantize(values, qtype), qtype)
    return torch.from_numpy(out).reshape(weight.shape).to(device=weight.device, dtype=weight.dtype)


def rung_fake_quant(weight, rung: str, low: str):
    """The served weight of a linear on ``rung`` (``"low"``, ``"int8"``, ``"bf16"``) of a plan over ``low``."""
    return gguf_fake_quant(weight, GGUF_LOWS[low] if rung == "low" else RUNG_TYPES[rung])


def gguf_rung_prices(out_features: int, in_features: int, low: str) -> dict[str, int]:
    """What each rung adds to one linear's bytes in the file over its ``low`` type."""
    n = out_features * in_features
    base = gguf_tensor_bytes(n, GGUF_LOWS[low])
    return {r: gguf_tensor_bytes(n, t) - base for r, t in RUNG_TYPES.items()}


def gguf_model_bytes(model, linears: list[str], rungs: Mapping[str, str], low: str,
                     embedding_type: str = EMBEDDING_TYPE) -> int:
    """The tensor data of the GGUF file :func:`gnmr_hf.export_gguf.export_gguf` writes for ``model`` with
    ``rungs`` over ``low`` (``{}``: the uniform-low file): each decoder linear at its rung's type, its bias and
    every 1-D parameter in F32, every other parameter (the embedding; tied ones once) at ``embedding_type``."""
    decoder = set(linears)
    total = 0
    for name, p in model.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        if owner in decoder and leaf == "weight":
            rung = rungs.get(owner, "low")
            total += gguf_tensor_bytes(p.numel(), GGUF_LOWS[low] if rung == "low" else RUNG_TYPES[rung])
        elif p.dim() == 1:
            total += 4 * p.numel()
        else:
            total += gguf_tensor_bytes(p.numel(), embedding_type)
    return total


def gguf_rung_gains(model, batches, low: str = "q4_0", linears: list[str] | None = None) -> list[Any]:
    """Every decoder linear's first-order gain on the ``int8`` (Q8_0) and ``bf16`` rungs against the uniform
    ``low`` file, and each rung's price in the file's bytes (:func:`gguf_rung_prices`); ``model``: the BF16
    checkpoint loaded in the dtype to compute in, restored before returning. See
    :func:`gnmr_hf.planning.int4.fake_quant_rung_gains`."""
    names = list(linears) if linears is not None else decoder_linears(model)
    return fake_quant_rung_gains(
        model, batches, lambda w: rung_fake_quant(w, "low", low),
        {r: (lambda w, r=r: rung_fake_quant(w, r, low)) for r in RUNG_TYPES},
        lambda rows, cols: gguf_rung_prices(rows, cols, low), names)


__all__ = ["EMBEDDING_TYPE", "GGUF_LOWS", "RUNG_TYPES", "block", "gguf_fake_quant", "gguf_model_bytes",
           "gguf_rung_gains", "gguf_rung_prices", "gguf_tensor_bytes", "is_gguf_low", "rung_fake_quant"]
