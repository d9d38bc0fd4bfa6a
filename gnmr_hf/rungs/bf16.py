"""The BF16 rung: the checkpoint's weight as it is (``dtype_bytes`` a weight, no state).

Planning scores it by the checkpoint weight itself; :func:`gnmr_hf.planning.ladder.load_planned` keeps the
linear a plain ``nn.Linear`` (in the skip list, not quantised). bitsandbytes' export lists it in
``llm_int8_skip_modules``; compressed-tensors' puts it in ``ignore``.
"""

from __future__ import annotations

from typing import Any

from gnmr_hf.rungs.registry import LinearBytes, Rung, register_rung


def bf16_bytes(numel: int, rows: int, *, dtype_bytes: int = 2, **_: Any) -> LinearBytes:
    """A weight of ``numel`` elements in a dtype of ``dtype_bytes`` (BF16: 2)."""
    return LinearBytes(numel * dtype_bytes, 0)


def identity(weight):
    """The BF16 rung computes with the checkpoint weight itself."""
    return weight


RUNG = register_rung(Rung("bf16", bf16_bytes, fake_quant=identity, module=None,
                          exports={"bitsandbytes": "skip", "compressed-tensors": "ignore"}, planned=True,
                          doc="the checkpoint weight, unquantised"))
