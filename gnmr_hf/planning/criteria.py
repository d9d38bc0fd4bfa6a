"""The criteria: one function each, registered with the score names it produces (:data:`CRITERIA`).

A new criterion is one function plus one line in :data:`REGISTRY` (its name, the function, the score names
it produces); the function takes ``(model, units, batches, weights, progress, seen_low)`` and returns
``({score: [per unit]}, cost)``, or a string saying why it cannot run on this model (the profile then skips
it with a warning). ``seen_low`` maps a batch index to its all-low loss, for a criterion that runs that
forward anyway (the reference then does not run it again). A criterion compares each unit's low path with
its high path (``_set_path``, ``_high_output``); :func:`gnmr_hf.planning.make.make_plan` runs it once per
rung of a ladder or INT4 plan with the rung's weight standing in for the high path
(:mod:`gnmr_hf.planning.rung_criteria`), so an entry added here (even at run time, from a test) serves the
BF16-only, ladder and INT4 plans alike: :data:`CRITERIA`, :data:`SCORE_NAMES` and the runners are read from
:data:`REGISTRY` on every use (docs/criteria.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gnmr_hf.core.oracle import recovery_gap_from_sq_norms
from gnmr_hf.planning.passes import (
    _cost,
    _device,
    _high_output,
    _input_grad,
    _loss,
    _Meter,
    _progress,
    _set_path,
    _skip_layers,
)
from gnmr_hf.units import find_decoder_layers, unwrap_model

# ------------------------------------------------------------------------------------------ criteria


def _reference(model, units, batches, weights, seen_low: dict[int, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """L_low and L_high per batch; L_low is taken from a criterion's forward at the low point when one ran."""
    forwards = 0
    with _Meter(_device(model)) as meter, torch.no_grad():
        _set_path(units, [])
        low = []
        for i, b in enumerate(batches):
            if i not in seen_low:
                seen_low[i] = float(_loss(model, b))
                forwards += 1
            low.append(seen_low[i])
        _set_path(units, range(len(units)))
        high = [float(_loss(model, b)) for b in batches]
        forwards += len(batches)
        _set_path(units, [])
    losses = {"low": sum(w * v for w, v in zip(weights, low)), "high": sum(w * v for w, v in zip(weights, high)),
              "low_per_batch": low, "high_per_batch": high}
    note = "L_low from a criterion's own forward at the low point" if forwards < 2 * len(batches) else ""
    return losses, _cost(meter, forwards, 0, note)


def _store(cache: dict[int, Any], i: int):
    def hook(mod: nn.Module, inp: Any, out: Any) -> None:
        cache[i] = out
    return hook


def _loss_gains(model, units, batches, weights, progress, seen_low) -> tuple[dict[str, list[float]], dict[str, Any]]:
    try:
        layers = [layer for _, layer in find_decoder_layers(model)]
    except ValueError:
        layers = []
    gains = [0.0] * len(units)
    forwards = 0
    with _Meter(_device(model)) as meter, torch.no_grad():
        bar = _progress(range(len(batches) * len(units)), len(batches) * len(units), "profile: loss", progress)
        it = iter(bar)
        for i, (b, w) in enumerate(zip(batches, weights)):
            cache: dict[int, Any] = {}
            handles = [layer.register_forward_hook(_store(cache, i)) for i, layer in enumerate(layers)]
            _set_path(units, [])
            try:
                low = float(_loss(model, b))
            finally:
                for h in handles:
                    h.remove()
            forwards += 1
            seen_low[i] = low
            for u, unit in enumerate(units):
                next(it, None)
                if not unit.dual:
                    continue
                _set_path(units, [u])
                below = unit.layer if unit.layer is not None and len(cache) == len(layers) else 0
                with _skip_layers(layers, below, cache):
                    gains[u] += w * (low - float(_loss(model, b)))
                forwards += 1
            _set_path(units, [])
        if hasattr(bar, "close"):
            bar.close()
    note = "per unit, the decoder layers below it are not recomputed (their outputs come from the all-low forward)"
    return {"loss": gains}, _cost(meter, forwards, 0, note)


def _output_errors(model, units, batches, weights, progress, seen_low) -> tuple[dict[str, list[float]], dict[str, Any]]:
    err = [0.0] * len(units)
    ref = [0.0] * len(units)
    mask: dict[str, torch.Tensor | None] = {"m": None}

    def hook(u):
        def fn(mod, inp, out):
            x = inp[0]
            y_high = _high_output(mod, x)
            d = (y_high.float() - out.float())
            yh = y_high.float()
            m = mask["m"]
            if m is not None and d.dim() >= 2 and tuple(d.shape[:2]) == tuple(m.shape):
                keep = m.to(d.dtype).unsqueeze(-1)
                d, yh = d * keep, yh * keep
            err[u] += float(d.double().square().sum())
            ref[u] += float(yh.double().square().sum())
        return fn

    handles = [m.register_forward_hook(hook(u)) for u, unit in enumerate(units) for m in unit.dual]
    try:
        with _Meter(_device(model)) as meter, torch.no_grad():
            _set_path(units, [])
            for i, b in enumerate(_progress(batches, len(batches), "profile: output", progress)):
                mask["m"] = b.get("attention_mask")
                seen_low[i] = float(_loss(model, b))
    finally:
        for h in handles:
            h.remove()
    rel = [e / r if r > 0 else (0.0 if e == 0 else math.inf) for e, r in zip(err, ref)]
    return {"output": [math.sqrt(e) for e in err], "output_rel": rel}, _cost(meter, len(batches), 0)


def _first_order(model, units, batches, weights, progress, seen_low) -> tuple[dict[str, list[float]], dict[str, Any]]:
    acc = [0.0] * len(units)

    def hook(u):
        def fn(mod, inp, out):
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                return
            with torch.no_grad():  # kept in the compute dtype until the backward reaches this output
                d = _high_output(mod, inp[0].detach()) - out.detach()

            def on_grad(g, d=d):
                acc[u] -= float((g * d).sum(dtype=torch.float64))

            out.register_hook(on_grad)
        return fn

    handles = [m.register_forward_hook(hook(u)) for u, unit in enumerate(units) for m in unit.dual]
    try:
        with _Meter(_device(model)) as meter, _input_grad(model), torch.enable_grad():
            _set_path(units, [])
            for i, (b, w) in enumerate(zip(_progress(batches, len(batches), "profile: first_order", progress), weights)):
                loss = _loss(model, b)
                seen_low[i] = float(loss.detach())
                (loss * w).backward()
    finally:
        for h in handles:
            h.remove()
    return {"first_order": acc}, _cost(meter, len(batches), len(batches))


def _lora_grads(model, units, batches, weights, progress, seen_low) -> tuple[dict[str, list[float]], dict[str, Any]] | str:
    params = [[p for p in unit.module.parameters() if p.requires_grad] for unit in units]
    if not any(params):
        return ("lora_grad needs a LoRA-wrapped model (the units hold no trainable parameter): wrap it with "
                "peft.get_peft_model(model, LoraConfig(...)) after prepare_dual_path")
    everything = [p for p in model.parameters() if p.requires_grad]
    saved = [(p, p.grad) for p in everything]
    grads: list[list[list[torch.Tensor | None]]] = []
    try:
        with _Meter(_device(model)) as meter, torch.enable_grad():
            for path in ([], range(len(units))):
                for p in everything:
                    p.grad = None
                _set_path(units, path)
                for b, w in zip(_progress(batches, len(batches), "profile: lora_grad", progress), weights):
                    (_loss(model, b) * w).backward()
                grads.append([[None if p.grad is None else p.grad.detach().to(torch.float64).clone() for p in ps]
                              for ps in params])
            _set_path(units, [])
    finally:
        for p, g in saved:
            p.grad = g
    diff_sq, high_sq = [], []
    for low, high in zip(*grads):
        d = h = 0.0
        for lo, hi in zip(low, high):
            lo = torch.zeros(()) if lo is None else lo
            hi = torch.zeros(()) if hi is None else hi
            d += float((hi - lo).square().sum())
            h += float(hi.square().sum())
        diff_sq.append(d)
        high_sq.append(h)
    rel = recovery_gap_from_sq_norms(torch.tensor(diff_sq), torch.tensor(high_sq)).tolist()
    return {"lora_grad": [math.sqrt(d) for d in diff_sq], "lora_grad_rel": rel}, _cost(
        meter, 2 * len(batches), 2 * len(batches))


def _weight_error(model, units, batches, weights, progress, seen_low) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """``||W_high - W_low||_F^2`` of each unit's linears, without data: each linear's two paths applied to the
    identity (rows of ``I``: ``y = I W^T + b``, the bias cancels in the difference), so that the low weight is
    what the backend really computes with. Planned greedily by score per byte it is "weight error per byte",
    the data-free ranking a profile of real batches has to beat."""
    err = [0.0] * len(units)
    forwards = 0
    dtype = unwrap_model(model).get_input_embeddings().weight.dtype  # what the linears' inputs arrive in
    with _Meter(_device(model)) as meter, torch.no_grad():
        _set_path(units, [])
        for u, unit in enumerate(_progress(units, len(units), "profile: weight_error", progress)):
            for m in unit.dual:
                n = int(m.in_features)
                for start in range(0, n, 1024):  # identity rows in blocks: one block's outputs at a time
                    eye = torch.zeros(min(1024, n - start), n, dtype=dtype, device=_device(model))
                    eye[torch.arange(eye.shape[0]), torch.arange(start, start + eye.shape[0])] = 1
                    d = _high_output(m, eye).double() - m.forward(eye).double()
                    err[u] += float(d.square().sum())
                    forwards += 1
    return {"weight_error": err}, _cost(meter, 0, 0, f"no data: {forwards} identity blocks through both paths")


# criterion -> (its function, the score names it produces): a new criterion is one function and one line here
REGISTRY: dict[str, tuple[Any, tuple[str, ...]]] = {
    "loss": (_loss_gains, ("loss",)),
    "first_order": (_first_order, ("first_order",)),
    "output": (_output_errors, ("output", "output_rel")),
    "lora_grad": (_lora_grads, ("lora_grad", "lora_grad_rel")),
    "weight_error": (_weight_error, ("weight_error",)),
}


class _RegistryView(Mapping):
    """One column of :data:`REGISTRY` as a read-only mapping, read at each use (an entry added later is in it)."""

    def __init__(self, column: int):
        self._column = column

    def __getitem__(self, name: str) -> Any:
        return REGISTRY[name][self._column]

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


class _ScoreNames(Sequence):
    """Every registered criterion's score names, in registry order, read at each use."""

    def _names(self) -> tuple[str, ...]:
        return tuple(s for _, scores in REGISTRY.values() for s in scores)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


CRITERIA: Mapping[str, tuple[str, ...]] = _RegistryView(1)  # criterion -> the score names it produces
_RUNNERS: Mapping[str, Any] = _RegistryView(0)  # criterion -> its function
SCORE_NAMES: Sequence[str] = _ScoreNames()
GAIN_SCORES = ("loss", "first_order")  # scores in loss units: their sum over a set is a predicted gain
# the cheapest criterion that chose as well as "loss" on SmolLM2 NF4 (bench/value/profile_criteria.py, docs/profile.md)
DEFAULT_CRITERION = "first_order"


def unknown_criterion(criterion: str) -> str | None:
    """Why ``criterion`` is neither a registered criterion nor one's score (one line naming the registered
    criteria); None when it is one."""
    if criterion in REGISTRY or criterion in SCORE_NAMES:
        return None
    return f"unknown criterion {criterion!r}: one of {', '.join(REGISTRY)}"


def gain_score(criterion: str) -> tuple[str, str]:
    """``(the registered criterion, the score a plan is chosen by)`` for ``criterion``, a criterion (its score of
    the same name, else its first) or one of a criterion's scores (``output_rel``: ``("output", "output_rel")``)."""
    if criterion in REGISTRY:
        scores = REGISTRY[criterion][1]
        return criterion, criterion if criterion in scores else scores[0]
    return next((c, criterion) for c, (_, scores) in REGISTRY.items() if criterion in scores)


def _criteria(criteria: str | Sequence[str]) -> list[str]:
    if isinstance(criteria, str):
        criteria = [c.strip() for c in criteria.split(",") if c.strip()]
    if list(criteria) == ["all"]:
        return list(CRITERIA)
    out = []
    for c in criteria:
        if c not in CRITERIA:
            raise ValueError(f"unknown criterion {c!r}; choose from {', '.join(CRITERIA)} (or 'all')")
        if c not in out:
            out.append(c)
    if not out:
        raise ValueError("criteria is empty")
    return out


