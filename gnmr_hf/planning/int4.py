"""The compressed-tensors export's quantisers in plain torch, and what a plan meant for that export is
profiled and priced with: :func:`int4_fake_quant` (W4A16: INT4, group-wise symmetric, or W4A16_ASYM: a zero point
per group, the ``int4-asym`` low) and :func:`int8_fake_quant` (W8A16: per channel), bit-exact to the library's on the same BF16 weight (tests/test_export_ct.py);
:func:`ct_rung_gains`, each decoder linear's first-order gain on the INT8 and BF16 rungs at the uniform W4A16
point; :func:`ct_tensor_bytes` / :func:`ct_rung_prices`, the bytes the folder stores. The planner
(``gnmr-hf profile --low int4``) and the export (:mod:`gnmr_hf.export_ct`, which re-exports these names) share
them; nothing here needs the compressed-tensors library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gnmr_hf.planning.groups import (
    INT4_PROFILE,  # noqa: F401  (the refusal's words, re-exported)
    decoder_linears,
)
from gnmr_hf.planning.ladder import LadderUnit
from gnmr_hf.rungs import get_rung, planned_rungs
from gnmr_hf.rungs.int4 import INT4_LOWS


def weight_fake_quant(weight, num_bits: int, group_size: int | None = None, symmetric: bool = True):
    """Integer quantise-dequantise of a ``(out, in)`` weight as compressed-tensors computes it, from each group's
    (``group_size`` columns; ``None``: the whole row, per channel) range ``lo = min(w, 0)``, ``hi = max(w, 0)``.
    Symmetric: ``scale = max(|lo|, |hi|) / ((2**bits - 1) / 2)`` in the weight's dtype (an all-zero group gets
    the dtype's eps), codes ``round(clamp(w / scale, -2**(bits-1), 2**(bits-1) - 1))``, value ``code * scale``.
    Asymmetric (``symmetric=False``): ``scale = (hi - lo) / (2**bits - 1)``, zero point ``z = round(clamp(q_min -
    lo / scale, q_min, q_max))``, codes ``round(clamp(w / scale + z, q_min, q_max))``, value ``(code - z) * scale``
    (compressed-tensors' ``calculate_qparams`` and ``fake_quantize``, step for step in the same dtypes).
    Returns the dequantised weight in ``weight``'s dtype; pass the BF16 weight the export quantises."""
    import torch

    w = weight.detach()
    rows, cols = w.shape
    g = cols if group_size is None else int(group_size)
    if g <= 0 or cols % g:
        raise ValueError(f"group_size {group_size} does not divide the weight's {cols} columns")
    x = w.reshape(rows, cols // g, g)  # (out, groups, group)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    lo, hi = torch.minimum(x.amin(-1), zero), torch.maximum(x.amax(-1), zero)  # 0 always representable
    q_min, q_max = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    eps = torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device)
    if not symmetric:
        scale = (hi - lo) / torch.tensor(float(q_max - q_min)).to(w.dtype)
        zero = torch.round(torch.clamp(q_min - lo / scale, q_min, q_max)).to(torch.int8)
        scale = torch.where(scale == 0, eps, scale)
        z = zero.to(w.dtype).unsqueeze(-1)
        codes = torch.round(torch.clamp(x / scale.unsqueeze(-1) + z, q_min, q_max))
        return ((codes - z) * scale.unsqueeze(-1)).reshape(rows, cols)
    # the library divides by its code range cast to the weight's dtype, halved there
    half = torch.tensor(float(q_max - q_min)).to(w.dtype) / 2
    scale = torch.maximum(lo.abs(), hi.abs()) / half
    scale = torch.where(scale == 0, eps, scale)
    codes = torch.round(torch.clamp(x / scale.unsqueeze(-1), q_min, q_max)).to(torch.int8)
    return (codes.to(w.dtype) * scale.unsqueeze(-1)).reshape(rows, cols)


def int4_fake_quant(weight, group_size: int = 128, symmetric: bool = True):
    """The export's low rung (W4A16: INT4, group-wise symmetric; ``symmetric=False``: W4A16_ASYM, a zero point per
    group) as quantise-dequantise, bit-exact to the served weight when given the BF16 weight the export quantises
    (see :func:`weight_fake_quant`)."""
    return weight_fake_quant(weight, 4, group_size, symmetric)


def low_fake_quant(low: str, group_size: int = 128) -> Callable:
    """The quantise-dequantise of the INT4 low ``low`` (``"int4"`` or ``"int4-asym"``) at ``group_size``."""
    if low not in INT4_LOWS:
        raise ValueError(f"low {low!r}: the compressed-tensors export's INT4 lows are {', '.join(INT4_LOWS)}")
    symmetric = INT4_LOWS[low]
    return lambda w: int4_fake_quant(w, group_size, symmetric)


def int8_fake_quant(weight):
    """The export's INT8 rung (W8A16: per output channel, symmetric) as quantise-dequantise."""
    return weight_fake_quant(weight, 8, None)


def fake_quantize_model(model, rungs: Mapping[str, str], group_size: int = 128, linears: list[str] | None = None,
                        low: str = "int4"):
    """``model`` (in place) with every decoder linear's weight quantised-dequantised at its rung: the INT4 ``low``
    (:func:`int4_fake_quant`, symmetric for ``"int4"``, a zero point per group for ``"int4-asym"``) unless ``rungs`` puts it on ``"int8"`` (:func:`int8_fake_quant`) or ``"bf16"``
    (unchanged). The weights are quantised in their own dtype: give a BF16 model to reproduce the export, then
    cast it (``.float()``) to compute in FP32. Returns ``model``."""
    import torch

    quant = low_fake_quant(low, group_size)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in linears if linears is not None else decoder_linears(model):
            rung = rungs.get(name, "low")
            if rung == "bf16":
                continue
            w = modules[name].weight
            w.copy_(int8_fake_quant(w) if rung == "int8" else quant(w))
    return model


def ct_rung_prices(out_features: int, in_features: int, group_size: int = 128, low: str = "int4") -> dict[str, int]:
    """Bytes each planned rung with a compressed-tensors scheme (the registry's: the stock INT8 and BF16, and any a
    user registers with one) costs one linear in the folder over its form on the INT4 ``low``
    (:func:`ct_tensor_bytes`, bias aside)."""
    shape = {"x": (out_features, in_features, False)}
    base = ct_tensor_bytes(shape, {}, 0, group_size, low)
    return {r: ct_tensor_bytes(shape, {"x": r}, 0, group_size, low) - base for r in planned_rungs()
            if "compressed-tensors" in get_rung(r).exports}


def ct_rung_gains(model, batches, group_size: int = 128, linears: list[str] | None = None,
                  low: str = "int4") -> list[Any]:
    """Every decoder linear's first-order gain on the INT8 and BF16 rungs against this export's own W4A16 low
    path, and each rung's price in the folder's bytes: the profile for a plan meant for
    :func:`export_compressed_tensors` (a plan profiled against NF4 ranks another quantiser's errors).

    The low point is the uniform W4A16 model exactly: each decoder linear's weight replaced by
    :func:`int4_fake_quant` of its BF16 value (bit-exact to the served weight); ``W_rung`` is
    :func:`int8_fake_quant` of the BF16 weight, or the BF16 weight (:func:`fake_quant_rung_gains`).

    Args:
        model: the BF16 checkpoint loaded in the dtype to compute in (FP32: its weights are the BF16 values
            upcast exactly; they are quantised from their BF16 value); restored before returning.
        batches: dicts with ``input_ids``, ``labels`` (and optionally ``attention_mask``).
        group_size: the W4A16 group size the export will use.
        linears: the decoder linears (default :func:`gnmr_hf.planning.groups.decoder_linears`).
        low: the INT4 low (``"int4"``, or ``"int4-asym"``: W4A16_ASYM, a zero point per group).

    Returns:
        ``LadderUnit`` per linear (:class:`gnmr_hf.planning.ladder.LadderUnit`), prices from :func:`ct_rung_prices`:
        feed them to ``choose_rungs`` (with the serving groups for vLLM).
    """
    return fake_quant_rung_gains(model, batches, low_fake_quant(low, group_size),
                                 {"int8": int8_fake_quant, "bf16": lambda w: w},
                                 lambda rows, cols: ct_rung_prices(rows, cols, group_size, low), linears)


def fake_quant_rung_gains(model, batches, low_quant: Callable, rung_quants: Mapping[str, Callable],
                          prices: Callable[[int, int], dict[str, int]], linears: list[str] | None = None) -> list[Any]:
    """Every decoder linear's first-order gain on each rung of ``rung_quants`` at the uniform-low point of an
    export whose quantisers are given as quantise-dequantise functions of the BF16 weight.

    The low point: each decoder linear's weight replaced by ``low_quant`` of its BF16 value. One forward and
    backward per batch there gives ``dL/dW``, and a rung's gain is ``-<dL/dW, W_rung - W_low>`` summed over the
    batches (``W_rung = rung_quants[rung](W_bf16)``), the same first-order estimate as
    :func:`gnmr_hf.planning.ladder.rung_gains` (``-<dL/dy, y_rung - y_low>`` summed over tokens, since
    ``y = x W^T``). ``prices(out_features, in_features)``: each rung's bytes over the low form. The model's
    weights, ``requires_grad`` flags and training mode are restored before returning.
    """
    import torch

    names = list(linears) if linears is not None else decoder_linears(model)
    modules = dict(model.named_modules())
    originals = {n: modules[n].weight.detach().clone() for n in names}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    units = []
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for n in names:
            w = modules[n].weight
            w.data.copy_(low_quant(originals[n].to(torch.bfloat16)).to(w.dtype))
            w.grad = None
            w.requires_grad_(True)
        model.eval()
        with torch.enable_grad():
            for b in batches:
                b = dict(b)
                out = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"])
                out.loss.backward()
        for n in names:
            w = modules[n].weight
            bf16 = originals[n].to(torch.bfloat16)
            low = w.detach()
            grad = w.grad.to(torch.float64)
            gains = {r: -float((grad * (q(bf16).to(low.dtype) - low).to(torch.float64)).sum())
                     for r, q in rung_quants.items()}
            rows, cols = w.shape
            units.append(LadderUnit(n, w.numel(), rows, gains=gains, prices=prices(rows, cols)))
    finally:
        for n in names:
            w = modules[n].weight
            w.grad = None
            w.data.copy_(originals[n])
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)
    return units


def ct_shapes(model, linears: list[str]) -> tuple[dict[str, tuple[int, int, bool]], int]:
    """What :func:`ct_tensor_bytes` prices a model by: each decoder linear's ``(out, in, has bias)`` and the
    number of every other parameter (tied ones once), for ``gnmr-hf profile --low int4`` and the export alike."""
    modules = dict(model.named_modules())
    decoder = set(linears)
    shapes = {n: (modules[n].out_features, modules[n].in_features, modules[n].bias is not None) for n in linears}
    other = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in decoder)
    return shapes, other


def ct_tensor_bytes(shapes: Mapping[str, tuple[int, int, bool]], rungs: Mapping[str, str], other_params: int,
                    group_size: int = 128, low: str = "int4") -> int:
    """The bytes of the tensors a compressed-tensors folder stores (safetensors data, headers aside): per
    quantised linear its int32-packed codes, BF16 scales (one per group, or per row for INT8) and int64
    ``weight_shape``; unquantised linears, biases and every other parameter (``other_params``, tied ones once)
    in BF16. ``rungs`` as in :func:`fake_quantize_model` (``{}``: uniform W4A16). Each linear's bytes are its
    rung's in the registry as this format stores it (:meth:`gnmr_hf.rungs.Rung.bytes_in`; the INT4 ``low`` rung,
    ``int4`` or ``int4-asym``, for the low ones), so a registered rung is priced here as everywhere else."""
    total = 2 * other_params
    if low not in INT4_LOWS:
        raise ValueError(f"low {low!r}: the compressed-tensors export's INT4 lows are {', '.join(INT4_LOWS)}")
    base = get_rung(low)
    for name, (out_f, in_f, bias) in shapes.items():
        rung = base if rungs.get(name, "low") == "low" else get_rung(rungs[name])
        total += 2 * out_f if bias else 0
        total += rung.bytes_in("compressed-tensors", out_f * in_f, out_f, group_size=group_size).total
    return total


def _largest_group(in_features: list[int], upto: int) -> int | None:
    g = 1 << (max(upto, 1).bit_length() - 1)
    while g >= 16:
        if all(n % g == 0 for n in in_features):
            return g
        g //= 2
    return None
