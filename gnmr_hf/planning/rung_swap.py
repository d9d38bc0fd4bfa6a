"""A plan put on one loaded low model in place, and taken off again: the ladder table measures every row's plan
this way (:func:`gnmr_hf.planning.ladder.ladder_table`), one load for the whole table instead of one per row.

:func:`swap_rungs` replaces each planned linear of a stock-loaded low model (its ``Linear4bit`` or
``Linear8bitLt``) by the module :func:`gnmr_hf.planning.ladder.load_planned` loads for its rung, built from the
same checkpoint weight the same way: the rung's ``module`` (INT8: a stock ``Linear8bitLt`` quantised as
``load_in_8bit`` quantises) over the checkpoint weight, or, for a rung without one (BF16), a plain ``nn.Linear``
holding the checkpoint weight in the load's dtype (what ``from_pretrained`` makes of a skipped linear). Every other
module is the low model's own, which a load of the plan makes equal (the same checkpoint, quantised the same
way), so the swapped model computes what the planned load computes; tests/test_ladder.py checks it tensor for
tensor on the losses. On leaving, every original module goes back where it was.

:class:`CheckpointLinears` reads a linear's checkpoint weight when it is needed (``self[name]``) from the
safetensors headers' index, so that a swap holds only the planned linears' weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from gnmr_hf.rungs import get_rung


class CheckpointLinears:
    """Where each linear's checkpoint weight lies (file and key, read from the safetensors headers), so that the
    weights are read one at a time, when needed (``self[name]``), instead of all held at once."""

    def __init__(self, model_path: str | os.PathLike, names: list[str]):
        wanted = {f"{n}.weight": n for n in names}
        self.where: dict[str, tuple[str, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    if k in wanted:
                        self.where[wanted[k]] = (str(f), k)
                        self.shapes[wanted[k]] = tuple(fh.get_slice(k).get_shape())
        missing = sorted(set(names) - set(self.where))
        if missing:
            raise ValueError(f"{model_path} has no weight for {len(missing)} linear(s), e.g. {missing[0]}: "
                             "another checkpoint than the model's?")

    def __getitem__(self, name: str) -> torch.Tensor:
        f, k = self.where[name]
        with safe_open(f, "pt") as fh:
            return fh.get_tensor(k)


def rung_module(old: torch.nn.Module, rung: str, weight: torch.Tensor, dtype: torch.dtype,
                int8_threshold: float = 6.0) -> torch.nn.Module:
    """The module a linear ``old`` planned on ``rung`` is loaded as (see the module docstring), over its checkpoint
    ``weight``, on ``old``'s device, in ``old``'s training mode, with ``old``'s bias."""
    spec = get_rung(rung)
    device = old.weight.device
    if spec.module is not None:
        new = spec.module(weight.to(device=device), int8_threshold=int8_threshold)
    else:  # kept out of quantisation by load_planned's skip list: the checkpoint weight in the load's dtype
        new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        new.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    if old.bias is not None:
        new.bias = torch.nn.Parameter(old.bias.detach().clone(), requires_grad=False)
    return new.train(old.training)


@contextmanager
def swap_rungs(model: torch.nn.Module, weights: CheckpointLinears, rungs: Mapping[str, str], dtype: torch.dtype,
               int8_threshold: float = 6.0) -> Iterator[torch.nn.Module]:
    """``model`` with each linear of ``rungs`` (``{full name: rung}``) on its rung while the block runs; its own
    modules back in place after, also on an error. ``weights``: the checkpoint's linears (:class:`CheckpointLinears`
    over at least ``rungs``' names); ``dtype``: the dtype the model was loaded in (a BF16 rung's weight's)."""
    modules = dict(model.named_modules())
    missing = [n for n in rungs if not isinstance(modules.get(n), torch.nn.Linear)]
    if missing:
        raise ValueError(f"{len(missing)} planned name(s) are not linears of the model, e.g. {missing[0]}")
    taken: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for name, rung in rungs.items():
            parent_name, _, child = name.rpartition(".")
            parent, old = modules[parent_name], modules[name]
            setattr(parent, child, rung_module(old, rung, weights[name], dtype, int8_threshold))
            taken.append((parent, child, old))
        yield model
    finally:
        for parent, child, old in reversed(taken):
            setattr(parent, child, old)
