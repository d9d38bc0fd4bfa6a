"""``SparseLinear``: a linear layer that holds only its active weights, and its topology update.

The weight of an ``out x in`` linear is cut into blocks of ``block_size`` consecutive weights along each
row (``block_size = 1``: unstructured sparsity). Exactly ``k = round(density * n_blocks)`` blocks are
active; the layer stores them compactly:

- ``values`` (parameter, ``[k, block_size]``): the active weights, slot by slot;
- ``index`` (int32 buffer, ``[k]``): the block each slot holds (block ``j`` covers row ``j // (in / B)``,
  columns ``(j % (in / B)) * B ...``).

The forward scatters the slots into a dense weight for the GEMM and the backward gathers the weight
gradient back to ``[k, block_size]``, so the parameter's gradient (and any optimizer state shaped like
it) exists for the active blocks only. ``k`` never changes, so the parameter keeps its shape through
topology updates (optimizer state and checkpoints stay valid): an update moves slots to other blocks.

:meth:`SparseLinear.update_topology` is one dynamic-sparse-training step (SET / RigL): drop the
``n`` active blocks of smallest magnitude, regrow ``n`` inactive ones (never one just dropped) at random
(SET) or by the magnitude of the dense gradient (RigL), zero-initialised, in the dropped slots.

The layer is a :class:`~gnmr_hf.backends.base.DualPathModule`: the forward is the same on both paths;
``recovery`` tells :class:`~gnmr_hf.sparse.optim.SparseAdamW` to give this layer's regrown weights
SMET's optimizer-state warm-up (the low-cost path is the plain DST update). Only torch is imported.

Densities the block granularity cannot give: ``k`` is a whole number of blocks, so the realised density
``k / n_blocks`` is the requested one rounded to a multiple of ``1 / n_blocks``. A density that rounds to no
block at all is refused (``ValueError``); one that rounds more than :data:`DENSITY_TOLERANCE` (relative) away,
e.g. blocks as wide as the row in an 8-row linear at 0.1 (1 of 8 blocks: 0.125), is kept but warned about
(``UserWarning`` naming the density obtained): ``layer.density`` and :func:`realised_density` give it.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.units import UnitSpec, resolve_units

REGROW = ("set", "rigl")
DENSITY_TOLERANCE = 0.1  # relative gap between the requested and the realised density above which it warns


def _dense(values: torch.Tensor, index: torch.Tensor, n_blocks: int, shape: tuple[int, int]) -> torch.Tensor:
    w = values.new_zeros(n_blocks, values.shape[1])
    w.index_copy_(0, index.long(), values)
    return w.view(shape)


class _SparseLinearFn(torch.autograd.Function):
    """``F.linear`` with the weight scattered from ``values``; the weight gradient gathered back to the slots
    (and, while ``layer.capture`` holds a tensor, also added there in dense form for RigL's regrowth)."""

    @staticmethod
    def forward(ctx, x, values, index, bias, layer):  # noqa: D401 - autograd signature
        ctx.save_for_backward(x, values, index)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return F.linear(x, _dense(values, index, layer.n_blocks, (layer.out_features, layer.in_features)), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, values, index = ctx.saved_tensors
        layer = ctx.layer
        g2 = grad_out.reshape(-1, layer.out_features)
        grad_x = grad_values = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = _dense(values, index, layer.n_blocks, (layer.out_features, layer.in_features))
            grad_x = (g2 @ w).view(*grad_out.shape[:-1], layer.in_features)
        if ctx.needs_input_grad[1] or layer.capture is not None:
            gw = g2.t() @ x.reshape(-1, layer.in_features)  # [out, in], transient
            if layer.capture is not None:
                layer.capture.add_(gw.to(layer.capture.dtype))
            if ctx.needs_input_grad[1]:
                grad_values = gw.view(layer.n_blocks, -1).index_select(0, index.long())
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = g2.sum(0)
        return grad_x, grad_values, None, grad_bias, None


class SparseLinear(nn.Linear, DualPathModule):
    """An ``nn.Linear`` whose weight is sparse at an exact density, stored as its active blocks only.

    Build one with :meth:`convert` (in place from an ``nn.Linear``, keeping the dense initial values of
    the blocks it keeps) or :func:`prepare_sparse`. ``weight`` is a read-only property giving the dense
    weight (zeros outside the mask).

    Attributes:
        density: the realised density ``k / n_blocks``.
        block_size: weights per block (B).
        n_blocks: ``out_features * in_features / block_size``.
        k: active blocks (constant).
        recovery: whether the optimizer gives this layer's regrown weights SMET's warm-up.
        capture: a dense ``[out, in]`` float32 tensor the backward adds the weight gradient to (RigL), or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, density: float = 0.1,
                 block_size: int = 1, generator: torch.Generator | None = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._sparsify(density, block_size, generator)

    @classmethod
    def convert(cls, linear: nn.Linear, density: float, block_size: int = 1,
                generator: torch.Generator | None = None) -> SparseLinear:
        """Turn a plain ``nn.Linear`` into a :class:`SparseLinear` in place (its class is swapped) and return it.

        The initial mask is drawn uniformly at random (``generator``); the kept blocks keep their values.

        Raises:
            TypeError: ``linear`` is not a plain ``nn.Linear``.
            ValueError: ``density`` not in (0, 1] or too low to keep one block, ``block_size`` not a positive
                divisor of ``in_features``.

        Warns:
            UserWarning: the realised density (whole blocks) is more than :data:`DENSITY_TOLERANCE` (relative)
                off ``density``; the message gives the density obtained.
        """
        if type(linear) is not nn.Linear:
            raise TypeError(f"SparseLinear.convert needs a plain nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        try:
            linear._sparsify(density, block_size, generator)
        except ValueError:
            linear.__class__ = nn.Linear  # refused before anything changed: the plain linear it was
            raise
        return linear

    def _sparsify(self, density: float, block_size: int, generator: torch.Generator | None) -> None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
                or self.in_features % block_size:
            raise ValueError(f"block_size must be a positive divisor of in_features={self.in_features}, got {block_size!r}")
        n_blocks = self.out_features * self.in_features // block_size
        k = min(n_blocks, round(density * n_blocks))
        shape = f"{self.out_features}x{self.in_features} linear ({n_blocks} blocks of {block_size} weights)"
        if k < 1:
            raise ValueError(f"density={density!r} keeps no block of a {shape}: the lowest density it takes is one "
                             f"block, 1/{n_blocks} = {1 / n_blocks:.4g}")
        if abs(k / n_blocks - density) > DENSITY_TOLERANCE * density:
            warnings.warn(f"density={density!r} on a {shape} is {k} blocks: density {k / n_blocks:.4g} obtained "
                          f"({k / n_blocks / density - 1:+.0%}); a smaller block_size or a density near a multiple of "
                          f"1/{n_blocks} comes closer", UserWarning, stacklevel=3)
        dense = self._parameters.pop("weight").detach()
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.k = k
        self.density = self.k / self.n_blocks
        chosen = torch.randperm(self.n_blocks, generator=generator)[: self.k].sort().values.to(dense.device)
        self.values = nn.Parameter(dense.reshape(self.n_blocks, block_size).index_select(0, chosen).clone())
        self.register_buffer("index", chosen.to(torch.int32))
        self.recovery = False
        self.capture: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:  # noqa: D401 - nn.Linear's attribute
        """The dense weight ``[out, in]`` (zeros outside the mask), differentiable with respect to ``values``."""
        return _dense(self.values, self.index, self.n_blocks, (self.out_features, self.in_features))

    def block_mask(self) -> torch.Tensor:
        """Bool ``[n_blocks]``: which blocks are active."""
        mask = torch.zeros(self.n_blocks, dtype=torch.bool, device=self.index.device)
        mask[self.index.long()] = True
        return mask

    def mask(self) -> torch.Tensor:
        """Bool ``[out, in]``: which weights are active."""
        return self.block_mask().repeat_interleave(self.block_size).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SparseLinearFn.apply(x, self.values, self.index, self.bias, self)

    # DualPathModule: the path changes the optimizer's treatment of regrown weights, not the forward
    def set_recovery(self, on: bool) -> None:
        self.recovery = bool(on)

    def recovery_device_bytes(self) -> int:
        return 0

    def num_drop(self, drop_fraction: float) -> int:
        """Blocks one update drops (and regrows): ``round(drop_fraction * k)``, at most the inactive count.

        Raises:
            ValueError: ``drop_fraction`` not a number in [0, 1].
        """
        if isinstance(drop_fraction, bool) or not isinstance(drop_fraction, (int, float)) \
                or not 0 <= drop_fraction <= 1:
            raise ValueError(f"drop_fraction must be a number in [0, 1], got {drop_fraction!r}")
        return min(round(drop_fraction * self.k), self.n_blocks - self.k)

    @torch.no_grad()
    def update_topology(self, drop_fraction: float, regrow: str = "set", generator: torch.Generator | None = None,
                        grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One topology update: drop the ``num_drop`` smallest-magnitude active blocks (L1 norm of the block,
        ties by slot), regrow as many inactive blocks that were not just dropped, zero-initialised, in the same
        slots.

        Args:
            drop_fraction: share of the active blocks replaced, in [0, 1] (``ValueError`` otherwise).
            regrow: ``"set"`` (uniformly at random, ``generator``) or ``"rigl"`` (largest L1 norm of ``grad``).
            grad: the dense weight gradient ``[out, in]`` (RigL).

        Returns:
            ``(slots, dropped, grown)``: the slots changed and the block ids removed and added (int64).
        """
        if regrow not in REGROW:
            raise ValueError(f"regrow must be one of {REGROW}, got {regrow!r}")
        n = self.num_drop(drop_fraction)
        empty = torch.zeros(0, dtype=torch.long, device=self.index.device)
        if n <= 0:
            return empty, empty, empty
        score = self.values.detach().abs().float().sum(1)
        slots = torch.sort(score, stable=True).indices[:n]
        dropped = self.index[slots].long()
        candidates = torch.nonzero(~self.block_mask()).flatten()  # inactive before the drop
        if regrow == "set":
            pick = torch.randperm(len(candidates), generator=generator)[:n].to(candidates.device)
        else:
            if grad is None:
                raise ValueError("RigL regrowth needs the dense weight gradient")
            gscore = grad.detach().abs().float().reshape(self.n_blocks, -1).sum(1)[candidates]
            pick = torch.sort(gscore, descending=True, stable=True).indices[:n]
        grown = candidates[pick]
        self.index[slots] = grown.to(torch.int32)
        self.values[slots] = 0
        return slots, dropped, grown

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"density={self.density:.4g}, block_size={self.block_size}, recovery={self.recovery}")


def prepare_sparse(model: nn.Module, density: float, block_size: int = 1, units: UnitSpec = None,
                   seed: int = 0) -> nn.Module:
    """Make every plain ``nn.Linear`` inside the units a :class:`SparseLinear` at ``density``, in place.

    Linears outside the units (embeddings, the LM head) stay dense. Each layer's initial mask is drawn from
    its own generator seeded by ``seed`` and the layer's position, so the masks do not depend on call order.

    Args:
        model: a plain model (not PEFT-wrapped).
        density: the target density of every converted linear.
        block_size: weights per block (1: unstructured).
        units: the unit specification of :func:`gnmr_hf.units.resolve_units` (None: the decoder layers).
        seed: the masks' seed.

    Returns:
        ``model``.
    """
    seen: set[int] = set()
    found = []
    for unit_name, unit in resolve_units(model, units):
        for rel, mod in unit.named_modules():
            if id(mod) in seen or not isinstance(mod, nn.Linear):
                continue
            seen.add(id(mod))
            if type(mod) is not nn.Linear and not isinstance(mod, SparseLinear):
                raise ValueError(f"{unit_name}.{rel} is a {type(mod).__name__}, not a plain nn.Linear")
            found.append(mod)
    if not found:
        raise ValueError("prepare_sparse found no nn.Linear inside the units")
    for i, mod in enumerate(found):
        if not isinstance(mod, SparseLinear):
            SparseLinear.convert(mod, density, block_size, torch.Generator().manual_seed(_mix(seed, i)))
    return model


def sparse_linears(model: nn.Module) -> list[tuple[str, SparseLinear]]:
    """The :class:`SparseLinear` layers of ``model`` as ``(qualified_name, module)``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseLinear)]


def _mix(*ints: int) -> int:
    """A generator seed from integers (stable across processes, unlike ``hash``)."""
    h = 1469598103934665603
    for i in ints:
        h = ((h ^ (int(i) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def realised_density(model: nn.Module) -> float:
    """Active weights / weights over all :class:`SparseLinear` layers of ``model``."""
    layers = [m for _, m in sparse_linears(model)]
    total = sum(m.out_features * m.in_features for m in layers)
    return sum(m.k * m.block_size for m in layers) / total if total else math.nan
