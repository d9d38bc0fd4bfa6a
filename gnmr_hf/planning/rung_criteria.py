"""Any registered criterion (:data:`gnmr_hf.planning.criteria.REGISTRY`) on every rung of a plan: the gains
:func:`gnmr_hf.planning.make.make_plan` chooses a ladder or an INT4 plan by when it is given a criterion other
than the rungs' first-order gains.

A criterion compares each planned linear's low path with its high path. Here it runs once per rung, the rung's
weight standing in for the high path, so that a linear's score on a rung is what the criterion says keeping it
on that rung is worth (``loss``: ``L_low - L(that linear alone on the rung)``, weighted by the batches' target
tokens). What stands in, per low format:

- a bitsandbytes low (``nf4``, ``fp4``, ``int8``): the model's own dual path (``prepare_dual_path(...,
  units="linears")``) with each linear's recovery weight replaced for the rung's pass by the rung's output
  over the checkpoint weight: the rung's ``module`` where it has one (INT8: a stock ``Linear8bitLt``, as the
  ladder's gains and :func:`gnmr_hf.planning.ladder.load_planned` compute it), else its ``fake_quant``; the
  BF16 rung is the dual path's own recovery weight (its scores are the BF16-only profile's);
- ``int4`` (the compressed-tensors export): the BF16 model with each decoder linear made a dual path for the
  call, its weight :func:`~gnmr_hf.planning.int4.int4_fake_quant` of its BF16 value (the served W4A16 weight),
  its high path the rung as that export serves it (INT8: :func:`~gnmr_hf.planning.int4.int8_fake_quant`, W8A16
  per channel; BF16: the weight; another registered rung: its ``fake_quant``); the weights are restored after;
- a GGUF low (``q4_0`` ...: ``gnmr-hf profile --serve gguf``): the same, each weight as the GGUF file stores it
  (:func:`~gnmr_hf.planning.gguf_plan.rung_fake_quant`: the low type, Q8_0 for INT8, BF16).

Cost: the criterion's own passes once per rung (docs/criteria.md has the table).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gnmr_hf.backends.recovery import CheckpointRecovery
from gnmr_hf.planning.criteria import REGISTRY, gain_score, unknown_criterion
from gnmr_hf.planning.gguf_plan import rung_fake_quant
from gnmr_hf.planning.int4 import int8_fake_quant, low_fake_quant
from gnmr_hf.planning.ladder import LadderUnit
from gnmr_hf.planning.passes import _prepare_batches, _set_path, _Unit, _units
from gnmr_hf.planning.plan import GGUF_LOWS, PlanError
from gnmr_hf.rungs import get_rung
from gnmr_hf.rungs.int4 import INT4_LOWS

#: the INT8 rung's outlier threshold, as the ladder's gains and load_planned use it
INT8_THRESHOLD = 6.0


class _RungSource:
    """A recovery weight standing in for one linear's during one rung's pass: the rung's weight (or module),
    built on first use and kept until the pass ends (the interface of
    :class:`gnmr_hf.backends.recovery.RecoveryWeight` that a dual-path module's forward reads)."""

    storage = "device"
    stored = None

    def __init__(self, key: str, rung: str, build: Callable[[], Any]):
        self.key, self.rung, self._build = key, rung, build
        self.value: Any = None
        self.owners: list[nn.Module] = []
        self.holders: list[nn.Module] = []

    def acquire(self, module: nn.Module, device: torch.device) -> tuple[Any, None]:
        if self.value is None:
            self.value = self._build()
        if isinstance(self.value, nn.Module):
            self.value = self.value.to(device)
        elif self.value.device != device:
            self.value = self.value.to(device)
        return self.value, None

    def release(self, module: nn.Module) -> None:
        """Kept: the criterion switches the linear on and off again within the pass."""

    def device_bytes(self, module: nn.Module) -> int:
        return 0

    def weight_bytes(self, module: nn.Module) -> int:
        return 0


class _RungLinear(CheckpointRecovery, nn.Linear):
    """A plain decoder linear made a dual path for one call: its ``weight`` the low format's (written in place
    and restored after), its recovery path a :class:`_RungSource`."""


def _rung_output(rung: str, weight: torch.Tensor) -> Any:
    """A bitsandbytes low's rung over the checkpoint ``weight``: its module, else its fake quantisation."""
    spec = get_rung(rung)
    if spec.module is not None:
        return spec.module(weight, int8_threshold=INT8_THRESHOLD)
    if spec.fake_quant is None:
        raise PlanError(f"rung {rung} has neither a module nor a fake quantisation: no criterion can score it")
    return spec.fake_quant(weight).to(weight.dtype)


def _ct_rung_weight(rung: str, bf16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The compressed-tensors export's rung over a linear's BF16 weight, in ``dtype``."""
    if rung == "bf16":
        return bf16.to(dtype)
    if rung == "int8":
        return int8_fake_quant(bf16).to(dtype)
    spec = get_rung(rung)
    if spec.fake_quant is None:
        raise PlanError(f"rung {rung} has no fake quantisation: no criterion can score it over int4")
    return spec.fake_quant(bf16).to(dtype)


@contextlib.contextmanager
def _bnb_paths(model) -> Iterator[tuple[list[_Unit], Callable[[str], None]]]:
    """The dual-path model's units, and a switch putting every linear's recovery path on a rung."""
    units = _units(model, "linears")
    for u in units:
        for m in u.dual:
            if getattr(m._gnmr_source, "index", None) is None:
                raise PlanError(f"{u.name}: its recovery path holds no checkpoint weight to put on a rung (prepare "
                                "the dual path with prepare_dual_path(..., units='linears'), recovering on BF16)")
    start = [i for i, u in enumerate(units) if any(m.recovery for m in u.dual)]
    _set_path(units, [])  # each linear leaves its own recovery weight before it gets a stand-in
    own = {id(m): m._gnmr_source for u in units for m in u.dual}

    def use(rung: str) -> None:
        _set_path(units, [])
        for u in units:
            for m in u.dual:
                src = own[id(m)]
                if rung == "bf16":
                    m._gnmr_source = src
                else:
                    def build(src=src, m=m):
                        return _rung_output(rung, src.index.read(src.key, src.dtype).to(m.weight.device))
                    m._gnmr_source = _RungSource(src.key, rung, build)

    try:
        yield units, use
    finally:
        _set_path(units, [])
        for u in units:
            for m in u.dual:
                m._gnmr_source = own[id(m)]
        _set_path(units, start)


def _int4_paths(model, linears: list[str], group_size: int,
                low: str = "int4") -> Iterator[tuple[list[_Unit], Callable[[str], None]]]:
    """The BF16 model's decoder linears as dual paths over their weights on the INT4 ``low`` (W4A16, or
    W4A16_ASYM), and the rung switch."""
    return _fake_quant_paths(model, linears, low_fake_quant(low, group_size), _ct_rung_weight)


def _gguf_paths(model, linears: list[str], low: str) -> Iterator[tuple[list[_Unit], Callable[[str], None]]]:
    """The BF16 model's decoder linears as dual paths over their GGUF ``low`` weights, and the rung switch."""
    return _fake_quant_paths(model, linears, lambda w: rung_fake_quant(w, "low", low),
                             lambda rung, bf16, dtype: rung_fake_quant(bf16, rung, low).to(dtype))


@contextlib.contextmanager
def _fake_quant_paths(model, linears: list[str], low_quant: Callable,
                      rung_weight: Callable) -> Iterator[tuple[list[_Unit], Callable[[str], None]]]:
    """The BF16 model's decoder linears as dual paths over ``low_quant`` of their BF16 weights, the high path of
    ``use(rung)`` being ``rung_weight(rung, bf16, dtype)``; everything restored on exit."""
    modules = dict(model.named_modules())
    saved = {n: (type(modules[n]), modules[n].weight.detach().clone()) for n in linears}
    converted = []
    try:
        with torch.no_grad():
            for n in linears:
                m, (_, orig) = modules[n], saved[n]
                m.weight.copy_(low_quant(orig.to(torch.bfloat16)).to(orig.dtype))
                _RungLinear.convert(m, _RungSource(n, "low", lambda: None))
                converted.append(n)
        units = _units(model, "linears")

        def use(rung: str) -> None:
            _set_path(units, [])
            for n in linears:
                orig = saved[n][1]
                modules[n]._gnmr_source = _RungSource(
                    n, rung, lambda orig=orig: rung_weight(rung, orig.to(torch.bfloat16), orig.dtype))

        yield units, use
    finally:
        with torch.no_grad():
            for n in converted:
                m = modules[n]
                m.set_recovery(False)
                for attr in ("_gnmr_source", "_gnmr_weight", "_gnmr_ready", "recovery"):
                    m.__dict__.pop(attr, None)
                m.__class__ = saved[n][0]
            for n, (_, orig) in saved.items():
                modules[n].weight.copy_(orig)


def criterion_rung_gains(model, batches, prices, criterion: str, progress: bool = False
                         ) -> tuple[list[LadderUnit], int]:
    """Each of ``prices``' linears' gain on each of its rungs by ``criterion`` (see the module docstring), and the
    batches' target tokens.

    ``model``: the dual-path model for a bitsandbytes ``prices.low``, the BF16 model (computing in its dtype)
    for ``int4``; ``prices``: :func:`gnmr_hf.planning.make.plan_prices` of it. The model's paths, weights and
    training mode are as before when this returns."""
    why = unknown_criterion(criterion)
    if why:
        raise PlanError(why)
    owner, score = gain_score(criterion)
    run = REGISTRY[owner][0]
    prepared, counts = _prepare_batches(model, batches)
    weights = [n / sum(counts) for n in counts]
    if prices.low in INT4_LOWS:
        paths = _int4_paths(model, prices.linears, prices.group_size or 128, prices.low)
    elif prices.low in GGUF_LOWS:
        paths = _gguf_paths(model, prices.linears, prices.low)
    else:
        paths = _bnb_paths(model)
    gains: dict[str, dict[str, float]] = {n: {} for n in prices.linears}
    was_training = model.training
    model.eval()
    try:
        with paths as (units, use):
            names = [n for u in units for n in u.modules]
            if names != prices.linears or any(len(u.modules) != 1 for u in units):
                raise PlanError(f"the model's {len(units)} dual-path units are not the {len(prices.linears)} planned "
                                "linears one each (prepare the dual path with units='linears')")
            seen_low: dict[int, float] = {}  # the low path is the same for every rung
            for rung in prices.rungs:
                use(rung)
                result = run(model, units, prepared, weights, progress, seen_low)
                if isinstance(result, str):
                    raise PlanError(f"criterion {criterion} cannot score the rungs: {result}")
                for n, v in zip(names, result[0][score]):
                    gains[n][rung] = float(v)
    finally:
        model.train(was_training)
    out = []
    for n in prices.linears:
        o, i = prices.shapes[n]
        out.append(LadderUnit(n, o * i, o, gains=gains[n], prices=dict(prices.prices[n])))
    return out, sum(counts)
