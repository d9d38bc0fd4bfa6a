"""Saved-activation quantisation: the low-cost/recovery path of the paper's stress bench.

The paper's activation-quantisation stress bench (section 5.1, Appendix E.1/E.4) keeps weights and
optimizer state in BF16 and quantises, token-wise, only the *saved* input activations that the
attention and SwiGLU projections keep for their backward pass. The forward output is untouched;
what changes is the weight gradient ``grad_W = grad_out^T @ x``, which is computed from the
de-quantised ``x``. The input gradient ``grad_x = grad_out @ W`` does not need ``x`` and is exact.

- Low-cost path: ``low_bits`` (default 4) symmetric integers per token (row), ``scale = absmax / (2^(b-1) - 1)``.
- Recovery path: ``high_bits`` (default 8).
- ``None`` bits means "keep the activation as it is" (the BF16 reference).

Units are the projection *operators* (7 per LLaMA decoder layer: q, k, v, o, gate, up, down), so the
controller runs at operator level; embeddings, norms and the LM head stay outside its action space.
On a PEFT LoRA model the quantised activation is the one LoRA's trainable ``lora_A`` saves (see
:func:`prepare_act_quant`).
The modules subclass :class:`gnmr_hf.backends.base.DualPathModule`, so :func:`gnmr_hf.set_active_units`
and the callback drive them exactly as they drive the INT8/BF16 backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.units import Unit, find_decoder_layers

# LLaMA-family projection names, in the fixed order the operator units are listed within a layer
PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_VALID_BITS = (2, 3, 4, 5, 6, 7, 8)


def _check_bits(name: str, bits: int | None) -> None:
    if bits is not None and (isinstance(bits, bool) or bits not in _VALID_BITS):
        raise ValueError(f"{name} must be None (no quantisation) or an integer in 2..8, got {bits!r}")


def quantize_tokenwise(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token (per-row of the last dimension) absmax quantisation.

    Args:
        x: activations ``[..., features]``.
        bits: integer width; values are rounded to ``{-qmax..qmax}`` with ``qmax = 2^(bits-1) - 1``
            (7 for 4 bits, 127 for 8 bits), so ``|x - dequantize(q)| <= scale / 2`` elementwise.

    Returns:
        ``(q, scale)``: ``q`` int8 of the shape of ``x``; ``scale`` float32 ``[..., 1]``
        (``absmax / qmax``; 0 for an all-zero row).
    """
    _check_bits("bits", bits)
    qmax = 2 ** (bits - 1) - 1
    xf = x.detach().float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax
    # an all-zero row has scale 0; divide by 1 there so it quantises to 0 instead of NaN
    q = torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


def dequantize_tokenwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_tokenwise` (up to rounding): ``q * scale`` cast to ``dtype``."""
    return (q.float() * scale).to(dtype)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    # two signed 4-bit values [-7, 7] per byte, so a 4-bit saved activation really takes half the memory
    u = (q + 8).to(torch.uint8)  # 1..15
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


class _SavedActQuantLinear(torch.autograd.Function):
    """``y = x W^T + b`` whose backward sees a quantised copy of ``x`` for ``grad_W`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, bits, stats):  # noqa: D401 - autograd signature
        out = F.linear(x, weight, bias)
        ctx.bits = bits
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.packed = False
        saved_bytes = 0
        if weight.requires_grad:
            if bits is None:
                ctx.save_for_backward(x, weight, None)
                saved_bytes = x.numel() * x.element_size()
            else:
                q, scale = quantize_tokenwise(x, bits)
                if bits <= 4 and q.shape[-1] % 2 == 0:
                    q = _pack_int4(q)
                    ctx.packed = True
                ctx.save_for_backward(q, weight, scale)
                saved_bytes = q.numel() * q.element_size() + scale.numel() * scale.element_size()
        else:
            ctx.save_for_backward(None, weight, None)
        if stats is not None:
            stats["saved_bytes"] = stats.get("saved_bytes", 0) + saved_bytes
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight, scale = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight.to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.bits is None:
                x_hat = saved
            else:
                q = _unpack_int4(saved) if ctx.packed else saved
                x_hat = dequantize_tokenwise(q, scale, ctx.x_dtype)
            # [out, tokens] @ [tokens, in]
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x_hat.reshape(-1, x_hat.shape[-1]).to(grad_out.dtype)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None, None


class ActQuantLinear(nn.Linear, DualPathModule):
    """An ``nn.Linear`` whose saved input activation is quantised token-wise for the backward.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        low_bits: bits of the saved activation on the low-cost path (None: not quantised).
        high_bits: bits on the recovery path (None: not quantised).

    ``full_precision = True`` bypasses both paths (saves the activation unquantised); the recipe uses
    it for the BF16 warm-up of the ADAPT-style baseline. ``last_saved_bytes`` holds the bytes this
    module saved for its backward in its latest forward (for the memory column of the report).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        low_bits: int | None = 4,
        high_bits: int | None = 8,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_paths(low_bits, high_bits)

    def _init_paths(self, low_bits: int | None, high_bits: int | None) -> None:
        _check_bits("low_bits", low_bits)
        _check_bits("high_bits", high_bits)
        self.low_bits = low_bits
        self.high_bits = high_bits
        self.recovery = False
        self.full_precision = False
        self._stats: dict[str, int] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, low_bits: int | None = 4, high_bits: int | None = 8) -> ActQuantLinear:
        """Wrap an existing ``nn.Linear``, sharing its parameter objects (optimizers keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_paths(low_bits, high_bits)
        return new

    @property
    def bits(self) -> int | None:
        """Bits the next forward saves its activation with (None: unquantised)."""
        if self.full_precision:
            return None
        return self.high_bits if self.recovery else self.low_bits

    @property
    def last_saved_bytes(self) -> int:
        return self._stats.get("saved_bytes", 0)

    def set_recovery(self, on: bool) -> None:
        self.recovery = bool(on)

    def recovery_device_bytes(self) -> int:
        # the recovery path holds no extra weights; its only cost is the wider saved activation
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._stats = {}
        if not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _SavedActQuantLinear.apply(x, self.weight, self.bias, self.bits, self._stats)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, low_bits={self.low_bits}, high_bits={self.high_bits}, recovery={self.recovery}"


def is_projection(module: nn.Module, fqn: str) -> bool:
    """Filter: an ``nn.Linear`` named like a LLaMA attention/SwiGLU projection (``...q_proj`` etc.)."""
    return isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] in PROJECTIONS


def prepare_act_quant(
    model: nn.Module,
    low_bits: int | None = 4,
    high_bits: int | None = 8,
    units: str = "operators",
    filter_fn: Callable[[nn.Module, str], bool] = is_projection,
) -> list[Unit]:
    """Give every trainable projection of every decoder layer a saved-activation-quantised dual path.

    What is quantised is the saved input that a *trainable* weight's gradient is computed from:

    - a plain model (the paper's stress bench, full training): each projection ``nn.Linear`` whose
      weight requires grad is replaced by an :class:`ActQuantLinear` sharing its parameters;
    - a PEFT LoRA model: the frozen base layer keeps its exact forward and saves nothing for a weight
      gradient, so each LoRA-wrapped projection's ``lora_A`` linears (whose gradient is
      ``grad_out^T @ x``, ``x`` being the projection's input) become :class:`ActQuantLinear`. ``lora_B``
      sees ``lora_A(x)``, computed in the forward from the unquantised ``x``, so its gradient is the
      stock one. The adapter's parameters and state-dict keys do not change. Projections without a
      trainable weight (not targeted by LoRA) are left alone.

    Args:
        model: a LLaMA-style causal LM (plain or PEFT-wrapped); modified in place.
        low_bits: bits of the low-cost path (4 in the paper); None keeps activations unquantised.
        high_bits: bits of the recovery path (8 in the paper).
        units: ``"operators"`` (one unit per projection: 7 per LLaMA layer, in layer order and then
            q, k, v, o, gate, up, down; for PEFT, the LoRA-wrapped projection) or ``"layers"`` (one
            unit per decoder layer).
        filter_fn: ``(module, qualified_name) -> bool`` choosing the projections (for a LoRA layer it
            is asked about the wrapped base layer under the LoRA layer's name).

    Returns:
        The units as ``(qualified_name, module)`` pairs, ready for ``GNMRCallback(units=...)`` and
        :func:`gnmr_hf.set_active_units`. Embeddings, norms and the head are never converted. Calling
        it again returns the same units and leaves the modules converted before as they are.

    Raises:
        ValueError: bad ``units`` or bits; no trainable projection inside the decoder layers.
    """
    if units not in ("operators", "layers"):
        raise ValueError(f"units must be 'operators' or 'layers', got {units!r}")
    _check_bits("low_bits", low_bits)
    _check_bits("high_bits", high_bits)
    out: list[Unit] = []
    for layer_name, layer in find_decoder_layers(model):
        ops = [
            (f"{layer_name}.{rel}", _convert(layer, rel, mod, low_bits, high_bits))
            for rel, mod in _projections(layer, layer_name, filter_fn)
        ]
        ops.sort(key=lambda item: _projection_rank(item[0]))
        if units == "operators":
            out.extend(ops)
        elif ops:
            out.append((layer_name, layer))
    if not out:
        raise ValueError(
            "prepare_act_quant found no projection with a trainable weight inside the decoder layers "
            "(a PEFT model needs LoRA on the projections; a plain model needs them unfrozen)"
        )
    return out


def _is_lora_layer(module: nn.Module) -> bool:
    # PEFT's LoraLayer (duck-typed: no peft import): a ModuleDict of lora_A linears around a base layer
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "get_base_layer")


def _projections(
    layer: nn.Module, layer_name: str, filter_fn: Callable[[nn.Module, str], bool]
) -> list[tuple[str, nn.Module]]:
    """The projections of one decoder layer that carry a trainable weight: LoRA layers or linears."""
    found: list[tuple[str, nn.Module]] = []
    lora_prefixes: list[str] = []
    for rel, mod in layer.named_modules():
        if not rel or any(rel.startswith(p) for p in lora_prefixes):
            continue
        if _is_lora_layer(mod):
            lora_prefixes.append(rel + ".")  # its base layer and lora_A/B are handled through it
            if len(mod.lora_A) and filter_fn(mod.get_base_layer(), f"{layer_name}.{rel}"):
                found.append((rel, mod))
        elif isinstance(mod, ActQuantLinear) or (
            filter_fn(mod, f"{layer_name}.{rel}") and isinstance(mod, nn.Linear) and mod.weight.requires_grad
        ):
            found.append((rel, mod))
    return found


def _convert(layer: nn.Module, rel: str, mod: nn.Module, low_bits: int | None, high_bits: int | None) -> nn.Module:
    """Convert one projection (see :func:`prepare_act_quant`) and return its unit module."""
    if _is_lora_layer(mod):
        for adapter, lin in mod.lora_A.items():
            if not isinstance(lin, ActQuantLinear):
                mod.lora_A[adapter] = ActQuantLinear.from_linear(lin, low_bits=low_bits, high_bits=high_bits)
        return mod
    if isinstance(mod, ActQuantLinear):
        return mod
    parent_rel, _, child = rel.rpartition(".")
    new = ActQuantLinear.from_linear(mod, low_bits=low_bits, high_bits=high_bits)
    setattr(layer.get_submodule(parent_rel) if parent_rel else layer, child, new)
    return new


def _projection_rank(fqn: str) -> tuple[int, str]:
    leaf = fqn.rsplit(".", 1)[-1]
    return (PROJECTIONS.index(leaf) if leaf in PROJECTIONS else len(PROJECTIONS), fqn)


def act_quant_modules(model: nn.Module) -> list[ActQuantLinear]:
    return [m for m in model.modules() if isinstance(m, ActQuantLinear)]


def set_full_precision(model: nn.Module, on: bool) -> None:
    """Make every act-quant module save unquantised activations (True) or use its paths again."""
    for m in act_quant_modules(model):
        m.full_precision = bool(on)


def saved_activation_bytes(model: nn.Module) -> int:
    """Bytes the act-quant modules saved for backward in their latest forward (summed)."""
    return sum(m.last_saved_bytes for m in act_quant_modules(model))
