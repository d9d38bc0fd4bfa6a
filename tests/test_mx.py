"""The MX (OCP Microscaling) low path: fake quantisation, the dual-path MX linear and prepare_mx."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gnmr_hf.backends.base import (
    DualPathModule,
    active_units,
    recoverable_units,
    recovery_device_bytes,
    set_active_units,
)
from gnmr_hf.backends.mx import (
    MX_FORMATS,
    MXLinear,
    MXNormMixin,
    mx_clamp_fraction,
    mx_fake_quantize,
    mx_modules,
    prepare_mx,
)

FORMATS = sorted(MX_FORMATS)


def _q(values, fmt, block_size=32):
    return mx_fake_quantize(torch.tensor(values, dtype=torch.float32), fmt, block_size).tolist()


# ---------------------------------------------------------------------------------------------------
# element formats against values worked out by hand; in every block below the maximum's
# floor(log2) equals the format's emax, so the shared scale is 2^0 = 1 and the elements are read
# directly off the element grid


def test_mx_fp4_e2m1_grid_ties_and_clamp_by_hand():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert _q(grid + [-g for g in grid], "mxfp4_e2m1") == grid + [-g for g in grid]  # the grid is fixed
    # ties go to the even code: 5 -> 4 (not 6), 2.5 -> 2, 3.5 -> 4, 1.25 -> 1, 1.75 -> 2, 0.75 -> 1
    # (0.5 is the odd subnormal code), 0.25 -> 0; 7 saturates at 6; 0.3 -> 0.5, 2.7 -> 3
    got = _q([5.0, 2.5, 3.5, 1.25, 1.75, 0.75, 0.25, 7.0, 0.3, 2.7, -5.0, -0.75], "mxfp4_e2m1")
    assert got == [4.0, 2.0, 4.0, 1.0, 2.0, 1.0, 0.0, 6.0, 0.5, 3.0, -4.0, -1.0]


def test_mx_fp6_e2m3_by_hand():
    # spacing 0.5 in [4, 8), 0.125 for the subnormals below 1; largest normal 7.5
    got = _q([7.9, 7.8, 4.25, 4.75, 0.1875, 0.0625, 0.8125, 1.0625, -6.2], "mxfp6_e2m3")
    assert got == [7.5, 7.5, 4.0, 5.0, 0.25, 0.0, 0.75, 1.0, -6.0]


def test_mx_fp6_e3m2_by_hand():
    # max 30 -> floor(log2) = 4 = emax; spacing 2 in [8, 16); subnormal spacing 2^-4; largest normal 28
    got = _q([30.0, 16.0, 9.0, 11.0, 0.09375, 0.03125, 0.21875, 29.0], "mxfp6_e3m2")
    assert got == [28.0, 16.0, 8.0, 12.0, 0.125, 0.0, 0.25, 28.0]


def test_mx_fp8_e4m3_by_hand():
    # max 480 -> scale 1; spacing 32 in [256, 512), 2 in [16, 32), 2^-5 in [0.25, 0.5), 2^-9 subnormal
    got = _q([480.0, 470.0, 300.0, 17.0, 19.0, -0.3, 2**-9, 3 * 2**-10, 2**-10, 1.2 * 2**-10], "mxfp8_e4m3")
    assert got == [448.0, 448.0, 288.0, 16.0, 20.0, -0.3125, 2**-9, 2**-8, 0.0, 2**-9]


def test_mx_fp8_e5m2_by_hand():
    # max 60000 -> floor(log2) = 15 = emax; spacing 8192 in [32768, 65536); subnormal spacing 2^-16
    got = _q([60000.0, 40000.0, 4.5, 5.5, 2**-16, 3 * 2**-17, 2**-17], "mxfp8_e5m2")
    assert got == [57344.0, 40960.0, 4.0, 6.0, 2**-16, 2**-15, 0.0]


def _grid_from_codes(ebits: int, mbits: int, max_normal: float) -> list[tuple[float, int]]:
    """Every non-negative element value with its mantissa code, from the bit-level definition."""
    bias = 2 ** (ebits - 1) - 1
    out = []
    for e in range(2**ebits):
        for m in range(2**mbits):
            v = (m / 2**mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
            if v <= max_normal:  # above it: the Inf/NaN codes of E4M3/E5M2
                out.append((v, m))
    return sorted(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_grid_and_round_half_even_from_the_codes(fmt):
    spec = MX_FORMATS[fmt]
    grid = _grid_from_codes(spec.ebits, spec.mbits, spec.max_normal)
    # non-negative codes: 8 (FP4), 32 (FP6), 128 less E4M3's NaN, 128 less E5M2's Inf and 3 NaNs
    sizes = {"mxfp4_e2m1": 8, "mxfp6_e2m3": 32, "mxfp6_e3m2": 32, "mxfp8_e4m3": 127, "mxfp8_e5m2": 124}
    assert len(grid) == sizes[fmt] and grid[-1][0] == spec.max_normal
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    values, expected = [], []
    for (a, ma), (b, _) in zip(grid, grid[1:]):
        mid = (a + b) / 2  # exact in float32: at most 5 significant bits
        below = torch.nextafter(f32(mid), f32(-math.inf)).item()  # one float32 ulp either side
        above = torch.nextafter(f32(mid), f32(math.inf)).item()
        values += [a, mid, below, above, -mid]
        even = a if ma % 2 == 0 else b  # the tie goes to the even mantissa code
        expected += [a, even, a, b, -even]
    values += [spec.max_normal * 1.01, -spec.max_normal * 1.01]  # still in the top binade: saturates
    expected += [spec.max_normal, -spec.max_normal]
    # blocks of 2 whose first value 2^emax fixes the shared scale at 2^0, so the second is read off the grid
    x = torch.tensor([[2.0**spec.emax, v] for v in values], dtype=torch.float32)
    q = mx_fake_quantize(x, fmt, block_size=2)
    assert torch.all(q[:, 0] == 2.0**spec.emax)
    assert q[:, 1].tolist() == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_shared_scale_is_power_of_two_of_block_max(fmt):
    # scaling a block by 2^k scales its quantised values by exactly 2^k (while E8M0 does not clamp)
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    q = mx_fake_quantize(x, fmt)
    assert not torch.equal(q, x)
    for k in (-40, -3, 5, 60):
        assert torch.equal(mx_fake_quantize(x * 2.0**k, fmt), q * 2.0**k)
    # the scale follows the block maximum: 2^(floor(log2 max) - emax); the maximum lands in the top
    # binade [2^emax, 2^(emax+1)), so |q| / scale of every maximum is at least 2^emax
    spec = MX_FORMATS[fmt]
    amax = x.reshape(4, 2, 32).abs().amax(-1)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - spec.emax)
    qmax = q.reshape(4, 2, 32).abs().amax(-1)
    assert torch.all(qmax / scale >= 2**spec.emax) and torch.all(qmax / scale <= spec.max_normal)


def test_mx_e8m0_scale_exponent_clamped_at_minus_127():
    # block max 2^-126 in FP4 E2M1 wants scale 2^(-126 - 2) = 2^-128; E8M0 clamps it to 2^-127, which
    # puts 2^-129 at 0.25 -> 0. Shifted up by 2^10 the scale is free and 2^-119 survives (0.5 * 2^-118)
    assert _q([2**-126, 2**-129], "mxfp4_e2m1") == [2**-126, 0.0]
    assert _q([2**-116, 2**-119], "mxfp4_e2m1") == [2**-116, 2**-119]


def test_mx_zero_block_ragged_block_and_block_boundaries():
    x = torch.zeros(2, 70)
    x[1, 0] = 1000.0  # block 0 of row 1 only
    x[1, 64:67] = torch.tensor([5.0, 2.5, 0.2])  # the ragged third block (6 values), max 5 -> scale 1
    q = mx_fake_quantize(x, "mxfp4_e2m1")
    assert torch.equal(q[0], torch.zeros(70))  # all-zero blocks stay exactly zero (no NaN)
    assert q[1, 64:67].tolist() == [4.0, 2.0, 0.0]  # unaffected by the 1000 in another block
    assert q[1, 0].item() == 768.0  # scale 2^(9 - 2) = 128; 1000 / 128 = 7.8 saturates at 6
    # each block is quantised on its own: equal to quantising the pieces separately
    for lo, hi in ((0, 32), (32, 64), (64, 70)):
        assert torch.equal(q[:, lo:hi], mx_fake_quantize(x[:, lo:hi], "mxfp4_e2m1"))


def test_mx_non_finite_block_becomes_nan_others_untouched():
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    x[0, 3] = math.nan
    x[1, 40] = math.inf
    q = mx_fake_quantize(x, "mxfp8_e4m3")
    assert torch.isnan(q[0, :32]).all() and torch.isnan(q[1, 32:]).all()
    ref = mx_fake_quantize(x[2:], "mxfp8_e4m3")
    assert torch.equal(q[2], ref[0]) and torch.isfinite(q[0, 32:]).all() and torch.isfinite(q[1, :32]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_mx_keeps_dtype_and_shape(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, dtype=dtype)
    q = mx_fake_quantize(x, "mxfp6_e3m2")
    assert q.dtype == dtype and q.shape == x.shape and not q.requires_grad
    assert torch.equal(q.float(), mx_fake_quantize(x.float(), "mxfp6_e3m2"))


def test_mx_layouts_scalar_and_empty():
    torch.manual_seed(0)
    w = torch.randn(40, 48)
    # blocks follow the last dimension of the tensor as given, strided or not
    assert torch.equal(mx_fake_quantize(w.t(), "mxfp6_e2m3"), mx_fake_quantize(w.t().contiguous(), "mxfp6_e2m3"))
    assert not torch.equal(mx_fake_quantize(w.t(), "mxfp6_e2m3"), mx_fake_quantize(w, "mxfp6_e2m3").t())
    assert mx_fake_quantize(torch.tensor(5.0), "mxfp4_e2m1").item() == 4.0  # one block of one value
    assert mx_fake_quantize(torch.empty(0, 8), "mxfp4_e2m1").shape == (0, 8)


def test_mx_bad_arguments():
    with pytest.raises(ValueError, match="mxfp4_e2m1"):  # the message lists the formats
        mx_fake_quantize(torch.ones(4), "fp8")
    with pytest.raises(ValueError, match="block_size"):
        mx_fake_quantize(torch.ones(4), "mxfp8_e4m3", block_size=0)
    with pytest.raises(TypeError, match="floating"):
        mx_fake_quantize(torch.ones(4, dtype=torch.int32), "mxfp8_e4m3")


def test_mx_clamp_fraction_counts_saturated_values():
    # FP4: block max 7 -> scale 1, 7 > 6 saturates; 5.9 rounds to 6 but is not above the top level
    x = torch.tensor([[7.0, 5.9, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert mx_clamp_fraction(x, "mxfp4_e2m1", block_size=4) == pytest.approx(1 / 8)
    assert mx_clamp_fraction(torch.tensor([4.0, 1.0]), "mxfp4_e2m1") == 0.0


_values = st.lists(
    st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_subnormal=False, width=32), min_size=1, max_size=70
)


@settings(max_examples=60, deadline=None)
@given(values=_values, fmt=st.sampled_from(FORMATS), shift=st.integers(-20, 20))
def test_mx_properties(values, fmt, shift):
    spec = MX_FORMATS[fmt]
    x = torch.tensor(values, dtype=torch.float32)
    q = mx_fake_quantize(x, fmt)
    assert torch.isfinite(q).all()
    assert torch.equal(mx_fake_quantize(q, fmt), q)  # idempotent: the block maximum keeps its binade
    assert torch.equal(mx_fake_quantize(-x, fmt), -q)  # symmetric
    big = x.abs().max().item() >= 2.0**-60  # far from the E8M0 floor, so shifting the block is exact
    if big:
        assert torch.equal(mx_fake_quantize(x * 2.0**shift, fmt), q * 2.0**shift)
    # elementwise: monotone within a block, and within half a grid spacing of x unless saturated
    for lo in range(0, len(values), 32):
        xb, qb = x[lo:lo + 32].double(), q[lo:lo + 32].double()
        order = torch.argsort(xb)
        assert torch.all(qb[order][1:] >= qb[order][:-1])
        amax = xb.abs().max().item()
        if amax == 0:
            assert torch.all(qb == 0)
            continue
        scale = 2.0 ** max(math.floor(math.log2(amax)) - spec.emax, -127)
        for v, r in zip(xb.tolist(), qb.tolist()):
            e = max(math.floor(math.log2(abs(v) / scale)) if v else spec.emin, spec.emin)
            if abs(v) / scale <= spec.max_normal:
                assert abs(r - v) <= 0.5 * scale * 2.0 ** (e - spec.mbits)
            else:
                assert r == math.copysign(spec.max_normal * scale, v)


def _torchao():
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    return MXTensor, {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": DTYPE_FP6_E3M2,
        "mxfp6_e2m3": DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }


@pytest.mark.slow  # importing torchao takes seconds
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_torchao_bit_for_bit(fmt, dtype):
    MXTensor, elem = _torchao()
    torch.manual_seed(0)
    # rows spanning 2^-80 .. 2^80, zero blocks, an outlier that forces clamping in its block.
    # (torchao clamps the scale at 2^-126 instead of E8M0's 2^-127, so scales that small are avoided)
    x = torch.randn(64, 128) * torch.logspace(-24, 24, 64).unsqueeze(1)
    x[3, :32] = 0
    x[5, 7] = 1e4 * x[5].abs().max()
    x = x.to(dtype)
    ref = MXTensor.to_mx(x, elem[fmt], 32).dequantize(dtype)
    ours = mx_fake_quantize(x, fmt)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, x)


# ---------------------------------------------------------------------------------------------------
# MXLinear


def _linear(in_f=48, out_f=40, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def _fwd_bwd(module, x, g):
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(g)
    b = module.bias.grad.clone() if module.bias is not None else None
    return y.detach(), x.grad.clone(), module.weight.grad.clone(), b


@pytest.mark.parametrize("fmt, backward_fmt", [(f, None) for f in FORMATS] + [("mxfp8_e4m3", "mxfp8_e5m2")])
def test_mx_linear_matches_explicitly_quantised_reference(fmt, backward_fmt):
    # ragged blocks everywhere: in=48, out=40, tokens = 4 * 9 = 36 are not multiples of 32
    lin = _linear()
    plain = _fwd_bwd(lin, *_inputs())
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    mx = MXLinear.convert(lin, fmt=fmt, backward_fmt=backward_fmt)
    x, g = _inputs()
    y, gx, gw, gb = _fwd_bwd(mx, x, g)

    bf = backward_fmt or fmt
    Q = mx_fake_quantize
    x2, g2 = x.reshape(-1, 48), g.reshape(-1, 40)
    ref_y = (Q(x2, fmt) @ Q(w, fmt).t() + b).reshape(4, 9, 40)
    ref_gx = (Q(g2, bf) @ Q(w.t(), bf).t()).reshape(4, 9, 48)  # blocks along out
    ref_gw = Q(g2.t(), bf) @ Q(x2.t(), bf).t()  # blocks along the tokens
    for got, ref, was in ((y, ref_y, plain[0]), (gx, ref_gx, plain[1]), (gw, ref_gw, plain[2])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert (got - was).abs().max() > 1e-3  # the quantisation visibly changed it
    torch.testing.assert_close(gb, g2.sum(0))  # the bias gradient is not a GEMM: unquantised


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 9, 48, generator=gen), torch.randn(4, 9, 40, generator=gen)


def test_mx_linear_backward_format_is_used():
    x, g = _inputs()
    a = _fwd_bwd(MXLinear.convert(_linear(), fmt="mxfp8_e4m3"), x, g)
    b = _fwd_bwd(MXLinear.convert(_linear(), fmt="mxfp8_e4m3", backward_fmt="mxfp4_e2m1"), x, g)
    assert torch.equal(a[0], b[0])  # same forward
    assert not torch.allclose(a[1], b[1]) and not torch.allclose(a[2], b[2])


def test_mx_linear_recovery_equals_bf16_linear():
    lin = _linear()
    ref = _linear().to(torch.bfloat16)
    mx = MXLinear.convert(lin, fmt="mxfp4_e2m1")
    mx.set_recovery(True)
    x, g = _inputs()
    y, gx, gw, gb = _fwd_bwd(mx, x, g)
    ry, rgx, rgw, rgb = _fwd_bwd(ref, x.bfloat16(), g.bfloat16())
    assert y.dtype == torch.float32 and gw.dtype == torch.float32
    assert torch.equal(y, ry.float()) and torch.equal(gx, rgx.float())
    assert torch.equal(gw, rgw.float()) and torch.equal(gb, rgb.float())
    mx.set_recovery(False)
    low = _fwd_bwd(mx, x, g)
    assert (low[0] - y).abs().max() > 1e-2 and (low[2] - gw).abs().max() > 1e-2


def test_mx_linear_emulated_bf16_recovery_matches_native_bf16():
    x, g = _inputs()
    native = MXLinear.convert(_linear(), fmt="mxfp4_e2m1")
    emulated = MXLinear.convert(_linear(), fmt="mxfp4_e2m1", emulate_bf16=True)
    low = _fwd_bwd(emulated, x, g)
    for m in (native, emulated):
        m.set_recovery(True)
    a, b = _fwd_bwd(native, x, g), _fwd_bwd(emulated, x, g)
    for t_native, t_emu, t_low in zip(a, b, low):
        assert t_emu.dtype == torch.float32 and torch.isfinite(t_emu).all()
        assert torch.equal(t_emu, t_emu.bfloat16().float())  # BF16 values, as the native path gives
        # equal up to FP32 accumulation order: within 1 BF16 ulp (2^-8 relative) of the native result
        torch.testing.assert_close(t_emu, t_native, rtol=2**-7, atol=1e-6)
        assert (t_emu - t_low).abs().max() > 1e-2  # and far from the MX low path
    assert "emulate_bf16=True" in repr(emulated)


def test_mx_linear_convert_keeps_parameters_and_quantises_in_eval():
    lin = _linear(bias=False)
    weight, keys = lin.weight, set(lin.state_dict())
    mx = MXLinear.convert(lin, fmt="mxfp6_e2m3")
    assert mx is lin and isinstance(mx, nn.Linear) and isinstance(mx, DualPathModule)
    assert mx.weight is weight and set(mx.state_dict()) == keys and mx.bias is None
    assert mx.recovery is False and mx.recovery_device_bytes() == 0
    x, _ = _inputs()
    with torch.no_grad():
        y = mx(x)
    ref = mx_fake_quantize(x, "mxfp6_e2m3") @ mx_fake_quantize(weight.detach(), "mxfp6_e2m3").t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="plain nn.Linear"):
        MXLinear.convert(nn.Bilinear(2, 2, 2))


def test_mx_linear_bf16_model():
    lin = _linear().to(torch.bfloat16)
    mx = MXLinear.convert(lin)
    x, g = _inputs()
    y, gx, gw, gb = _fwd_bwd(mx, x.bfloat16(), g.bfloat16())
    assert y.dtype == gx.dtype == gw.dtype == gb.dtype == torch.bfloat16
    assert all(torch.isfinite(t).all() for t in (y, gx, gw, gb))


# ---------------------------------------------------------------------------------------------------
# prepare_mx and per-unit switching


class Block(nn.Module):
    """The MX study's residual block: ``x + fc2(gelu(fc1(LayerNorm(x))))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d: int = 32, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, d)
        with torch.no_grad():  # non-trivial norm affine weights, so their quantisation shows
            for blk in self.blocks:
                blk.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _out(model, x):
    with torch.no_grad():
        return model(x)


def test_mx_prepare_residual_mlp_switches_per_unit():
    model = ResidualMLP()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    fp32 = _out(model, x)
    prepare_mx(model, "mxfp4_e2m1")
    assert all(isinstance(m, MXLinear) for b in model.blocks for m in (b.fc1, b.fc2))
    assert type(model.head) is nn.Linear  # outside the units: untouched
    assert len(mx_modules(model)) == 6 and recoverable_units(model) == [True] * 3
    low = _out(model, x)
    assert (low - fp32).abs().max() > 1e-2

    set_active_units(model, [1])
    assert active_units(model) == [1]
    assert [(b.fc1.recovery, b.fc2.recovery) for b in model.blocks] == [(False, False), (True, True), (False, False)]
    mixed = _out(model, x)
    # reference: block 1 in BF16, blocks 0 and 2 through explicitly quantised operands
    h = x
    for i, blk in enumerate(model.blocks):
        if i == 1:
            h = h + _bf16_linear(blk.fc2, F.gelu(_bf16_linear(blk.fc1, blk.norm(h))))
        else:
            h = h + _mx_linear(blk.fc2, F.gelu(_mx_linear(blk.fc1, blk.norm(h), "mxfp4_e2m1")), "mxfp4_e2m1")
    torch.testing.assert_close(mixed, model.head(h).detach(), rtol=1e-4, atol=1e-4)
    assert (mixed - low).abs().max() > 1e-3

    set_active_units(model, [0, 1, 2])
    high = _out(model, x)
    torch.testing.assert_close(high, fp32, rtol=0.05, atol=0.05)  # BF16 everywhere: close to FP32
    assert (high - fp32).abs().max() < (low - fp32).abs().max() / 4
    assert recovery_device_bytes(model) == 0


def _bf16_linear(lin, x):
    b = lin.bias.bfloat16() if lin.bias is not None else None
    return F.linear(x.bfloat16(), lin.weight.bfloat16(), b).float()


def _mx_linear(lin, x, fmt):
    return F.linear(mx_fake_quantize(x, fmt), mx_fake_quantize(lin.weight, fmt), lin.bias)


def test_mx_prepare_units_by_name_and_callable():
    model = ResidualMLP()
    prepare_mx(model, "mxfp8_e5m2", units=["blocks.2"])
    assert isinstance(model.blocks[2].fc1, MXLinear) and type(model.blocks[0].fc1) is nn.Linear
    model2 = ResidualMLP()
    units = lambda m: [("blocks.0.fc1", m.blocks[0].fc1), ("head", m.head)]  # noqa: E731
    prepare_mx(model2, "mxfp6_e3m2", units=units, block_size=16)
    assert isinstance(model2.head, MXLinear) and model2.head.block_size == 16
    set_active_units(model2, [1], units=units)
    assert model2.head.recovery and not model2.blocks[0].fc1.recovery
    assert active_units(model2, units=units) == [1]
    # calling again re-configures and keeps the current path
    prepare_mx(model2, "mxfp4_e2m1", units=units)
    assert model2.head.fmt == "mxfp4_e2m1" and model2.head.recovery


def test_mx_quantize_norms_only_on_the_low_path():
    model = ResidualMLP()
    norm = model.blocks[0].norm
    weight, bias = norm.weight, norm.bias
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    plain = norm(x).detach()
    prepare_mx(model, "mxfp4_e2m1", quantize_norms=True)
    assert isinstance(norm, nn.LayerNorm) and isinstance(norm, MXNormMixin)
    assert norm.weight is weight and set(norm.state_dict()) == {"weight", "bias"}
    wq = mx_fake_quantize(weight.detach(), "mxfp4_e2m1")
    assert (wq - weight).abs().max() > 0.05  # the affine weight really changes in FP4

    xr = x.clone().requires_grad_(True)
    low = norm(xr)
    torch.testing.assert_close(low, F.layer_norm(x, (32,), wq, bias.detach()), rtol=1e-6, atol=1e-6)
    assert (low - plain).abs().max() > 0.05
    low.pow(2).sum().backward()
    # straight-through: the weight gets the gradient of the norm evaluated at the quantised weight
    ln = x.clone().requires_grad_(True)
    wref = wq.clone().requires_grad_(True)
    F.layer_norm(ln, (32,), wref, bias.detach()).pow(2).sum().backward()
    torch.testing.assert_close(weight.grad, wref.grad)
    torch.testing.assert_close(xr.grad, ln.grad)
    assert torch.equal(norm.weight, weight) and norm.weight is weight  # the parameter is untouched

    set_active_units(model, [0])
    assert norm.recovery and not model.blocks[1].norm.recovery
    assert torch.equal(norm(x).detach(), plain)


def test_mx_prepared_model_deepcopies_and_pickles():
    import copy
    import io

    model = prepare_mx(ResidualMLP(), "mxfp4_e2m1", quantize_norms=True)
    set_active_units(model, [1])
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert type(other.blocks[0].norm) is type(model.blocks[0].norm)
        assert active_units(other) == [1] and other.blocks[0].norm.weight is not model.blocks[0].norm.weight
        assert torch.equal(_out(other, x), _out(model, x))


def test_mx_norms_left_alone_without_quantize_norms():
    model = prepare_mx(ResidualMLP(), "mxfp8_e4m3")
    assert type(model.blocks[0].norm) is nn.LayerNorm


def test_mx_prepare_bad_input():
    with pytest.raises(ValueError, match="mxfp8_e4m3"):
        prepare_mx(ResidualMLP(), fmt="int4")
    with pytest.raises(ValueError, match="backward"):
        prepare_mx(ResidualMLP(), backward_fmt="bf16")
    with pytest.raises(ValueError, match="block_size"):
        prepare_mx(ResidualMLP(), block_size=-1)
    with pytest.raises(ValueError, match="no nn.Linear"):
        prepare_mx(ResidualMLP(), units=["blocks.0.norm"])


def test_mx_prepare_rejects_other_linears_in_a_unit():
    from gnmr_hf.backends.act_quant import ActQuantLinear

    model = ResidualMLP()
    model.blocks[1].fc1 = ActQuantLinear.from_linear(model.blocks[1].fc1)
    with pytest.raises(ValueError, match=r"blocks\.1\.fc1 is a ActQuantLinear"):
        prepare_mx(model)
    assert type(model.blocks[0].fc1) is nn.Linear  # nothing converted before the error


@pytest.mark.slow  # importing peft pulls in transformers
def test_mx_prepare_refuses_peft_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(ResidualMLP(), peft.LoraConfig(r=2, target_modules=["fc1"]))
    with pytest.raises(ValueError, match="PEFT"):
        prepare_mx(model)


@pytest.mark.slow
def test_mx_tiny_llama_switches_per_decoder_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.item(), [p.grad.clone() for p in model.model.layers.parameters()]

    fp32_loss, fp32_grads = loss_and_grads()
    prepare_mx(model, "mxfp4_e2m1", quantize_norms=True)
    layer = model.model.layers[0]
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(isinstance(getattr(layer.self_attn, n), MXLinear) for n in names)
    assert all(isinstance(getattr(layer.mlp, n), MXLinear) for n in ("gate_proj", "up_proj", "down_proj"))
    assert isinstance(layer.input_layernorm, MXNormMixin) and isinstance(layer.post_attention_layernorm, MXNormMixin)
    assert type(model.lm_head) is nn.Linear and not isinstance(model.model.norm, MXNormMixin)
    assert len(mx_modules(model)) == 3 * 9

    low_loss, low_grads = loss_and_grads()
    assert math.isfinite(low_loss) and all(torch.isfinite(g).all() for g in low_grads)
    assert low_loss != fp32_loss
    set_active_units(model, [1])
    assert active_units(model) == [1]
    assert all(m.recovery == (i == 1) for i, lyr in enumerate(model.model.layers) for m in mx_modules(lyr))
    mid_loss, _ = loss_and_grads()
    set_active_units(model, [0, 1, 2])
    high_loss, high_grads = loss_and_grads()
    assert len({low_loss, mid_loss, high_loss}) == 3
    # all layers in BF16: the gradients are far closer to FP32 than the FP4 ones
    err = lambda gs: sum((a - b).norm() ** 2 for a, b in zip(gs, fp32_grads)).sqrt()  # noqa: E731
    assert err(high_grads) < err(low_grads) / 3


@pytest.mark.slow  # 1-2 s, but the first optimizer step of a process imports torch._dynamo (~8 s)
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_mx_residual_mlp_trains_on_the_low_path(fmt):
    # a student-teacher regression: Adam on the MX low path still lowers the loss, with finite grads
    torch.manual_seed(0)
    teacher, student = nn.Linear(32, 32), ResidualMLP(d=32, depth=2, seed=1)
    prepare_mx(student, fmt, quantize_norms=True)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(40):
        x = torch.randn(64, 32, generator=gen)
        loss = F.mse_loss(student(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in student.parameters())
        opt.step()
        losses.append(loss.item())
    assert min(losses[-5:]) < 0.5 * losses[0]

