"""The 4-bit low formats of bitsandbytes, NF4 and FP4: the packed weight (two codes a byte) and its quant state,
absmax (one float32 per block of ``blocksize``, 64) and the 16-entry float32 code table; with double
quantisation absmax is one uint8 per block plus a float32 offset, a second absmax (one float32 per 256 blocks)
and a 256-entry float32 code table (measured on bitsandbytes 0.50: tests/test_memory.py).

Low formats only (every unplanned decoder linear on one of them): bitsandbytes' export writes them as its
``quant``; compressed-tensors has no NF4 (it writes its own INT4 low rung, :mod:`gnmr_hf.rungs.int4`).
"""

from __future__ import annotations

import math
from typing import Any

from gnmr_hf.rungs.registry import LinearBytes, Rung, register_rung


def four_bit_bytes(numel: int, rows: int, *, blocksize: int = 64, double_quant: bool = False,
                   **_: Any) -> LinearBytes:
    """bitsandbytes' 4-bit storage of ``numel`` weights (NF4 and FP4 alike)."""
    blocks = math.ceil(numel / blocksize)
    if double_quant:
        state = blocks + 4 + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 * 16
    else:
        state = 4 * blocks + 4 * 16
    return LinearBytes(math.ceil(numel / 2), state)


def _fake_quant(quant_type: str):
    def fake_quant(weight):
        """bitsandbytes' own 4-bit quantise and de-quantise of ``weight`` (blocksize 64)."""
        import bitsandbytes.functional as bf  # an optional dependency: only the fake quantiser needs it

        q, state = bf.quantize_4bit(weight.contiguous(), blocksize=64, quant_type=quant_type)
        return bf.dequantize_4bit(q, state, quant_type=quant_type).to(weight.dtype)

    fake_quant.__name__ = f"{quant_type}_fake_quant"
    return fake_quant


NF4 = register_rung(Rung("nf4", four_bit_bytes, fake_quant=_fake_quant("nf4"), exports={"bitsandbytes": "nf4"},
                         low=True, doc="bitsandbytes NF4, blocks of 64"))
FP4 = register_rung(Rung("fp4", four_bit_bytes, fake_quant=_fake_quant("fp4"), exports={"bitsandbytes": "fp4"},
                         low=True, doc="bitsandbytes FP4, blocks of 64"))
