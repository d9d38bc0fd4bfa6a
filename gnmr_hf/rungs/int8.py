"""The INT8 rung: LLM.int8 (bitsandbytes ``Linear8bitLt(has_fp16_weights=False)``): ``n`` int8 weights and one
FP32 scale per output row (``SCB``).

It is both a low format (``load_in_8bit``) and a rung above NF4/FP4 (the precision ladder). Its module is a
stock ``Linear8bitLt`` over the checkpoint weight (:func:`int8_linear`), which the ladder's gains compute
with and :func:`gnmr_hf.planning.ladder.load_planned` swaps in. compressed-tensors writes it ``W8A16`` (per
channel, symmetric); bitsandbytes' format holds one low precision per checkpoint and has no entry for it as a
rung (a ladder plan is refused there).
"""

from __future__ import annotations

from typing import Any

from gnmr_hf.rungs.int4 import packed_bytes
from gnmr_hf.rungs.registry import LinearBytes, Rung, register_rung


def int8_bytes(numel: int, rows: int, **_: Any) -> LinearBytes:
    """``numel`` int8 weights (a parameter) and one float32 scale per row (``SCB``, beside the footprint)."""
    return LinearBytes(numel, 4 * rows)


def w8a16_bytes(numel: int, rows: int, **_: Any) -> LinearBytes:
    """What a compressed-tensors folder stores for one linear on this rung (``W8A16``: int8 codes packed four to an
    int32, one BF16 scale per row, the ``weight_shape``)."""
    return packed_bytes(rows, numel // rows, 8, rows)


def int8_linear(weight, threshold: float = 6.0):
    """A stock bitsandbytes ``Linear8bitLt`` over ``weight`` (LLM.int8, row-wise, ``has_fp16_weights=False``,
    no bias), quantised as transformers' ``load_in_8bit`` quantises a checkpoint weight (via FP16), in eval mode
    (as a loaded model starts; bitsandbytes' int8 matmul differs between the modes)."""
    import bitsandbytes as bnb  # an optional dependency: only this rung's module needs it
    import torch

    out_f, in_f = weight.shape
    m = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False, threshold=threshold)
    m.weight = bnb.nn.Int8Params(weight.detach().to(torch.float16).cpu(), requires_grad=False, has_fp16_weights=False)
    return m.to(weight.device).eval()


def int8_module(weight, int8_threshold: float = 6.0, **_: Any):
    """The module a linear planned on INT8 becomes (:func:`int8_linear`, ``int8_threshold`` its outlier split)."""
    import torch

    return int8_linear(weight.to(dtype=torch.float32), int8_threshold)


def int8_rowwise_fake_quant(weight):
    """Row-wise symmetric absmax INT8, quantised and de-quantised (LLM.int8's weight quantiser, no outliers)."""
    import torch

    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (torch.round(w / scale).clamp(-127, 127) * scale).to(weight.dtype)


RUNG = register_rung(Rung("int8", int8_bytes, fake_quant=int8_rowwise_fake_quant, module=int8_module,
                          exports={"compressed-tensors": "W8A16"}, format_bytes={"compressed-tensors": w8a16_bytes},
                          low=True, planned=True,
                          doc="LLM.int8: int8 weights, one FP32 scale per row"))
