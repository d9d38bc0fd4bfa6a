"""The rung registry: :class:`Rung` (one precision a decoder linear can be stored in) and :func:`register_rung`.

A rung is everything the package needs to know about one precision, in one place:

- ``bytes(numel, rows, **kw)``: what a linear of ``numel`` weights and ``rows`` output features holds in it
  (:class:`LinearBytes`: what ``get_memory_footprint()`` counts and the quant state beside it); every price in
  the package (``gnmr_hf.memory.weight_bytes``, the ladder's rung prices, the model card's per-weight ratio) is
  this function;
- ``fake_quant(weight)``: the weight as the rung computes with it (quantised and de-quantised), what the
  planner scores the rung by when it has no ``module``;
- ``module(weight, **options)``: the module :func:`gnmr_hf.planning.ladder.load_planned` swaps in for a linear
  planned on it (and the ladder's gains compute its output with); None: the linear stays the checkpoint's
  ``nn.Linear`` (BF16, kept out of quantisation by the skip list);
- ``exports``: export format name -> how that format writes a linear on this rung (the format's own value:
  ``"skip"`` for bitsandbytes' skip list, a scheme name for compressed-tensors); a format refuses a plan with a
  rung it has no entry for;
- ``format_bytes``: export format name -> the bytes that format stores a linear on this rung in, where its layout
  is not the one ``bytes`` counts (compressed-tensors writes the INT8 rung as W8A16: BF16 row scales and a
  ``weight_shape``, where bitsandbytes holds FP32 ones); :meth:`Rung.bytes_in` reads it, else ``bytes``;
- ``low`` / ``planned``: whether the rung can be a plan's low format (every unplanned linear on it) and
  whether a plan can put a linear on it (a rung above the low format).

The stock rungs register themselves in :mod:`gnmr_hf.rungs` (one file each); a user adds one with
:func:`register_rung` from anywhere (tests/test_registry.py registers a toy rung from the test file alone).
Nothing here imports torch: the registry is read by the argument checks that run before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class RungError(ValueError):
    """An unknown rung, or a rung registered twice (one line)."""


@dataclass(frozen=True)
class LinearBytes:
    """Bytes of one linear's weight: ``counted`` by ``get_memory_footprint()``, ``state`` beside it."""

    counted: int
    state: int

    @property
    def total(self) -> int:
        return self.counted + self.state


@dataclass(frozen=True)
class Rung:
    """One precision (see the module docstring). ``bytes`` takes ``numel``, ``rows`` and keyword options it may
    ignore (``dtype_bytes``, ``blocksize``, ``double_quant``, ``group_size``)."""

    name: str
    bytes: Callable[..., LinearBytes]
    fake_quant: Callable[[Any], Any] | None = None
    module: Callable[..., Any] | None = None
    exports: Mapping[str, Any] = field(default_factory=dict)
    format_bytes: Mapping[str, Callable[..., LinearBytes]] = field(default_factory=dict)
    low: bool = False
    planned: bool = False
    doc: str = ""

    def price(self, numel: int, rows: int, low: Rung | str, **kw: Any) -> int:
        """What one linear of ``numel`` weights in ``rows`` rows costs on this rung over ``low`` (whole state)."""
        base = get_rung(low) if isinstance(low, str) else low
        return self.bytes(numel, rows, **kw).total - base.bytes(numel, rows, **kw).total

    def bytes_in(self, fmt: str, numel: int, rows: int, **kw: Any) -> LinearBytes:
        """What export format ``fmt`` stores for one linear of ``numel`` weights in ``rows`` rows on this rung: its
        ``format_bytes[fmt]`` when it registers one, else :attr:`bytes`."""
        return self.format_bytes.get(fmt, self.bytes)(numel, rows, **kw)

    def per_weight(self, **kw: Any) -> float:
        """Bytes a weight of a large linear (2**24 weights in one row: the per-row and per-table terms vanish)."""
        n = 2**24
        return self.bytes(n, 1, **kw).total / n


_RUNGS: dict[str, Rung] = {}


def register_rung(rung: Rung, replace: bool = False) -> Rung:
    """Add ``rung`` to the registry (``replace``: over one of the same name); returns it."""
    if not isinstance(rung, Rung):
        raise TypeError(f"register_rung takes a gnmr_hf.rungs.Rung, got {type(rung).__name__}")
    if not rung.name or not isinstance(rung.name, str) or rung.name == "low":
        raise RungError(f"rung name {rung.name!r}: a non-empty string other than 'low'")
    if rung.name in _RUNGS and not replace and _RUNGS[rung.name] is not rung:
        raise RungError(f"rung {rung.name!r} is registered already (register_rung(..., replace=True) replaces it)")
    if not (rung.low or rung.planned):
        raise RungError(f"rung {rung.name!r} is neither a low format (low=True) nor a planned rung (planned=True)")
    _RUNGS[rung.name] = rung
    return rung


def unregister_rung(name: str) -> None:
    """Remove a rung a user registered (the stock ones stay: removing one raises)."""
    if name in STOCK:
        raise RungError(f"rung {name!r} is a stock rung")
    _RUNGS.pop(name, None)


def get_rung(name: str) -> Rung:
    """The registered rung ``name`` (:class:`RungError` naming the known ones otherwise)."""
    try:
        return _RUNGS[name]
    except (KeyError, TypeError):
        raise RungError(f"unknown rung {name!r}: one of {', '.join(_RUNGS)}") from None


def rung_names(planned: bool | None = None, low: bool | None = None) -> tuple[str, ...]:
    """The registered rungs' names, cheapest per weight first; ``planned`` / ``low`` filter by role."""
    out = [r for r in _RUNGS.values() if (planned is None or r.planned == planned) and (low is None or r.low == low)]
    return tuple(r.name for r in sorted(out, key=lambda r: (r.per_weight(), r.name)))


def planned_rungs() -> tuple[str, ...]:
    """The rungs a plan can put a linear on, cheapest first (stock: ``("int8", "bf16")``)."""
    return rung_names(planned=True)


#: the stock rungs (registered by gnmr_hf.rungs' own files)
STOCK = ("nf4", "fp4", "int4", "int4-asym", "int8", "bf16")
