"""The INT4 low format of the compressed-tensors export (``W4A16``: group-wise symmetric INT4 codes packed eight
to an int32, one BF16 scale per group of ``group_size`` inputs, an int64 ``weight_shape``).

A low format only: ``gnmr-hf profile --low int4`` plans over it and ``gnmr-hf export --format
compressed-tensors`` writes every unplanned decoder linear in it. Its quantiser for planning is
:func:`gnmr_hf.planning.int4.int4_fake_quant` (bit-exact to the library's), not repeated here; bitsandbytes has
no INT4.
"""

from __future__ import annotations

from typing import Any

from gnmr_hf.rungs.registry import LinearBytes, Rung, register_rung


def packed_bytes(rows: int, cols: int, bits: int, scales: int) -> LinearBytes:
    """The tensors a compressed-tensors folder stores for one pack-quantized linear of ``rows`` x ``cols``: its
    ``bits``-bit codes packed into int32 words along each row, ``scales`` BF16 scales and the int64
    ``weight_shape``."""
    return LinearBytes(4 * rows * -(-cols * bits // 32) + 2 * scales + 16, 0)


def int4_bytes(numel: int, rows: int, *, group_size: int = 128, **_: Any) -> LinearBytes:
    """The tensors a compressed-tensors folder stores for one W4A16 linear of ``numel`` weights in ``rows`` rows."""
    cols = numel // rows
    return packed_bytes(rows, cols, 4, rows * (cols // group_size))


RUNG = register_rung(Rung("int4", int4_bytes, exports={"compressed-tensors": "W4A16"}, low=True,
                          doc="compressed-tensors W4A16 (INT4, group-wise symmetric)"))
