"""The INT4 low formats of the compressed-tensors export: ``int4`` (``W4A16``: group-wise symmetric INT4 codes
packed eight to an int32, one BF16 scale per group of ``group_size`` inputs, an int64 ``weight_shape``) and
``int4-asym`` (``W4A16_ASYM``: the same with one 4-bit zero point per group, packed eight to an int32 down the
rows; vLLM's ``uint4``).

Low formats only: ``gnmr-hf profile --low int4`` (``--low int4-asym``) plans over one and ``gnmr-hf export
--format compressed-tensors`` writes every unplanned decoder linear in it. Its quantiser for planning is
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


def int4_asym_bytes(numel: int, rows: int, *, group_size: int = 128, **_: Any) -> LinearBytes:
    """:func:`int4_bytes` plus the asymmetric scheme's zero points: ``rows x groups`` 4-bit values packed into
    int32 words down each group's column (``pack_to_int32(..., packed_dim=0)``, as compressed-tensors stores them)."""
    cols = numel // rows
    groups = cols // group_size
    return LinearBytes(int4_bytes(numel, rows, group_size=group_size).counted + 4 * -(-rows * 4 // 32) * groups, 0)


RUNG = register_rung(Rung("int4", int4_bytes, exports={"compressed-tensors": "W4A16"}, low=True,
                          doc="compressed-tensors W4A16 (INT4, group-wise symmetric)"))
ASYM = register_rung(Rung("int4-asym", int4_asym_bytes, exports={"compressed-tensors": "W4A16_ASYM"}, low=True,
                          doc="compressed-tensors W4A16_ASYM (INT4, group-wise, a zero point per group)"))
#: the compressed-tensors export's INT4 lows -> whether its groups are symmetric
INT4_LOWS = {"int4": True, "int4-asym": False}


def int4_low(scheme: str | None) -> str:
    """A compressed-tensors scheme name (``W4A16``, the default for None, or ``W4A16_ASYM``; case and ``-`` / ``_``
    ignored) as its INT4 low (``"int4"``, ``"int4-asym"``); ValueError in one line otherwise."""
    lows = {r.exports["compressed-tensors"]: r.name for r in (RUNG, ASYM)}  # W4A16 -> int4, W4A16_ASYM -> int4-asym
    t = (scheme or RUNG.exports["compressed-tensors"]).upper().replace("-", "_")
    if t not in lows:
        raise ValueError(f"{scheme}: a compressed-tensors export writes its low linears as {' or '.join(lows)}")
    return lows[t]
