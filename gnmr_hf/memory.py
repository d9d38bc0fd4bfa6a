"""Memory in the user's currency: what a mixed model (some linears NF4 / FP4 / INT8, the rest BF16)
takes, as bitsandbytes stores it, and budgets given as memory over the all-low model.

bitsandbytes' storage per quantised linear of ``n`` weights and ``rows`` output features (measured on
bitsandbytes 0.50, see tests/test_memory.py):

- 4-bit (NF4 / FP4), blocksize ``b`` (64): the packed weight, ``ceil(n / 2)`` uint8 (a parameter, so
  ``get_memory_footprint()`` counts it), and a quant state it does not count: absmax, one float32 per
  block, and the 16-entry float32 code table; with double quantisation (``bnb_4bit_use_double_quant``)
  absmax is one uint8 per block plus a float32 offset, a second absmax (one float32 per 256 blocks)
  and a 256-entry float32 code table.
- INT8 (LLM.int8, ``has_fp16_weights=False``): ``n`` int8 (a parameter) and one float32 scale per
  output row (``SCB``, an attribute the footprint does not count).

A bias stays a parameter in the load dtype. ``footprint`` below means what
``PreTrainedModel.get_memory_footprint()`` reports (parameters and buffers, each shared tensor
once); ``total`` adds the quant state, which is what the process actually holds for the weights.
"""

from __future__ import annotations

import math
import re

from gnmr_hf.rungs import LinearBytes, RungError, get_rung, rung_names

LOW_FORMATS = ("nf4", "fp4", "int8")  # bitsandbytes' low formats (stock loaders)

__all__ = ["LOW_FORMATS", "LinearBytes", "extra_bytes_over_low", "model_bytes", "parse_budget", "parse_memory_budget",
           "predict_model_bytes", "weight_bytes"]


def weight_bytes(numel: int, rows: int, fmt: str, *, dtype_bytes: int = 2, blocksize: int = 64,
                 double_quant: bool = False) -> LinearBytes:
    """Bytes of a linear weight of ``numel`` elements (``rows`` output features) stored in ``fmt``: a registered
    rung (:mod:`gnmr_hf.rungs`: ``"bf16"``, ``"nf4"``, ``"fp4"``, ``"int8"``, ``"int4"``, or one a user
    registered), or ``"fp16"`` / ``"fp32"`` / ``"high"`` (an unquantised dtype of ``dtype_bytes``). The rung's own
    ``bytes`` function: the one place a rung's bytes are computed."""
    if fmt in ("fp16", "fp32", "high"):
        fmt = "bf16"
    try:
        rung = get_rung(fmt)
    except RungError:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(rung_names())}") from None
    return rung.bytes(numel, rows, dtype_bytes=dtype_bytes, blocksize=blocksize, double_quant=double_quant)


def extra_bytes_over_low(numel: int, rows: int, low: str, *, high: str = "bf16", dtype_bytes: int = 2,
                         blocksize: int = 64, double_quant: bool = False) -> int:
    """What keeping one linear on ``high`` costs over storing it in ``low`` (the whole state counted)."""
    kw = dict(dtype_bytes=dtype_bytes, blocksize=blocksize, double_quant=double_quant)
    return weight_bytes(numel, rows, high, **kw).total - weight_bytes(numel, rows, low, **kw).total


def model_bytes(model) -> dict[str, int]:
    """What a loaded model holds: ``footprint`` (as ``get_memory_footprint()``: parameters and buffers,
    each shared tensor once), ``quant_state`` (bitsandbytes' 4-bit quant states and INT8 row scales)
    and ``total``. bitsandbytes' ``Linear8bitLt`` moves its row scales from ``weight.SCB`` into its ``state`` on
    its first forward; those are counted there, each once."""
    seen: set[int] = set()
    footprint = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        footprint += t.nelement() * t.element_size()
    state = 0
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            state += _tensor_bytes(qs)
        scb = getattr(p, "SCB", None)
        if scb is not None:
            state += scb.nelement() * scb.element_size()
    moved = {id(m.state.SCB): m.state.SCB for m in model.modules()
             if getattr(getattr(m, "state", None), "SCB", None) is not None
             and getattr(getattr(m, "weight", None), "SCB", None) is None}
    state += sum(t.nelement() * t.element_size() for t in moved.values())
    return {"footprint": footprint, "quant_state": state, "total": footprint + state}


def _tensor_bytes(obj) -> int:
    import torch

    total = 0
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            total += value.nelement() * value.element_size()
        elif value is not None and hasattr(value, "absmax") and hasattr(value, "code"):  # state2
            total += _tensor_bytes(value)
    return total


def predict_model_bytes(model, quantized: set[str] | list[str], low: str, *, dtype_bytes: int = 2,
                        blocksize: int = 64, double_quant: bool = False) -> dict[str, int]:
    """The ``model_bytes`` a stock load of ``model``'s checkpoint would have, with the linears named in
    ``quantized`` stored in ``low`` and every other parameter in a dtype of ``dtype_bytes`` (buffers keep
    their own dtype, as a stock load keeps them). ``model`` may be
    the unquantised model or one built on the meta device from its config (only shapes are read)."""
    quantized = set(quantized)
    found = set()
    weights = {}
    for name, module in model.named_modules():
        if name in quantized:
            w = getattr(module, "weight", None)
            if w is None or w.dim() != 2:
                raise ValueError(f"{name} is not a linear with a 2-D weight")
            weights[id(w)] = weight_bytes(w.nelement(), w.shape[0], low, dtype_bytes=dtype_bytes,
                                          blocksize=blocksize, double_quant=double_quant)
            found.add(name)
    missing = quantized - found
    if missing:
        raise ValueError(f"{len(missing)} quantised name(s) not in the model, e.g. {sorted(missing)[0]}")
    seen: set[int] = set()
    footprint = state = 0
    for t in model.parameters():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in weights:
            footprint += weights[id(t)].counted
            state += weights[id(t)].state
        else:
            footprint += t.nelement() * (dtype_bytes if t.is_floating_point() else t.element_size())
    # buffers (rotary tables, ...) keep their own dtype in a stock load
    footprint += sum(b.nelement() * b.element_size() for b in model.buffers() if id(b) not in seen)
    return {"footprint": footprint, "quant_state": state, "total": footprint + state}


def parse_memory_budget(text: str, lows: tuple[str, ...] = ("nf4", "fp4", "int8")) -> tuple[float, str] | None:
    """``"+10%nf4"`` -> ``(0.10, "nf4")``: a budget as memory over the all-low model, the low one of ``lows``
    (``gnmr-hf profile`` adds ``int4``, the compressed-tensors export's W4A16); ``None`` when ``text`` is not of
    that form (a budget in another currency). Refuses 0, negative and > 1000 %."""
    names = "|".join(map(re.escape, lows))
    m = re.match(rf"^\+?\s*(?P<value>\d+(\.\d+)?|\.\d+)\s*%\s*(?P<low>{names})$", text.strip(), re.IGNORECASE)
    if m is None:
        if re.search(rf"%\s*({names})\s*$", text.strip(), re.IGNORECASE):
            raise ValueError(f"budget {text!r}: memory over the low model is written +N%nf4 (or %fp4, %int8) "
                             "with N > 0, e.g. +10%nf4")
        return None
    value = float(m.group("value")) / 100
    if not 0 < value <= 10:
        raise ValueError(f"budget {text!r}: memory over the low model must be in (0, 1000]%")
    return value, m.group("low").lower()


_UNITS = {"b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``"10%"`` -> (None, 0.1); ``"0.1"`` -> (None, 0.1); ``"300MB"``, ``"2GiB"``, ``"123456B"`` -> (bytes, None).

    Units: ``%`` (of the quantised weights' BF16 bytes, in (0, 100]), ``B``, ``KB``/``KiB``, ``MB``/``MiB``,
    ``GB``/``GiB`` (1000 and 1024 powers; case and spaces ignored). A bare number is a fraction, and only in
    (0, 1]; above 1 it is ambiguous (a percentage? bytes?) and is refused: give a unit. Whether a budget buys
    at least the smallest unit and stays within the total is checked by :func:`plan` (it needs the profile).

    Raises:
        ValueError: anything else, in one line starting with ``budget 'TEXT'`` (what is accepted).
    """
    s = str(text).strip().lower().replace(" ", "")
    accepted = "a percentage (10%), a fraction in (0, 1] (0.1) or a size with a unit (300MB, 2GiB, 123456B)"
    bad = ValueError(f"budget {text!r} is not {accepted}")
    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)(%|[a-z]*)", s)
    if not mt:
        raise bad
    value, unit = float(mt.group(1)), mt.group(2)
    if not math.isfinite(value):
        raise bad
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"budget {text!r}: a percentage must be in (0, 100] (0 % keeps nothing on BF16)")
        return None, value / 100
    if unit == "":
        if 0 < value <= 1:
            return None, value
        if value == 0:
            raise ValueError(f"budget {text!r} keeps nothing on BF16: give {accepted}")
        raise ValueError(f"budget {text!r}: a bare number above 1 is ambiguous (percent? bytes?): give a unit "
                         f"({mt.group(1)}% or {mt.group(1)}B, MB, MiB, ...), or a fraction in (0, 1]")
    if unit not in _UNITS:
        raise bad
    size = value * _UNITS[unit]
    if size < 1:
        raise ValueError(f"budget {text!r} is less than one byte")
    if unit == "b" and size != int(size):
        raise ValueError(f"budget {text!r}: a byte count must be a whole number")
    return int(size), None
