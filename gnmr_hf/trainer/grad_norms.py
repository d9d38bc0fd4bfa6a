"""Per-unit gradient norms, taken in the same pass as the total norm used for clipping.

The Trainer clips with ``torch.nn.utils.clip_grad_norm_``: one ``torch._foreach_norm`` per
(device, dtype) group, the total as the 2-norm of those per-tensor norms, then one foreach multiply.
:meth:`UnitGradNorms.clip_` does exactly that (so the clipped gradients are bit-identical) and sums the
same per-tensor norms into one squared norm per unit, instead of a second pass over the gradients.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every gradient is a ``DTensor`` whose local shard is
a slice of the full gradient (``Shard`` placements on a 1-D mesh). torch's own clip then takes the norm
of each local shard (a ``_NormPartial``), reduces the stacked per-tensor squares over the mesh (an
all-reduce: ``x ** 2 -> sum -> ** 0.5``) and takes the 2-norm of the reduced per-tensor norms. The
clip here does the same arithmetic on the local shards with **one** all-reduce per step: a float64
vector holding the per-unit squared norms of the local shards and, after them, the per-tensor squares
that torch reduces (rounded in the gradients' dtype first, as torch rounds them). The unit part of the
sum is the per-unit squared norm of the full, unsharded gradient; the tensor part gives torch's total
norm (see :func:`_reduce`), so the clipped shards and the returned total (a replicated ``DTensor``, as
torch returns it) are those of ``torch.nn.utils.clip_grad_norm_`` on the same ``DTensor`` gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from gnmr_hf.units import Unit

_HALF = (torch.float16, torch.bfloat16)


class UnitGradNorms:
    """The trainable parameters of each unit, and their per-unit gradient norms.

    A parameter that belongs to several (nested or overlapping) units counts in each of them.

    Args:
        units: ``(name, module)`` pairs (see :func:`gnmr_hf.units.resolve_units`).

    Attributes:
        params: the distinct trainable parameters of all units, in first-seen order.
        counts: the number of trainable parameters of each unit.
        num_units: ``len(units)``.
    """

    def __init__(self, units: Sequence[Unit]) -> None:
        self.params: list[torch.nn.Parameter] = []
        position: dict[int, int] = {}
        pairs: list[tuple[int, int]] = []  # (index in self.params, unit)
        self.counts = [0] * len(units)
        for b, (_, module) in enumerate(units):
            for p in module.parameters():
                if not p.requires_grad:
                    continue
                i = position.setdefault(id(p), len(self.params))
                if i == len(self.params):
                    self.params.append(p)
                pairs.append((i, b))
                self.counts[b] += 1
        self.num_units = len(units)
        self._position = position
        self._pairs = pairs
        self._pair_param = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        self._pair_unit = torch.tensor([b for _, b in pairs], dtype=torch.long)
        # for clip_: the index pairs against the list of gradients it was last given (cached by identity)
        self._clip_key: tuple[int, ...] | None = None
        self._clip_index: tuple[torch.Tensor, torch.Tensor] | None = None

    def grads(self) -> list[torch.Tensor | None]:
        """The ``.grad`` of every parameter in :attr:`params` (``None`` where there is none)."""
        return [p.grad for p in self.params]

    def sq_norms(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """Per-unit squared L2 norms ``[U]`` (float64, on the tensors' device) of ``tensors``.

        Args:
            tensors: one tensor per entry of :attr:`params` (``None`` counts as zero).

        Returns:
            The squared norms, or ``None`` when every entry is ``None``.
        """
        present = [(i, t) for i, t in enumerate(tensors) if t is not None]
        if not present:
            return None
        mesh, local = shards([t for _, t in present])
        device = local[0].device
        sq = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        for pos, norms in _per_tensor_norms(local, fp32_half=True):
            vals = torch.stack([n.to(device) for n in norms]).to(torch.float64).square()
            sq[torch.tensor([present[j][0] for j in pos], device=device)] = vals
        units = self._to_units(sq, self._pair_param, self._pair_unit)
        if mesh is not None:  # the local shards' squares, summed over the mesh: the full gradients' squares
            torch.distributed.all_reduce(units, group=mesh.get_group())
        return units

    @torch.no_grad()
    def clip_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)``, also returning the per-unit norms.

        One norm pass: the per-tensor norms give both the total norm (computed exactly as
        ``torch.nn.utils.get_total_norm`` does) and each unit's squared norm; then the gradients are
        scaled with ``torch.nn.utils.clip_grads_with_norm_`` (one foreach multiply, also for
        ``max_norm=inf``, which multiplies by 1.0 as the Trainer's norm-only pass does).

        Args:
            parameters: the parameters whose gradients are clipped (all of the model's, as the Trainer
                passes them); the units' parameters must be among them to be counted.
            max_norm: the clipping threshold (``inf``: measure only).

        Returns:
            ``(total_norm, unit_sq_norms)``: the pre-clip total norm (as ``clip_grad_norm_`` returns it)
            and the pre-clip per-unit squared norms ``[U]`` (float64, on the gradients' device).
        """
        parameters = list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            total = torch.tensor(0.0)
            return total, torch.zeros(self.num_units, dtype=torch.float64)
        mesh, local = shards(grads)
        first_device = local[0].device
        norms: list[torch.Tensor] = []
        sq = torch.empty(len(local), dtype=torch.float64, device=first_device)
        for (_, dtype), ([tensors], pos) in _group_tensors_by_device_and_dtype([local], with_indices=True).items():
            group = torch._foreach_norm(tensors, 2.0)
            norms.extend(group)
            # fp32 accumulation for the per-unit sums of half-precision gradients (a bf16 norm has 3 digits)
            exact = torch._foreach_norm(tensors, 2.0, dtype=torch.float32) if dtype in _HALF else group
            sq[torch.tensor(pos, device=first_device)] = torch.stack([n.to(first_device) for n in exact]).double().square()
        pair_grad, pair_unit = self._clip_pairs(parameters, first_device)
        units = self._to_units(sq, pair_grad, pair_unit)
        stacked = torch.stack([n.to(first_device) for n in norms])
        if mesh is None:
            total = torch.linalg.vector_norm(stacked, 2.0)
        else:
            units, total = _reduce(units, stacked, mesh)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total, units

    def _clip_pairs(self, parameters: list[torch.nn.Parameter], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into the list of present gradients, unit) pairs for the units' parameters."""
        key = tuple(id(p) for p in parameters if p.grad is not None)
        if key != self._clip_key or self._clip_index[0].device != device:
            at = {pid: j for j, pid in enumerate(key)}
            keep = [(at[id(self.params[i])], b) for i, b in self._pairs if id(self.params[i]) in at]
            self._clip_key = key
            self._clip_index = (
                torch.tensor([j for j, _ in keep], dtype=torch.long, device=device),
                torch.tensor([b for _, b in keep], dtype=torch.long, device=device),
            )
        return self._clip_index

    def _to_units(self, sq: torch.Tensor, pair_src: torch.Tensor, pair_unit: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.num_units, dtype=torch.float64, device=sq.device)
        return out.index_add_(0, pair_unit.to(sq.device), sq[pair_src.to(sq.device)])


def shards(tensors: Sequence[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``(mesh, local tensors)``: for FSDP2 ``DTensor`` gradients their 1-D mesh and local shards, for plain
    tensors ``(None, tensors)``.

    Raises:
        RuntimeError: a mix of ``DTensor`` and plain tensors, ``DTensor`` s on different meshes, a mesh of
            more than one dimension, or a placement other than ``Shard`` (replicated or partial values would
            be counted once per rank).
    """
    if not torch.distributed.is_available():
        return None, list(tensors)
    from torch.distributed.tensor import DTensor, Shard

    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if not dtensors:
        return None, list(tensors)
    mesh = dtensors[0].device_mesh
    if len(dtensors) != len(tensors):
        raise RuntimeError(f"GNMRCallback: {len(tensors) - len(dtensors)} of {len(tensors)} gradients are plain "
                           "tensors beside FSDP2 DTensor shards; per-unit norms need every gradient on one mesh")
    for t in dtensors:
        if t.device_mesh != mesh or mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in t.placements):
            raise RuntimeError(f"GNMRCallback: a gradient on {t.device_mesh} with placements {t.placements}; per-unit "
                               f"norms of sharded gradients need every gradient sharded (Shard) on one 1-D mesh")
    return mesh, [t.to_local() for t in dtensors]


def _reduce(units: torch.Tensor, stacked: torch.Tensor, mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-reduce over ``mesh`` of the local per-unit squared norms ``[U]`` and the per-tensor squares of
    the local norms ``stacked`` ``[P]``; returns the full per-unit squared norms and the total norm as
    ``torch.nn.utils.clip_grad_norm_`` computes it for ``DTensor`` gradients (a replicated ``DTensor``).

    torch reduces each tensor's ``_NormPartial`` norm as ``n ** 2`` summed over the ranks in ``n``'s dtype,
    then ``** 0.5``, and takes the 2-norm of those. Here ``n ** 2`` is rounded in ``n``'s dtype as torch rounds
    it and summed in float64: for two ranks the float64 sum of two fp32 (or bf16) values is exact, so
    rounding it back gives the bits of torch's fp32 (bf16) sum; with more ranks the backend's own summation
    order is not specified either, and the total may differ from torch's in the last bits.
    """
    from torch.distributed.tensor import DTensor, Replicate

    buf = torch.cat([units, (stacked ** 2.0).to(torch.float64)])
    torch.distributed.all_reduce(buf, group=mesh.get_group())
    u = len(units)
    per_tensor = buf[u:].to(stacked.dtype) ** (1.0 / 2.0)
    total = torch.linalg.vector_norm(per_tensor, 2.0)
    return buf[:u], DTensor.from_local(total, mesh, [Replicate()], run_check=False)


def _per_tensor_norms(tensors: list[torch.Tensor], fp32_half: bool) -> list[tuple[list[int], list[torch.Tensor]]]:
    """``(positions, norms)`` per (device, dtype) group of ``tensors``, one fused norm per group."""
    out = []
    for (_, dtype), ([group], pos) in _group_tensors_by_device_and_dtype([tensors], with_indices=True).items():
        if fp32_half and dtype in _HALF:
            out.append((pos, torch._foreach_norm(group, 2.0, dtype=torch.float32)))
        else:
            out.append((pos, torch._foreach_norm(group, 2.0)))
    return out


class MicroBatchNorms:
    """Per-unit squared norms of what each micro-batch of a gradient-accumulation window added.

    Call :meth:`observe` after each micro-batch's backward (the last one with ``last=True``); the
    difference to the previous snapshot is that micro-batch's contribution.

    Args:
        norms: the units' parameters.
    """

    def __init__(self, norms: UnitGradNorms) -> None:
        self.norms = norms
        self.window: list[torch.Tensor] = []
        self._snapshot: list[torch.Tensor | None] | None = None

    def observe(self, last: bool, scale: float = 1.0) -> None:
        """Add the last micro-batch's per-unit squared norms ``[U]`` (float64, CPU) to :attr:`window`.

        Args:
            last: the window's last micro-batch (the next one starts from zeroed gradients).
            scale: the loss scale the gradients are still multiplied by (fp16); the norms are divided by it.
        """
        grads = self.norms.grads()
        if self._snapshot is None:
            added = grads
        else:
            added = [g if s is None else (-s if g is None else g - s) for g, s in zip(grads, self._snapshot)]
        sq = self.norms.sq_norms(added)
        sq = torch.zeros(self.norms.num_units, dtype=torch.float64) if sq is None else sq.cpu()
        self.window.append(sq / scale**2 if scale != 1.0 else sq)
        self._snapshot = None if last else [None if g is None else g.detach().clone() for g in grads]

    def take(self) -> list[torch.Tensor]:
        """The window's norms, in micro-batch order; the window is emptied."""
        window, self.window = self.window, []
        return window
