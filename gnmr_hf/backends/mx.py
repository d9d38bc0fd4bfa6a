"""OCP Microscaling (MX) low path: fake quantisation and a dual-path MX linear.

The MX stress bench (docs/design.md; arXiv 2506.20752) trains a plain model whose GEMMs run in a
block-scaled MX format and lets GNMR move decoder layers (or residual blocks) to BF16 while it runs.

- :func:`mx_fake_quantize` rounds a tensor onto an MX grid (OCP MX v1.0) and de-quantises it again,
  so the rest of the computation stays in ordinary float dtypes ("fake" or emulated quantisation).
- :class:`MXLinear` is an ``nn.Linear`` whose low-cost path fake-quantises both operands of every
  GEMM, forward and backward, and whose recovery path is the plain linear in BF16 (native, or
  emulated with FP32 GEMMs on BF16-rounded values for CPUs without BF16 matrix units).
- With ``quantize_norms=True`` the norm layers inside a unit fake-quantise their affine weight on the
  low path (the study's trigger of the instability) and switch with the unit.
- :func:`prepare_mx` converts the linears (and optionally norms) inside each unit, in place;
  :func:`gnmr_hf.backends.base.set_active_units` then moves units between the paths.

Only torch is imported here; the module is usable for any ``nn.Module`` (pre-training).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.units import UnitSpec, resolve_units


@dataclass(frozen=True)
class MXElementFormat:
    """A small floating-point element format of OCP MX v1.0.

    Args:
        name: the MX name (``"mxfp8_e4m3"`` ...).
        ebits: exponent bits.
        mbits: explicit mantissa bits.
        emax: exponent of the largest normal number (the ``emax_elem`` of the scale rule).
        emin: exponent of the smallest normal number (``1 - bias``); subnormals below it have the
            fixed spacing ``2^(emin - mbits)``.
        max_normal: the largest finite magnitude (448 for E4M3, whose all-ones mantissa at the top
            exponent is NaN, ``(2 - 2^-mbits) * 2^emax`` for the others).
    """

    name: str
    ebits: int
    mbits: int
    emax: int
    emin: int
    max_normal: float


MX_FORMATS: dict[str, MXElementFormat] = {
    f.name: f
    for f in (
        MXElementFormat("mxfp8_e4m3", ebits=4, mbits=3, emax=8, emin=-6, max_normal=448.0),
        MXElementFormat("mxfp8_e5m2", ebits=5, mbits=2, emax=15, emin=-14, max_normal=57344.0),
        MXElementFormat("mxfp6_e3m2", ebits=3, mbits=2, emax=4, emin=-2, max_normal=28.0),
        MXElementFormat("mxfp6_e2m3", ebits=2, mbits=3, emax=2, emin=0, max_normal=7.5),
        MXElementFormat("mxfp4_e2m1", ebits=2, mbits=1, emax=2, emin=0, max_normal=6.0),
    )
}

# smallest E8M0 shared-scale exponent (the range is [-127, 127]; the biased code 255 is NaN)
E8M0_MIN_EXP = -127


def mx_format(fmt: str | MXElementFormat, field: str = "fmt") -> MXElementFormat:
    """Look up an element format by name; ``ValueError`` naming ``field`` and the valid names otherwise."""
    if isinstance(fmt, MXElementFormat):
        return fmt
    try:
        return MX_FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: unknown MX format {fmt!r}; expected one of {sorted(MX_FORMATS)}") from None


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer (32 in OCP MX v1.0), got {block_size!r}")


# float32 exponent field: ``bits & _EXP_MASK`` reinterpreted as float32 is 2^floor(log2|v|) for a normal
# v, 0 for zero and float32 subnormals, +inf for +-inf and NaN (bitwise AND is vectorised; shifts are not)
_EXP_MASK = 0x7F800000


def _pow2_floor(v: torch.Tensor) -> torch.Tensor:
    return (v.view(torch.int32) & _EXP_MASK).view(torch.float32)


def _blocks_and_scale(x: torch.Tensor, spec: MXElementFormat, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float32 as ``[rows, n_blocks, block_size]`` (zero-padded) and each block's shared scale
    ``[rows, n_blocks, 1]`` (+inf for a block holding a NaN or Inf)."""
    n = x.shape[-1] if x.dim() else 1
    # contiguous: the backward passes transposed operands, and strided elementwise kernels are slow
    xf = x.detach().to(torch.float32).reshape(-1, n).contiguous()
    pad = (-n) % block_size
    if pad:
        # zero padding leaves every block maximum (and so every scale) unchanged
        xf = F.pad(xf, (0, pad))
    blocks = xf.reshape(xf.shape[0], -1, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # X = 2^(floor(log2 amax) - emax). The E8M0 lower clamp (2^-127) also catches all-zero blocks and
    # subnormal maxima; the upper one (2^127) cannot bind for finite float32 values, and a non-finite
    # maximum keeps scale = +inf so that the whole block de-quantises to NaN (E8M0 code 0xFF)
    scale = _pow2_floor(amax).mul_(2.0**-spec.emax).clamp_(min=2.0**E8M0_MIN_EXP)
    return blocks, scale


def _fake_quantize_f32(x: torch.Tensor, spec: MXElementFormat, block_size: int) -> torch.Tensor:
    """:func:`mx_fake_quantize` in float32, without the final cast (the GEMMs use it directly)."""
    shape = x.shape
    n = shape[-1] if x.dim() else 1
    blocks, scale = _blocks_and_scale(x, spec, block_size)
    y = blocks / scale  # exact: the scale is a power of two
    y.clamp_(-spec.max_normal, spec.max_normal)  # saturate at the largest normal (NaN stays NaN)
    # round to nearest-even on the element grid, whose spacing is 2^(max(floor(log2|y|), emin) - mbits)
    step = _pow2_floor(y).mul_(2.0**-spec.mbits).clamp_(min=2.0 ** (spec.emin - spec.mbits))
    y.div_(step).round_().mul_(step).mul_(scale)  # torch.round is round-half-to-even
    out = y.reshape(blocks.shape[0], -1)
    if out.shape[1] != n:
        out = out[:, :n]
    return out.reshape(shape)


def mx_fake_quantize(x: torch.Tensor, fmt: str = "mxfp8_e4m3", block_size: int = 32) -> torch.Tensor:
    """Round ``x`` onto an OCP MX v1.0 grid and return the de-quantised values.

    Blocks are ``block_size`` consecutive values along the last dimension. Each block shares the
    scale ``X = 2^(floor(log2(max|v|)) - emax_elem)`` with its exponent clamped to the E8M0 range
    [-127, 127]; each value becomes ``X * P`` where ``P = v / X`` is rounded to nearest-even on the
    element grid (subnormals kept) and clamped at +-``max_normal`` (so the block maximum saturates
    when it rounds above the largest normal: the clamping the MX instability study blames).

    - A ragged last block (``x.shape[-1] % block_size != 0``) is treated as if padded with zeros,
      which changes neither its maximum nor its other values.
    - An all-zero block stays zero.
    - A NaN or +-Inf in a block makes the whole block NaN (its shared scale is NaN); so do values
      beyond the float32 range, which become Inf in the float32 computation.
    - The computation is done in float32 and the result is cast to the dtype of ``x``; MX values
      (at most 3 mantissa bits, power-of-two scales) are exact in BF16, so a BF16 input loses
      nothing beyond the MX rounding.
    - The result does not require grad (rounding has no useful derivative); use a straight-through
      estimator such as ``w + (mx_fake_quantize(w) - w).detach()`` where a gradient is needed.

    Args:
        x: a floating-point tensor of any shape (a 0-d tensor is one block of one value).
        fmt: one of ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4_e2m1``.
        block_size: values per shared scale (32 in OCP MX v1.0).

    Returns:
        A tensor of the shape and dtype of ``x``.

    Example (FP4 E2M1, grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; block max 5 -> scale 2^(2-2) = 1)::

        >>> mx_fake_quantize(torch.tensor([5.0, 2.5, 0.75, 0.2]), "mxfp4_e2m1")
        tensor([4., 2., 1., 0.])
    """
    spec = mx_format(fmt)
    _check_block_size(block_size)
    if not torch.is_floating_point(x):
        raise TypeError(f"mx_fake_quantize needs a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        return x.detach().clone()
    return _fake_quantize_f32(x, spec, block_size).to(x.dtype)


def mx_clamp_fraction(x: torch.Tensor, fmt: str = "mxfp8_e4m3", block_size: int = 32) -> float:
    """Fraction of the values of ``x`` that the MX scale rule saturates.

    A value saturates when ``|v| / X`` exceeds the element format's largest normal, ``X`` being its
    block's shared scale: these are the values in a block's top bucket that get clamped (the
    mechanism the instability study blames). A diagnostic for the stress bench, not on the training
    path. Non-finite blocks are not counted.

    Args:
        x: a floating-point tensor, blocked along its last dimension as in :func:`mx_fake_quantize`.
        fmt: the MX element format name.
        block_size: values per shared scale.
    """
    spec = mx_format(fmt)
    _check_block_size(block_size)
    if x.numel() == 0:
        return 0.0
    blocks, scale = _blocks_and_scale(x, spec, block_size)
    return (blocks.abs() / scale > spec.max_normal).sum().item() / x.numel()


class _MXLinearFunction(torch.autograd.Function):
    """``y = Q(x) Q(W)^T + b`` with ``dX = Q(dY) Q(W)`` and ``dW = Q(dY^T) Q(X)`` in the backward.

    Every GEMM operand is quantised in blocks along that GEMM's reduction dimension: ``in`` for the
    forward, ``out`` for ``dX``, the token dimension for ``dW``. The bias and its gradient are not
    GEMM operands and stay unquantised. GEMMs run in float32 on the de-quantised operands (MX
    hardware accumulates in FP32).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fmt, backward_fmt, block_size):  # noqa: D401 - autograd signature
        spec = MX_FORMATS[fmt]
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
        xq = _fake_quantize_f32(x2, spec, block_size)
        wq = _fake_quantize_f32(weight, spec, block_size)  # [out, in], blocks along in
        out = xq @ wq.t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        ctx.save_for_backward(x, weight)
        ctx.backward_fmt = backward_fmt
        ctx.block_size = block_size
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        spec = MX_FORMATS[ctx.backward_fmt]
        bs = ctx.block_size
        dy = grad_out.reshape(-1, grad_out.shape[-1])  # [tokens, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dX [tokens, in] = dY [tokens, out] @ W [out, in]: reduction over out
            dyq = _fake_quantize_f32(dy, spec, bs)
            wq_t = _fake_quantize_f32(weight.t(), spec, bs)  # [in, out], blocks along out
            grad_x = (dyq @ wq_t.t()).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # dW [out, in] = dY^T [out, tokens] @ X [tokens, in]: reduction over tokens
            x2 = x.reshape(-1, x.shape[-1])
            dytq = _fake_quantize_f32(dy.t(), spec, bs)  # [out, tokens]
            xtq = _fake_quantize_f32(x2.t(), spec, bs)  # [in, tokens]
            grad_w = (dytq @ xtq.t()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class MXLinear(nn.Linear, DualPathModule):
    """An ``nn.Linear`` with an MX low-cost path and a BF16 recovery path.

    - Low-cost path (``recovery = False``): both GEMM operands fake-quantised to ``fmt`` in the
      forward, and the operands of both backward GEMMs to ``backward_fmt`` (see
      :class:`_MXLinearFunction`); also in eval / ``no_grad`` so validation sees the same numbers.
    - Recovery path (``recovery = True``): input, weight and bias cast to bfloat16, ``F.linear`` in
      bfloat16 (autograd runs the backward GEMMs in bfloat16 too), output cast back to the input's
      dtype. The weights stay where they are, so :meth:`recovery_device_bytes` is 0.
    - ``emulate_bf16 = True`` computes the same recovery path with float32 GEMMs on the
      bfloat16-rounded operands, rounding the output (and, through the casts' backward, the
      gradients) to bfloat16: BF16 storage with FP32 accumulation, as BF16 hardware does, equal to
      the native path up to accumulation order. For CPUs without BF16 matrix units, where native
      BF16 GEMMs run 10-100x slower than FP32 ones.

    Build one with :meth:`convert` (in place from an ``nn.Linear``) or like an ``nn.Linear``.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        fmt: the forward MX element format (see :data:`MX_FORMATS`).
        block_size: values per shared scale.
        backward_fmt: the element format of the backward GEMM operands; None means ``fmt``.
        emulate_bf16: compute the recovery path with emulated rather than native BF16 GEMMs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        fmt: str = "mxfp8_e4m3",
        block_size: int = 32,
        backward_fmt: str | None = None,
        emulate_bf16: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_mx(fmt, block_size, backward_fmt, emulate_bf16)

    def _init_mx(self, fmt: str, block_size: int, backward_fmt: str | None, emulate_bf16: bool) -> None:
        self.fmt = mx_format(fmt).name
        self.backward_fmt = mx_format(backward_fmt if backward_fmt is not None else fmt, "backward_fmt").name
        _check_block_size(block_size)
        self.block_size = block_size
        self.emulate_bf16 = bool(emulate_bf16)
        self.recovery = False

    @classmethod
    def convert(
        cls,
        linear: nn.Linear,
        fmt: str = "mxfp8_e4m3",
        block_size: int = 32,
        backward_fmt: str | None = None,
        emulate_bf16: bool = False,
    ) -> MXLinear:
        """Turn ``linear`` into an :class:`MXLinear` in place and return it.

        The module object, its parameters, hooks and any references to it are kept (its class is
        swapped), so optimizers and the state-dict keys are unaffected. Only a plain ``nn.Linear``
        (or an ``MXLinear``, which is re-configured) is accepted: subclasses such as quantised or
        LoRA linears have their own forward. The arguments are those of :class:`MXLinear`.
        """
        if type(linear) is not nn.Linear and not isinstance(linear, MXLinear):
            raise TypeError(
                f"MXLinear.convert needs a plain nn.Linear, got {type(linear).__name__} "
                "(quantised, LoRA or other dual-path linears cannot take an MX path)"
            )
        recovery = getattr(linear, "recovery", False)
        linear.__class__ = cls
        linear._init_mx(fmt, block_size, backward_fmt, emulate_bf16)
        linear.recovery = recovery
        return linear

    def set_recovery(self, on: bool) -> None:
        self.recovery = bool(on)

    def recovery_device_bytes(self) -> int:
        # the BF16 path casts the weight on the fly: no extra weights are held between steps
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recovery:
            bf = torch.bfloat16
            bias = self.bias.to(bf) if self.bias is not None else None
            if self.emulate_bf16:
                f32 = torch.float32
                bias = bias.to(f32) if bias is not None else None
                out = F.linear(x.to(bf).to(f32), self.weight.to(bf).to(f32), bias)
                return out.to(bf).to(x.dtype)
            return F.linear(x.to(bf), self.weight.to(bf), bias).to(x.dtype)
        return _MXLinearFunction.apply(x, self.weight, self.bias, self.fmt, self.backward_fmt, self.block_size)

    def extra_repr(self) -> str:
        bwd = "" if self.backward_fmt == self.fmt else f", backward_fmt={self.backward_fmt}"
        emu = ", emulate_bf16=True" if self.emulate_bf16 else ""
        return (
            f"{super().extra_repr()}, fmt={self.fmt}{bwd}, block_size={self.block_size}{emu}, "
            f"recovery={self.recovery}"
        )


def _straight_through(w: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    # forward: the MX value; backward: identity (the quantiser's gradient is taken as 1)
    return w + (_fake_quantize_f32(w, MX_FORMATS[fmt], block_size).to(w.dtype) - w).detach()


class MXNormMixin(DualPathModule):
    """Low path for a norm layer: its affine ``weight`` is fake-quantised (straight-through) in the
    forward. The recovery path is the norm as it was. The bias (LayerNorm) is not quantised and
    keeps its ordinary gradient; the study's MX LayerNorm instead computes in BF16 and gives the
    bias no gradient in its MX backward.

    Mixed into the norm's own class by :func:`prepare_mx` (``type(norm)`` becomes a subclass of it),
    so ``isinstance`` checks, parameter names and the state-dict keys are unchanged. Such a module
    pickles (``torch.save(model)``, ``copy.deepcopy``) as its original norm class plus this mixin,
    rebuilt on load.
    """

    mx_fmt: str = "mxfp8_e4m3"
    mx_block_size: int = 32

    _mx_base: type = nn.Module  # the norm's original class, set on each generated class

    def set_recovery(self, on: bool) -> None:
        self.recovery = bool(on)

    def recovery_device_bytes(self) -> int:
        return 0

    def __reduce_ex__(self, protocol):
        # the generated class has no importable name; pickle the original class and re-apply the mixin
        return (_unpickle_mx_norm, (self._mx_base, self.__dict__))

    def forward(self, *args, **kwargs):
        weight = self._parameters.get("weight")
        if self.recovery or weight is None:
            return super().forward(*args, **kwargs)
        # swap the quantised weight in for this call only, so the norm's own forward is reused as is
        self._parameters["weight"] = _straight_through(weight, self.mx_fmt, self.mx_block_size)
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["weight"] = weight


_NORM_CLASSES: dict[type, type] = {}


def is_norm(module: nn.Module) -> bool:
    """A LayerNorm / RMSNorm (torch's, or a class named ``...LayerNorm`` / ``...RMSNorm`` such as
    ``LlamaRMSNorm``) with a 1-D affine ``weight``."""
    if not (isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1


def _mx_norm_class(base: type) -> type:
    if base not in _NORM_CLASSES:
        # new_class picks the metaclass that fits both bases (DualPathModule's ABCMeta and the norm's)
        _NORM_CLASSES[base] = types.new_class(
            f"MX{base.__name__}", (MXNormMixin, base), exec_body=lambda ns: ns.update(__module__=__name__, _mx_base=base)
        )
    return _NORM_CLASSES[base]


def _unpickle_mx_norm(base: type, state: dict) -> nn.Module:
    norm = base.__new__(base)
    norm.__dict__.update(state)
    norm.__class__ = _mx_norm_class(base)
    return norm


def _convert_norm(norm: nn.Module, fmt: str, block_size: int) -> nn.Module:
    if not isinstance(norm, MXNormMixin):
        norm.__class__ = _mx_norm_class(type(norm))
        norm.recovery = False
    norm.mx_fmt = fmt
    norm.mx_block_size = block_size
    return norm


def _is_peft_model(model: nn.Module) -> bool:
    if hasattr(model, "peft_config"):
        return True
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


def prepare_mx(
    model: nn.Module,
    fmt: str = "mxfp8_e4m3",
    units: UnitSpec = None,
    block_size: int = 32,
    quantize_norms: bool = False,
    backward_fmt: str | None = None,
    emulate_bf16: bool = False,
) -> nn.Module:
    """Give every ``nn.Linear`` inside every unit an MX low path and a BF16 recovery path, in place.

    For plain models being trained from scratch (the MX stress bench). Linears outside the units
    (an LM head, an input projection) are left as they are. Calling it again re-configures the
    converted modules (format, block size) and keeps their current path.

    Args:
        model: a plain ``nn.Module`` (not PEFT-wrapped); modified in place.
        fmt: the forward MX element format, one of :data:`MX_FORMATS`.
        units: the unit specification of :func:`gnmr_hf.units.resolve_units`: None for the decoder
            layers (also any ``nn.ModuleList`` named ``blocks``/``layers``/``h``), a list of module
            names, or a callable ``model -> [(name, module)]``.
        block_size: values per shared scale (32 in OCP MX v1.0).
        quantize_norms: also fake-quantise the affine weight of the LayerNorm/RMSNorm layers inside
            the units on the low path (:class:`MXNormMixin`).
        backward_fmt: the element format of the backward GEMM operands; None means ``fmt``.
        emulate_bf16: run the recovery path's GEMMs in float32 on BF16-rounded operands, with
            BF16-rounded outputs (see :class:`MXLinear`); use it on CPUs without BF16 matrix units.

    Returns:
        ``model``, with the units on the low path; switch them with
        :func:`gnmr_hf.backends.base.set_active_units` (same ``units``).

    Raises:
        ValueError: for an unknown format, a PEFT-wrapped model, a non-plain linear inside a unit
            (quantised, LoRA or another backend's dual path), or units with no linear at all.
    """
    fmt = mx_format(fmt).name
    backward_fmt = mx_format(backward_fmt, "backward_fmt").name if backward_fmt is not None else fmt
    _check_block_size(block_size)
    if _is_peft_model(model):
        raise ValueError(
            "prepare_mx is for plain models trained from scratch; got a PEFT-wrapped model. Apply it to the "
            "base model before any adapter, or use prepare_dual_path for LoRA fine-tuning."
        )
    resolved = resolve_units(model, units)
    linears: list[tuple[str, nn.Linear]] = []
    norms: list[nn.Module] = []
    seen: set[int] = set()
    for unit_name, unit in resolved:
        for rel, mod in unit.named_modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            fqn = f"{unit_name}.{rel}" if rel else unit_name
            if isinstance(mod, nn.Linear):
                if type(mod) is not nn.Linear and not isinstance(mod, MXLinear):
                    raise ValueError(
                        f"{fqn} is a {type(mod).__name__}, not a plain nn.Linear; prepare_mx converts only "
                        "plain linears (quantised, LoRA or other dual-path linears cannot take an MX path)"
                    )
                linears.append((fqn, mod))
            elif quantize_norms and is_norm(mod):
                norms.append(mod)
    if not linears:
        raise ValueError(f"prepare_mx found no nn.Linear inside the units {[n for n, _ in resolved][:4]}...")
    for _, lin in linears:
        MXLinear.convert(lin, fmt=fmt, block_size=block_size, backward_fmt=backward_fmt, emulate_bf16=emulate_bf16)
    for norm in norms:
        _convert_norm(norm, fmt, block_size)
    return model


def mx_modules(model: nn.Module) -> list[nn.Module]:
    """The MX dual-path modules (linears and norms) of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (MXLinear, MXNormMixin))]
