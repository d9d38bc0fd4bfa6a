"""Sensitivity profile of the quantised linears, and a BF16 plan for a byte budget.

Before training, a few batches of the user's own data say which quantised linears are worth keeping on
their original BF16 weights. The model is a dual-path model (:func:`gnmr_hf.prepare_dual_path`, best with
``units="linears"``: one unit per linear), optionally PEFT-wrapped. Every unit gets a score under one or
more criteria (the loss L is the mean over all target tokens of the batches; "low" = every unit on its
quantised path, "high" = on the checkpoint's BF16 weight):

==================  ========================================================================================
criterion           score of unit u (higher = more worth recovering)
==================  ========================================================================================
``loss``            the forward-loss restore gain ``L(all low) - L(u on BF16, the rest low)``: one forward per
                    unit per batch (the reference). Decoder layers below the unit are not recomputed: their
                    outputs are taken from the all-low forward of the same batch (they do not depend on u).
``first_order``     the first-order estimate of ``loss`` from one forward + backward at the low point:
                    ``-<dL/dW_u, W_high,u - W_low,u> = -sum_t delta_t . (y_high(x_t) - y_low(x_t))``, with
                    x_t the linear's input and delta_t the loss gradient at its output (hooks; no weight
                    gradient is formed, the base weights stay frozen).
``output``          the linear's output error on its real inputs, ``||(W_low - W_high) x||`` over all tokens
                    (the difference of the module's two paths on the captured input; one forward). Also
                    ``output_rel`` = ``||dW x||^2 / ||W_high x||^2``.
``lora_grad``       the oracle's quantity (:mod:`gnmr_hf.core.oracle`): ``||g_low,u - g_high,u||`` of the unit's
                    LoRA gradient, all units low vs all high (two backwards per batch; needs LoRA). Also
                    ``lora_grad_rel``, the relative recovery gap. It measures how much the *whole*
                    quantised network corrupts u's gradient, not what recovering u alone buys.
==================  ========================================================================================

``loss`` and ``first_order`` are in loss units (gains); their sums over a set are the *predicted* gain of
the set. Single gains do not add (units interact), so :func:`plan` measures the chosen set with one more
forward. A unit's ``bytes`` is the BF16 size of its weights (``out * in * 2``: what keeping it unquantised
costs); the quantised weights' BF16 bytes are the sum over all units.

Typical use::

    model = gnmr_hf.prepare_dual_path(model_4bit, recovery_source=path, units="linears", dtype=torch.float32)
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    p = gnmr_hf.plan(prof, budget_fraction=0.10, model=model, batches=batches)
    print(p.summary())
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             llm_int8_skip_modules=gnmr_hf.skip_modules(p))

``gnmr-hf profile`` (:func:`main`) does all of it from the command line, with a price table and a plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shlex
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnmr_hf.units import UnitSpec, find_decoder_layers, resolve_units, short_name, unwrap_model

__all__ = [
    "CRITERIA",
    "DEFAULT_CRITERION",
    "GAIN_SCORES",
    "PrecisionPlan",
    "SensitivityProfile",
    "UnitScore",
    "budget_error",
    "format_price_table",
    "measure_plan",
    "parse_budget",
    "plan",
    "plot_profile",
    "profile_sensitivity",
    "skip_modules",
]

# criterion -> the score names it produces
CRITERIA: dict[str, tuple[str, ...]] = {
    "loss": ("loss",),
    "first_order": ("first_order",),
    "output": ("output", "output_rel"),
    "lora_grad": ("lora_grad", "lora_grad_rel"),
}
SCORE_NAMES = tuple(s for names in CRITERIA.values() for s in names)
GAIN_SCORES = ("loss", "first_order")  # scores in loss units: their sum over a set is a predicted gain
# the cheapest criterion that chose as well as "loss" on SmolLM2 NF4 (bench/profile_criteria.py, docs/profile.md)
DEFAULT_CRITERION = "first_order"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------------- results


@dataclass
class UnitScore:
    """One unit of a profile.

    Args:
        index: the unit index (as :func:`gnmr_hf.set_active_units` counts).
        name: the readable unit name (``layers.3.self_attn.v_proj``).
        modules: the qualified names, in the unwrapped transformers model (the names ``from_pretrained``
            gives, e.g. ``model.layers.3.self_attn.v_proj``), of the quantised linears inside the unit.
        bytes: the BF16 size of those linears' weights.
        layer: the decoder layer holding the unit (None if not inside one).
        op: the operator (``v_proj``; ``layer`` for a whole decoder layer).
        scores: score name -> value.
    """

    index: int
    name: str
    modules: list[str]
    bytes: int
    layer: int | None
    op: str
    scores: dict[str, float] = field(default_factory=dict)


@dataclass
class SensitivityProfile:
    """Per-unit scores under one or more criteria, with the reference losses and each criterion's cost.

    Attributes:
        units: one :class:`UnitScore` per unit, in unit order.
        criteria: the criteria run (keys of :data:`CRITERIA`).
        losses: ``low`` and ``high`` (mean loss per target token with every unit low / high) and their
            per-batch values ``low_per_batch``, ``high_per_batch``.
        costs: per criterion (and ``reference``: the forwards for L_high, and for L_low when no criterion's own
            forward at the low point gave it): ``seconds`` (wall), ``cpu_seconds``
            (process CPU time, all threads), ``forwards``,
            ``backwards``, ``peak_mem_bytes`` (peak increase over the start), ``mem_kind``.
        batches, tokens: how many batches and target tokens the profile saw.
        keep_modules: what stock transformers keeps unquantised by default (the output embedding,
            tied weights); :func:`skip_modules` puts them in its list, since a given list replaces the default.
        skipped: criteria that could not run, with why.
    """

    units: list[UnitScore]
    criteria: list[str]
    losses: dict[str, Any]
    costs: dict[str, dict[str, Any]]
    batches: int
    tokens: int
    keep_modules: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    # -- access
    @property
    def score_names(self) -> list[str]:
        """The score names present (e.g. ``["first_order", "output", "output_rel"]``)."""
        return [s for s in SCORE_NAMES if self.units and s in self.units[0].scores]

    def scores(self, criterion: str) -> list[float]:
        """The scores of one criterion (or score name), in unit order."""
        name = self._score_name(criterion)
        return [u.scores[name] for u in self.units]

    def _score_name(self, criterion: str | None) -> str:
        name = criterion or (DEFAULT_CRITERION if DEFAULT_CRITERION in self.score_names else None)
        if name is None:
            name = self.score_names[0] if self.score_names else None
        if name is None or name not in self.score_names:
            raise ValueError(f"the profile has no scores for {criterion!r}; it has {self.score_names}"
                             + (f" (skipped: {self.skipped})" if self.skipped else ""))
        return name

    @property
    def total_bytes(self) -> int:
        """The quantised weights' BF16 bytes: the sum of every unit's ``bytes``."""
        return sum(u.bytes for u in self.units)

    @property
    def gap(self) -> float:
        """``L_low - L_high``: what putting every unit on BF16 gains."""
        return float(self.losses["low"]) - float(self.losses["high"])

    def ranking(self, criterion: str | None = None) -> list[int]:
        """Unit indices by score, highest first (ties to the lower index)."""
        s = self.scores(self._score_name(criterion))
        return sorted(range(len(s)), key=lambda i: (-s[i], i))

    # -- display
    def table(self, criterion: str | None = None, top: int | None = 20) -> str:
        """A markdown table of the units by ``criterion`` (highest first), with every score present."""
        name = self._score_name(criterion)
        order = self.ranking(name)
        if top is not None:
            order = order[:top]
        cols = self.score_names
        lines = ["| rank | unit | MiB (BF16) | " + " | ".join(cols) + " |", "|" + "---|" * (3 + len(cols))]
        for r, i in enumerate(order, 1):
            u = self.units[i]
            lines.append(f"| {r} | {u.name} | {u.bytes / 2**20:.2f} | "
                         + " | ".join(_fmt(u.scores.get(c)) for c in cols) + " |")
        head = (f"sensitivity profile: {len(self.units)} units, {self.batches} batch(es), {self.tokens} target "
                f"tokens; L_low {self.losses['low']:.4f}, L_high {self.losses['high']:.4f}; ranked by {name}")
        return head + "\n" + "\n".join(lines)

    def cost_table(self) -> str:
        """A markdown table of each criterion's cost."""
        lines = ["| criterion | seconds | CPU seconds | forwards | backwards | peak memory MiB |",
                 "|---|---|---|---|---|---|"]
        for name, c in self.costs.items():
            mem = c.get("peak_mem_bytes")
            lines.append(f"| {name} | {c['seconds']:.1f} | {_fmt(c.get('cpu_seconds'), '.1f')} | {c['forwards']} | "
                         f"{c['backwards']} | "
                         f"{'-' if mem is None else f'{mem / 2**20:.0f}'} |")
        return "\n".join(lines)

    def print_table(self, criterion: str | None = None, top: int | None = 20, file: Any = None) -> None:
        """Print :meth:`table` and :meth:`cost_table`."""
        print(self.table(criterion, top), file=file or sys.stdout)
        print(self.cost_table(), file=file or sys.stdout)

    # -- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "criteria": list(self.criteria),
            "losses": _json_safe(self.losses),
            "costs": _json_safe(self.costs),
            "batches": self.batches,
            "tokens": self.tokens,
            "total_bytes": self.total_bytes,
            "keep_modules": list(self.keep_modules),
            "skipped": dict(self.skipped),
            "meta": _json_safe(self.meta),
            "units": [{"index": u.index, "name": u.name, "modules": list(u.modules), "bytes": u.bytes,
                       "layer": u.layer, "op": u.op, "scores": _json_safe(u.scores)} for u in self.units],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityProfile:
        """Build a profile from :meth:`to_dict`'s dict (or a ``profile.json``), checked field by field.

        Raises:
            ValueError: one line naming the field: a missing key, a wrong type, a unit whose ``index`` is not its
                position in ``units`` (a deleted, duplicated or reordered unit: plans count positions), a
                string where a list of module names belongs, negative bytes, an unknown ``format``.
        """
        _check_profile_dict(data)
        units = [UnitScore(index=int(u["index"]), name=u["name"], modules=list(u["modules"]), bytes=int(u["bytes"]),
                           layer=u.get("layer"), op=u.get("op", ""),
                           scores={k: (math.nan if v is None else float(v)) for k, v in u["scores"].items()})
                 for u in data["units"]]
        return cls(units=units, criteria=list(data["criteria"]), losses=dict(data["losses"]),
                   costs=dict(data["costs"]), batches=int(data["batches"]), tokens=int(data["tokens"]),
                   keep_modules=list(data.get("keep_modules", [])), skipped=dict(data.get("skipped", {})),
                   meta=dict(data.get("meta", {})))

    def to_json(self, path: str | os.PathLike, **extra: Any) -> Path:
        """Write the profile (plus any ``extra`` top-level keys) as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.to_dict(), **_json_safe(extra)}, indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> SensitivityProfile:
        """Read a profile written by :meth:`to_json` (or ``gnmr-hf profile``'s ``profile.json``).

        Raises:
            ValueError: not JSON, or not a valid profile (one line: the file and the field; see :meth:`from_dict`).
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return _num(v, spec)


def _num(v: float, spec: str) -> str:
    """``format(v, spec)`` without a negative zero (``-0.0004`` at ``.3f`` is ``0.000``, not ``-0.000``)."""
    text = format(v, spec)
    if text.startswith("-") and not any(c in "123456789" for c in text.split("e")[0]):
        text = text[1:]
    return text


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None


def _check_profile_dict(data: Any) -> None:
    """The contract of a profile dict / ``profile.json`` (docs/profile.md): one-line ValueError naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"not a sensitivity profile: a JSON object was expected, got {type(data).__name__}")
    if "units" not in data or "losses" not in data:
        raise ValueError("not a sensitivity profile (no 'units' / 'losses')")
    fmt = data.get("format", FORMAT_VERSION)  # every profile ever written has it; a hand-built dict may not
    if fmt != FORMAT_VERSION or not _is_int(fmt):
        raise ValueError(f"format {fmt!r} is not a profile format this gnmr_hf reads (it reads {FORMAT_VERSION})")
    for key in ("criteria", "costs", "batches", "tokens"):
        if key not in data:
            raise ValueError(f"missing field {key!r} (a profile holds format, units, losses, criteria, costs, "
                             "batches, tokens)")

    def need(ok: bool, field_name: str, what: str, value: Any) -> None:
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ValueError(f"{field_name} must be {what}, got {type(value).__name__} {shown}")

    losses = data["losses"]
    need(isinstance(losses, dict), "losses", "an object with low and high", losses)
    for key in ("low", "high"):
        if key not in losses:
            raise ValueError(f"missing field 'losses.{key}'")
        need(_is_number(losses[key]) and losses[key] is not None, f"losses.{key}", "a number", losses[key])
    crit = data["criteria"]
    need(isinstance(crit, list) and all(isinstance(c, str) for c in crit), "criteria", "a list of names", crit)
    need(isinstance(data["costs"], dict), "costs", "an object", data["costs"])
    for key in ("batches", "tokens"):
        need(_is_int(data[key]) and data[key] >= 1, key, "an integer >= 1", data[key])
    for key, kind in (("keep_modules", list), ("skipped", dict), ("meta", dict)):
        if key in data:
            need(isinstance(data[key], kind), key, "a list" if kind is list else "an object", data[key])
    keep = data.get("keep_modules", [])
    need(all(isinstance(m, str) for m in keep), "keep_modules", "a list of module names", keep)
    meta = data.get("meta", {})
    for key in ("batch_tokens", "batch_digests"):
        if key in meta:
            kind = _is_int if key == "batch_tokens" else (lambda v: isinstance(v, str))
            need(isinstance(meta[key], list) and len(meta[key]) == data["batches"] and all(kind(v) for v in meta[key]),
                 f"meta.{key}", f"a list of {data['batches']} {'integers' if key == 'batch_tokens' else 'strings'}",
                 meta[key])
    units = data["units"]
    need(isinstance(units, list) and units, "units", "a non-empty list", units)
    names = None
    for i, u in enumerate(units):
        where = f"units[{i}]"
        need(isinstance(u, dict), where, "an object", u)
        for key in ("index", "name", "modules", "bytes", "scores"):
            if key not in u:
                raise ValueError(f"missing field '{where}.{key}'")
        need(_is_int(u["index"]), f"{where}.index", "an integer", u["index"])
        if u["index"] != i:
            raise ValueError(f"{where}.index is {u['index']}, not its position {i}: units must be listed in index "
                             "order, each once, none missing (plans and set_active_units count positions)")
        need(isinstance(u["name"], str), f"{where}.name", "a string", u["name"])
        need(isinstance(u["modules"], list) and all(isinstance(m, str) for m in u["modules"]), f"{where}.modules",
             "a list of module names", u["modules"])
        need(_is_int(u["bytes"]) and u["bytes"] >= 0, f"{where}.bytes", "an integer >= 0", u["bytes"])
        if u.get("layer") is not None:
            need(_is_int(u["layer"]) and u["layer"] >= 0, f"{where}.layer", "an integer >= 0 or null", u["layer"])
        if "op" in u:
            need(isinstance(u["op"], str), f"{where}.op", "a string", u["op"])
        sc = u["scores"]
        need(isinstance(sc, dict) and all(_is_number(v) for v in sc.values()), f"{where}.scores",
             "an object of score name -> number (or null)", sc)
        if names is None:
            names = set(sc)
        elif set(sc) != names:
            raise ValueError(f"{where}.scores has {sorted(sc)}, units[0].scores {sorted(names)}: every unit needs "
                             "the same scores")
    if not any(u["bytes"] > 0 for u in units):
        raise ValueError("units: every unit has 0 bytes (nothing to plan)")


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return _json_safe(x.tolist())
    return x


# ------------------------------------------------------------------------------------------ helpers


@dataclass
class _Unit:
    name: str
    module: nn.Module
    dual: list[nn.Module]  # dual-path modules inside the unit
    modules: list[str]
    bytes: int
    layer: int | None
    op: str


def _units(model: nn.Module, units: UnitSpec) -> list[_Unit]:
    from gnmr_hf.backends.base import dual_path_modules
    from gnmr_hf.backends.checkpoint import canonical_name

    resolved = resolve_units(model, units)
    base = unwrap_model(model)
    names = {id(m): canonical_name(n) for n, m in base.named_modules()}
    try:
        layer_of = {id(m): i for i, (_, layer) in enumerate(find_decoder_layers(model)) for m in layer.modules()}
    except ValueError:
        layer_of = {}
    out = []
    for name, unit in resolved:
        dual = list(dual_path_modules(unit))
        layers = [layer_of[id(m)] for m in dual if id(m) in layer_of]
        short = short_name(name)
        parts = short.split(".")
        op = parts[-1] if len(parts) > 2 else "layer"
        out.append(_Unit(name=short, module=unit, dual=dual, modules=[names.get(id(m), name) for m in dual],
                         bytes=sum(_bf16_bytes(m) for m in dual), layer=min(layers) if layers else None, op=op))
    if not any(u.dual for u in out):
        raise ValueError(
            f"the model holds no dual-path layer ({type(unwrap_model(model)).__name__}): load it quantised "
            "(BitsAndBytesConfig(load_in_4bit=True) or load_in_8bit=True) and call "
            "gnmr_hf.prepare_dual_path(model, recovery_source=checkpoint, units='linears') first"
        )
    return out


def _bf16_bytes(m: nn.Module) -> int:
    out_f, in_f = getattr(m, "out_features", None), getattr(m, "in_features", None)
    if out_f is None or in_f is None:
        w = m._gnmr_source.stored if hasattr(m, "_gnmr_source") and m._gnmr_source.stored is not None else m.weight
        out_f, in_f = w.shape[0], w.shape[-1]
    return int(out_f) * int(in_f) * 2


def _keep_modules(model: nn.Module) -> list[str]:
    """What stock transformers keeps unquantised when ``llm_int8_skip_modules`` is not given."""
    base = unwrap_model(model)
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        keys = sorted(get_keys_to_not_convert(base))
    except Exception:  # another transformers version, or not a PreTrainedModel
        keys = []
    out_emb = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if out_emb is not None:
        name = next((n for n, m in base.named_modules() if m is out_emb), None)
        if name and name not in keys:
            keys.append(name)
    return keys


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _prepare_batches(model: nn.Module, batches: Iterable[Mapping[str, Any]] | Mapping[str, Any]
                     ) -> tuple[list[dict[str, Any]], list[int]]:
    """Batches on the model's device with labels (padding -100), and each batch's target-token count.

    A batch is any mapping with ``input_ids`` (a dict, a ``BatchEncoding`` from a tokenizer or a transformers
    collator); ``batches`` is any iterable of them (a list, a ``torch.utils.data.DataLoader``: iterated once
    here), or one mapping (one batch)."""
    device = _device(model)
    if isinstance(batches, Mapping):
        batches = [batches]
    elif isinstance(batches, (str, bytes, torch.Tensor)) or not isinstance(batches, Iterable):
        raise ValueError(f"batches must be a list (or DataLoader) of batches, each a mapping with input_ids; got "
                         f"{type(batches).__name__}")
    out, counts = [], []
    for i, b in enumerate(batches):
        if not isinstance(b, Mapping) or "input_ids" not in b:
            got = type(b).__name__ if not isinstance(b, Mapping) else f"keys {sorted(map(str, b))}"
            raise ValueError(f"batch {i} must be a mapping (dict, BatchEncoding) with input_ids (and attention_mask, "
                             f"labels); got {got}")
        b = {k: (torch.as_tensor(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(b).items()}
        b = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        if b["input_ids"].dim() == 1:
            b = {k: (v.unsqueeze(0) if isinstance(v, torch.Tensor) and v.dim() == 1 else v) for k, v in b.items()}
        if "labels" not in b:
            labels = b["input_ids"].clone()
            if "attention_mask" in b:
                labels[b["attention_mask"] == 0] = -100
            b["labels"] = labels
        n = int((b["labels"][..., 1:] != -100).sum())
        if n == 0:
            raise ValueError(f"batch {i} has no target token (every label is -100)")
        b.setdefault("use_cache", False)
        out.append(b)
        counts.append(n)
    if not out:
        raise ValueError("batches is empty: give at least one batch of training data")
    return out, counts


def _batch_digest(batch: dict[str, Any]) -> str:
    """A short fingerprint of a prepared batch's ``input_ids``, ``labels`` and ``attention_mask``: which data it is."""
    import hashlib

    h = hashlib.sha256()
    for key in ("input_ids", "labels", "attention_mask"):
        v = batch.get(key)
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu", torch.int64).contiguous()
            h.update(f"{key}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def _loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def _set_path(units: list[_Unit], high: Iterable[int]) -> None:
    high = set(high)
    for i, u in enumerate(units):
        for m in u.dual:
            if m.recovery != (i in high):
                m.set_recovery(i in high)


class _Meter:
    """Wall seconds, process CPU seconds (all threads; on a busy machine the steadier figure) and peak
    memory increase of a block (CUDA allocator on a GPU, else sampled process RSS)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self.peak = None
        self.kind = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                     else "process RSS growth, sampled every 5 ms after returning freed heap to the OS")

    def __enter__(self) -> _Meter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()  # memory freed by earlier passes goes back to the OS, so RSS growth is this block's
            self._start = _rss()
            self._max = self._start
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            r = _rss()
            if r is not None and (self._max is None or r > self._max):
                self._max = r

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device) - self._start)
        else:
            self._stop.set()
            self._thread.join()
            r = _rss()
            if r is not None and self._max is not None:
                self._max = max(self._max, r)
            self.peak = None if self._start is None else int(self._max - self._start)


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _cost(meter: _Meter, forwards: int, backwards: int, note: str = "") -> dict[str, Any]:
    out = {"seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds, "forwards": forwards, "backwards": backwards, "peak_mem_bytes": meter.peak,
           "mem_kind": meter.kind}
    if note:
        out["note"] = note
    return out


def _progress(it: Iterable, total: int, desc: str, on: bool) -> Iterable:
    if not on:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, leave=False)


@contextlib.contextmanager
def _input_grad(model: nn.Module) -> Iterator[None]:
    """Freeze every parameter and make the input embeddings' output require grad, so a backward reaches
    every layer's output without forming any weight gradient."""
    base = unwrap_model(model)
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if emb is None:
        raise ValueError("first_order needs the model's input embeddings (get_input_embeddings())")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    handle = emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True))
    try:
        yield
    finally:
        handle.remove()
        for p, flag in flags:
            p.requires_grad_(flag)


def _high_output(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's recovery-path output on ``x`` (its forward called directly: no hooks run)."""
    was = m.recovery
    if not was:
        m.set_recovery(True)
    try:
        return m.forward(x)
    finally:
        if not was:
            m.set_recovery(False)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return type(x)(*(_clone(v) for v in x)) if hasattr(x, "_fields") else tuple(_clone(v) for v in x)
    return x


@contextlib.contextmanager
def _skip_layers(layers: list[nn.Module], below: int, cache: dict[int, Any]) -> Iterator[None]:
    """Layers ``0 .. below-1`` return their cached output instead of computing."""
    saved = []
    for i in range(below):
        layer = layers[i]
        saved.append((layer, layer.__dict__.get("forward")))
        layer.forward = (lambda out: (lambda *a, **k: _clone(out)))(cache[i])
    try:
        yield
    finally:
        for layer, fwd in saved:
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


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
    from gnmr_hf.core.oracle import recovery_gap_from_sq_norms

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


_RUNNERS = {"loss": _loss_gains, "output": _output_errors, "lora_grad": _lora_grads, "first_order": _first_order}


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


def profile_sensitivity(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    criteria: str | Sequence[str] = (DEFAULT_CRITERION,),
    units: UnitSpec = None,
    progress: bool = False,
) -> SensitivityProfile:
    """Score every unit of a dual-path model by how much keeping it on BF16 is worth, on ``batches``.

    Args:
        model: a model prepared with :func:`gnmr_hf.prepare_dual_path` (``units="linears"`` for one unit per
            linear), optionally PEFT-wrapped (needed for ``lora_grad``). Profiled in eval mode (dropout off);
            its training mode, its units' paths and its parameters' gradients are restored afterwards.
        batches: mappings (a dict, a ``BatchEncoding``) with ``input_ids``, ``attention_mask`` and ``labels``
            (-100 where no loss; derived from ``input_ids`` and the mask when missing), e.g. a few batches of
            the training data as the Trainer's collator makes them; a list of them, a
            ``torch.utils.data.DataLoader`` (iterated once: :func:`plan` must see the same batches again, so
            pass a list or an unshuffled loader), or one mapping. The profile records each batch's
            target-token count and fingerprint (``meta``), which :func:`plan` checks.
        criteria: names from :data:`CRITERIA` (a comma-separated string, or ``"all"``); see the module
            docstring. ``lora_grad`` on a model without trainable parameters in the units is skipped
            with a warning (and listed in ``profile.skipped``).
        units: the unit specification (default: the grain recorded by ``prepare_dual_path``).
        progress: show tqdm progress bars.

    Returns:
        A :class:`SensitivityProfile`, with the all-low and all-high losses and each criterion's cost.

    Raises:
        ValueError: no dual-path layer in the model, an unknown criterion, an empty batch list or a batch
            without target tokens.
    """
    names = _criteria(criteria)
    info = _units(model, units)
    prepared, counts = _prepare_batches(model, batches)
    total = sum(counts)
    weights = [n / total for n in counts]
    from gnmr_hf.backends.base import active_units

    resolved = [(u.name, u.module) for u in info]
    start = active_units(model, resolved)
    was_training = model.training
    model.eval()
    scores: dict[str, list[float]] = {}
    costs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    try:
        seen_low: dict[int, float] = {}  # batch -> L_low, from any criterion's forward at the low point
        for name in names:
            result = _RUNNERS[name](model, info, prepared, weights, progress, seen_low)
            if isinstance(result, str):
                warnings.warn(f"profile_sensitivity: {name} skipped: {result}", stacklevel=2)
                skipped[name] = result
                continue
            values, costs[name] = result
            scores.update(values)
        losses, costs["reference"] = _reference(model, info, prepared, weights, seen_low)
    finally:
        _set_path(info, start)
        model.train(was_training)
    out_units = [UnitScore(index=i, name=u.name, modules=u.modules, bytes=u.bytes, layer=u.layer, op=u.op,
                           scores={k: float(v[i]) for k, v in scores.items()}) for i, u in enumerate(info)]
    base = unwrap_model(model)
    meta = {"model": type(base).__name__, "name_or_path": str(getattr(getattr(base, "config", None),
                                                                      "_name_or_path", "") or ""),
            "device": str(_device(model)), "batch_tokens": counts,
            "batch_digests": [_batch_digest(b) for b in prepared]}
    return SensitivityProfile(units=out_units, criteria=[n for n in names if n not in skipped], losses=losses,
                              costs=costs, batches=len(prepared), tokens=total, keep_modules=_keep_modules(model),
                              skipped=skipped, meta=meta)


# ------------------------------------------------------------------------------------------ planning


@dataclass
class PrecisionPlan:
    """The units to keep on BF16 under a byte budget, chosen greedily by score per byte.

    Attributes:
        criterion: the score the plan was chosen by.
        budget_bytes: the extra BF16 bytes allowed; ``total_bytes`` the quantised weights' BF16 bytes.
        indices, names, modules: the chosen units (unit indices for ``set_active_units`` / a static policy,
            readable names, and the qualified names of their linears).
        bytes: the chosen units' BF16 bytes.
        predicted_gain: the sum of the chosen units' single gains (``loss`` or ``first_order`` scores; the
            criterion's own when it is a gain, else the profile's ``loss``, else ``first_order``); None
            without a gain score. ``predicted_gap_closed`` = predicted_gain / (L_low - L_high).
        measured: per data set (``profile``, ``heldout``): ``loss_low``, ``loss_high``, ``loss_plan`` and
            ``gap_closed`` = (L_low - L_plan) / (L_low - L_high), measured with the set on BF16.
        keep_modules: the profile's default-kept modules (see :func:`skip_modules`).
    """

    criterion: str
    budget_bytes: int
    total_bytes: int
    indices: list[int]
    names: list[str]
    modules: list[str]
    bytes: int
    predicted_gain: float | None
    predicted_gap_closed: float | None
    gain_score: str | None = None
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    keep_modules: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """The chosen bytes as a share of the quantised weights' BF16 bytes."""
        return self.bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def budget_fraction(self) -> float:
        return self.budget_bytes / self.total_bytes if self.total_bytes else 0.0

    def skip_modules(self, keep: Sequence[str] | None = None) -> list[str]:
        """See :func:`skip_modules`."""
        return skip_modules(self, keep)

    def summary(self) -> str:
        """A few lines: budget, chosen set, predicted and measured gap closed."""
        lines = [f"plan by {self.criterion}: {len(self.indices)} unit(s), {self.bytes / 2**20:.1f} MiB BF16 = "
                 f"{100 * self.fraction:.1f} % of the quantised weights' BF16 bytes (budget "
                 f"{self.budget_bytes / 2**20:.1f} MiB, {100 * self.budget_fraction:.1f} %)"]
        if self.predicted_gap_closed is not None:
            lines.append(f"  predicted gap closed (sum of single {self.gain_score} gains): "
                         f"{_fmt(self.predicted_gap_closed, '.3f')}")
        for where, m in self.measured.items():
            lines.append(f"  measured gap closed on {where}: {_fmt(m['gap_closed'], '.3f')} (L_low {m['loss_low']:.4f}, "
                         f"L_plan {m['loss_plan']:.4f}, L_high {m['loss_high']:.4f})")
        if self.names:
            lines.append("  units: " + ", ".join(self.names))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe({
            "criterion": self.criterion, "budget_bytes": self.budget_bytes, "budget_fraction": self.budget_fraction,
            "total_bytes": self.total_bytes, "bytes": self.bytes, "fraction": self.fraction,
            "indices": list(self.indices), "names": list(self.names), "modules": list(self.modules),
            "predicted_gain": self.predicted_gain, "predicted_gap_closed": self.predicted_gap_closed,
            "gain_score": self.gain_score, "measured": self.measured, "skip_modules": self.skip_modules(),
        })


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB" if n >= 2**10 else f"{int(n)} B"


def budget_error(sizes: Sequence[int], budget: int, names: Sequence[str] | None = None) -> str | None:
    """Why a budget of ``budget`` extra BF16 bytes cannot be planned over units of ``sizes`` bytes (None if it can):
    it buys no unit (below the smallest one), or it exceeds the quantised weights' BF16 bytes (the sum)."""
    total = sum(sizes)
    positive = [(b, i) for i, b in enumerate(sizes) if b > 0]
    if not positive:
        return "the units hold no bytes to plan"
    smallest, where = min(positive)
    unit = f" ({names[where]})" if names else ""
    bounds = (f"the smallest unit{unit} is {smallest} B ({_mib(smallest)}), all {len(sizes)} units total {total} B "
              f"({_mib(total)})")
    if budget < smallest:
        return f"budget {budget} B ({_mib(budget)}) buys no unit: {bounds}"
    if budget > total:
        return f"budget {budget} B ({_mib(budget)}) exceeds what there is to keep on BF16: {bounds}"
    return None


def _budget(profile: SensitivityProfile, budget_bytes: int | None, budget_fraction: float | None) -> int:
    if (budget_bytes is None) == (budget_fraction is None):
        raise ValueError("give exactly one of budget_bytes and budget_fraction")
    if budget_fraction is not None:
        if not (isinstance(budget_fraction, (int, float)) and not isinstance(budget_fraction, bool)
                and 0 < budget_fraction <= 1):
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        budget = int(budget_fraction * profile.total_bytes)
    else:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        budget = budget_bytes
    why = budget_error([u.bytes for u in profile.units], budget, [u.name for u in profile.units])
    if why:
        given = f"budget_fraction {budget_fraction!r}: " if budget_fraction is not None else ""
        raise ValueError(given + why)
    return budget


def _check_same_units(profile: SensitivityProfile, info: list[_Unit]) -> None:
    """The model's units must be the profile's (same count, names and bytes, in order)."""
    if len(info) != len(profile.units):
        raise ValueError(f"the model is not the profiled one: the profile has {len(profile.units)} units, the model "
                         f"{len(info)} ({type(info[0].module).__name__ if info else '-'} ...)")
    for i, (u, m) in enumerate(zip(profile.units, info)):
        if (u.name, u.bytes) != (m.name, m.bytes):
            raise ValueError(f"the model is not the profiled one: unit {i} is {u.name} ({u.bytes} B) in the profile, "
                             f"{m.name} ({m.bytes} B) in the model")


def _check_same_batches(profile: SensitivityProfile, prepared: list[dict[str, Any]], counts: list[int]) -> None:
    """``batches`` must be the profile's own (its L_low and L_high are reused): compared by fingerprint when
    the profile has them, else by target-token counts (profiles written before fingerprints were recorded)."""
    hint = ("; plan(batches=) takes the profile's own batches (its L_low and L_high are reused), other data goes "
            "in heldout= (a shuffling DataLoader gives other batches on each pass: pass a list)")
    meta = profile.meta or {}
    if len(prepared) != profile.batches:
        raise ValueError(f"batches are not the profile's: {len(prepared)} batch(es), the profile saw {profile.batches}"
                         + hint)
    digests, tokens = meta.get("batch_digests"), meta.get("batch_tokens")
    if digests is not None:
        for i, (b, d) in enumerate(zip(prepared, digests)):
            if _batch_digest(b) != d:
                raise ValueError(f"batches are not the profile's: batch {i} differs from the profiled one (token ids, "
                                 "labels or mask)" + hint)
    elif tokens is not None:
        if list(counts) != list(tokens):
            raise ValueError(f"batches are not the profile's: target tokens per batch {counts}, the profile saw "
                             f"{list(tokens)}" + hint)
    elif sum(counts) != profile.tokens:
        raise ValueError(f"batches are not the profile's: {sum(counts)} target tokens, the profile saw "
                         f"{profile.tokens}" + hint)


def greedy_select(scores: Sequence[float], sizes: Sequence[int], budget: int) -> list[int]:
    """Indices chosen greedily by score per byte (highest first, ties to the lower index), skipping
    units that no longer fit; units with a non-positive (or non-finite) score are never chosen."""
    order = sorted((i for i, s in enumerate(scores) if math.isfinite(s) and s > 0 and sizes[i] > 0),
                   key=lambda i: (-scores[i] / sizes[i], i))
    return fill_in_order(order, sizes, budget)


def fill_in_order(order: Iterable[int], sizes: Sequence[int], budget: int) -> list[int]:
    """Walk ``order`` and keep each index whose size still fits in ``budget`` (sorted result)."""
    chosen, used = [], 0
    for i in order:
        if used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen)


def plan(
    profile: SensitivityProfile,
    budget_bytes: int | None = None,
    *,
    budget_fraction: float | None = None,
    criterion: str | None = None,
    model: nn.Module | None = None,
    batches: Iterable[dict[str, Any]] | None = None,
    heldout: Iterable[dict[str, Any]] | None = None,
    heldout_reference: tuple[float, float] | None = None,
    units: UnitSpec = None,
) -> PrecisionPlan:
    """Choose the units to keep on BF16 within a byte budget, and (with ``model``) measure the choice.

    Greedy by score per BF16 byte; units with a non-positive score are never chosen, so a plan may use
    less than its budget. Single gains do not add, so the set's gain is measured: with ``model`` and
    ``batches`` (the profile's batches: the profile's L_low and L_high are reused, one forward), and
    optionally ``heldout`` batches (three forwards: low, high, the plan).

    Args:
        profile: from :func:`profile_sensitivity`.
        budget_bytes: extra BF16 bytes allowed; or ``budget_fraction``: a share of the quantised weights'
            BF16 bytes (``profile.total_bytes``). Exactly one of them.
        criterion: the score to plan by (default: :data:`DEFAULT_CRITERION` if in the profile, else the
            first present).
        model, batches, heldout, units: for the measurement (the model the profile was taken on; ``batches``
            must be the profile's own, whose L_low and L_high the profile holds). Both are checked: the model's
            units (count, names, bytes) against the profile's, the batches against the fingerprints (or, for an
            older profile, the target-token counts) the profile recorded; a mismatch is a ValueError.
        heldout_reference: ``(L_low, L_high)`` on ``heldout`` when already measured (saves two forwards).

    Returns:
        A :class:`PrecisionPlan`; :func:`skip_modules` turns it into ``llm_int8_skip_modules``.

    Raises:
        ValueError: a budget that buys no unit (below the smallest unit's bytes) or exceeds the total (the
            message gives both), ``budget_fraction`` outside (0, 1], another model or other batches.
    """
    name = profile._score_name(criterion)
    budget = _budget(profile, budget_bytes, budget_fraction)
    chosen = greedy_select(profile.scores(name), [u.bytes for u in profile.units], budget)
    gain_score = name if name in GAIN_SCORES else next((s for s in GAIN_SCORES if s in profile.score_names), None)
    predicted = None if gain_score is None else sum(profile.units[i].scores[gain_score] for i in chosen)
    gap = profile.gap
    result = PrecisionPlan(
        criterion=name, budget_bytes=budget, total_bytes=profile.total_bytes, indices=chosen,
        names=[profile.units[i].name for i in chosen],
        modules=[m for i in chosen for m in profile.units[i].modules],
        bytes=sum(profile.units[i].bytes for i in chosen), predicted_gain=predicted,
        predicted_gap_closed=None if predicted is None or gap == 0 else predicted / gap, gain_score=gain_score,
        keep_modules=list(profile.keep_modules))
    if model is not None:
        _check_same_units(profile, _units(model, units))
        if batches is not None:
            prepared, counts = _prepare_batches(model, batches)
            _check_same_batches(profile, prepared, counts)
            ref = (profile.losses["low"], profile.losses["high"])
            result.measured["profile"] = measure_plan(model, chosen, prepared, reference=ref, units=units)
        if heldout is not None:
            result.measured["heldout"] = measure_plan(model, chosen, heldout, reference=heldout_reference,
                                                      units=units)
    elif batches is not None or heldout is not None:
        raise ValueError("measuring a plan needs the model: plan(..., model=model, batches=...)")
    return result


def measure_plan(
    model: nn.Module,
    chosen: PrecisionPlan | Sequence[int],
    batches: Iterable[dict[str, Any]],
    reference: tuple[float, float] | None = None,
    units: UnitSpec = None,
) -> dict[str, float]:
    """The loss with ``chosen`` on BF16 (the rest low) and the share of the low-to-high gap it closes.

    Args:
        model: the profiled dual-path model.
        chosen: a plan or unit indices.
        batches: the data (as for :func:`profile_sensitivity`).
        reference: ``(L_low, L_high)`` on these batches when known (else two more forwards measure them).

    Returns:
        ``loss_low``, ``loss_high``, ``loss_plan``, ``gap_closed`` = (L_low - L_plan) / (L_low - L_high)
        (NaN when L_low == L_high), ``seconds``.
    """
    indices = list(chosen.indices if isinstance(chosen, PrecisionPlan) else chosen)
    info = _units(model, units)
    bad = [i for i in indices if not _is_int(i) or not 0 <= i < len(info)]
    if bad:
        raise ValueError(f"unit indices {bad[:5]} are not units of this model (it has {len(info)}: 0 to {len(info) - 1})")
    if isinstance(chosen, PrecisionPlan) and len(chosen.names) == len(indices):
        for i, name in zip(indices, chosen.names):
            if info[i].name != name:
                raise ValueError(f"the plan is not for this model: its unit {i} is {name}, the model's is {info[i].name}")
    prepared, counts = _prepare_batches(model, batches)
    weights = [n / sum(counts) for n in counts]
    from gnmr_hf.backends.base import active_units

    start = active_units(model, [(u.name, u.module) for u in info])
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            def mean_loss(path: Iterable[int]) -> float:
                _set_path(info, path)
                return sum(w * float(_loss(model, b)) for w, b in zip(weights, prepared))

            if reference is None:
                low, high = mean_loss([]), mean_loss(range(len(info)))
            else:
                low, high = float(reference[0]), float(reference[1])
            planned = mean_loss(indices)
    finally:
        _set_path(info, start)
        model.train(was_training)
    gap = low - high
    return {"loss_low": low, "loss_high": high, "loss_plan": planned,
            "gap_closed": (low - planned) / gap if gap != 0 else math.nan, "seconds": time.perf_counter() - t0}


def skip_modules(chosen: PrecisionPlan | SensitivityProfile | Sequence[str], keep: Sequence[str] | None = None) -> list[str]:
    """The ``llm_int8_skip_modules`` list that loads exactly the planned linears unquantised.

    Use it with a stock ``BitsAndBytesConfig(load_in_4bit=True, ..., llm_int8_skip_modules=list)`` (or
    ``load_in_8bit``). The entries are the linears' full qualified names (``model.layers.1.self_attn.v_proj``):
    transformers 5 matches an entry from the start of a module name up to a module boundary, or as a
    suffix, and older versions as a substring followed by ``.`` or as the whole name; a full name matches
    only itself (and its children) under every one of these rules, so ``model.layers.1.…`` never catches
    ``model.layers.11.…``. A given list *replaces* transformers' default (which keeps the output embedding
    ``lm_head`` unquantised), so the profile's default-kept modules come first.

    Args:
        chosen: a :class:`PrecisionPlan`, or qualified module names.
        keep: modules to keep unquantised besides the plan's (default: the plan's ``keep_modules``, i.e.
            what transformers keeps when no list is given; ``[]`` for none).
    """
    if isinstance(chosen, PrecisionPlan):
        modules, default_keep = list(chosen.modules), chosen.keep_modules
    elif isinstance(chosen, SensitivityProfile):
        raise TypeError("skip_modules takes a plan: skip_modules(gnmr_hf.plan(profile, budget_fraction=0.1))")
    else:
        modules, default_keep = [str(m) for m in chosen], ["lm_head"]
    keep = list(default_keep if keep is None else keep)
    out = []
    for name in keep + modules:
        if name not in out:
            out.append(name)
    return out


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


def memory_budget(text: str, model_path: str | os.PathLike, modules: Sequence[str], low: str,
                  double_quant: bool = False) -> dict[str, Any] | None:
    """A budget written as memory over the all-low model (``"+10%nf4"``, :func:`gnmr_hf.memory.parse_memory_budget`)
    turned into the planner's currency, BF16 bytes of kept linears; ``None`` for a budget in another form.

    The all-low model is ``model_path``'s checkpoint as a stock load stores it (``modules``, the quantised
    linears, in ``low`` with their quant states; everything else in BF16), priced from its config on the
    meta device (:func:`gnmr_hf.memory.predict_model_bytes`). Each kept linear costs
    :func:`~gnmr_hf.memory.extra_bytes_over_low` over ``low``; the BF16 budget is the memory budget times
    the linears' BF16 bytes per byte of that price (for NF4 and FP4 each linear costs 1.4375 bytes a weight
    less its 64-byte code table, so the ratio is 2 / 1.4375 to within the code tables' share).

    Returns ``{"fraction", "low", "low_model_bytes", "over_low_bytes", "bf16_per_over_byte", "bf16_budget"}``.

    Raises:
        ValueError: the budget names another low path than ``low`` (one line).
    """
    from gnmr_hf.memory import parse_memory_budget

    parsed = parse_memory_budget(str(text))
    if parsed is None:
        return None
    fraction, cur = parsed
    if cur != low:
        raise ValueError(f"budget {text!r} is memory over the {cur} model, but this model's low path is {low}")
    out = over_low_prices(model_path, modules, low, double_quant)
    over = int(fraction * out["low_model_bytes"])
    return {"fraction": fraction, **out, "over_low_bytes": over, "bf16_budget": int(over * out["bf16_per_over_byte"])}


def over_low_prices(model_path: str | os.PathLike, modules: Sequence[str], low: str,
                    double_quant: bool = False) -> dict[str, Any]:
    """``{"low", "low_model_bytes", "bf16_per_over_byte"}``: the all-low model's bytes as a stock load
    stores it, and the kept linears' BF16 bytes per byte they cost over ``low`` (see :func:`memory_budget`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gnmr_hf.memory import extra_bytes_over_low, predict_model_bytes

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    mods = dict(meta.named_modules())
    missing = [m for m in modules if m not in mods]
    if missing:
        raise ValueError(f"{len(missing)} quantised linear(s) not in {model_path}'s config, e.g. {missing[0]}")
    low_total = predict_model_bytes(meta, list(modules), low, double_quant=double_quant)["total"]
    bf16 = sum(mods[m].weight.numel() * 2 for m in modules)
    price = sum(extra_bytes_over_low(mods[m].weight.numel(), mods[m].weight.shape[0], low,
                                     double_quant=double_quant) for m in modules)
    return {"low": low, "low_model_bytes": low_total, "bf16_per_over_byte": bf16 / price}


def _pct(fraction: float) -> str:
    v = 100 * fraction
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"


def format_price_table(plans: Sequence[PrecisionPlan], over_low: dict[str, Any] | None = None) -> str:
    """The price table: per budget, predicted and measured gap closed, bytes and modules; with
    ``over_low`` (:func:`memory_budget`'s record) also each plan's memory over the all-low model."""
    wheres = sorted({w for p in plans for w in p.measured}, key=lambda w: (w != "profile", w))
    head = ["budget", "criterion", "predicted gap closed"] + [f"measured gap closed ({w})" for w in wheres] + [
        "extra MiB (BF16)", "% of quantised"] + (
        [f"memory over {over_low['low'].upper()}"] if over_low else []) + ["modules"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        row = [f"{_pct(p.budget_fraction)} %", p.criterion, _fmt(p.predicted_gap_closed, ".3f")]
        row += [_fmt(p.measured.get(w, {}).get("gap_closed"), ".3f") for w in wheres]
        row += [f"{p.bytes / 2**20:.1f}", f"{100 * p.fraction:.1f}"]
        if over_low:
            row.append(f"+{100 * p.bytes / over_low['bf16_per_over_byte'] / over_low['low_model_bytes']:.1f} %")
        row.append(str(len(p.indices)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plot

_OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def plot_profile(profile: SensitivityProfile, plans: Sequence[PrecisionPlan], path: str | os.PathLike,
                 criterion: str | None = None, title: str | None = None) -> Path:
    """Two panels: gap closed (predicted and measured) against extra BF16 bytes; a layer x operator heat
    map of the scores. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = profile._score_name(criterion)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.1]})
    ordered = sorted(plans, key=lambda p: p.bytes)
    xs = [0.0] + [100 * p.fraction for p in ordered] + [100.0]
    if any(p.predicted_gap_closed is not None for p in ordered):
        ys = [0.0] + [math.nan if p.predicted_gap_closed is None else p.predicted_gap_closed for p in ordered] + [math.nan]
        ax1.plot(xs, ys, "o--", label=f"predicted (sum of single {ordered[0].gain_score} gains)")
    for where in sorted({w for p in ordered for w in p.measured}):
        ys = [0.0] + [p.measured.get(where, {}).get("gap_closed", math.nan) for p in ordered] + [1.0]
        ax1.plot(xs, ys, "o-", label=f"measured ({where})")
    ax1.plot([0, 100], [0, 1], ":", color="grey", label="proportional to bytes")
    ax1.set_xlabel("extra BF16 bytes, % of the quantised weights' BF16 bytes")
    ax1.set_ylabel("gap closed  (L_low - L_plan) / (L_low - L_high)")
    ax1.set_xlim(0, max(30.0, 1.1 * max(xs[1:-1], default=0.0)))
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax1.set_title(f"plans by {name}")

    layers = sorted({u.layer for u in profile.units if u.layer is not None})
    ops = [o for o in _OPS if any(u.op == o for u in profile.units)] + sorted(
        {u.op for u in profile.units} - set(_OPS))
    grid = [[math.nan] * len(ops) for _ in layers]
    for u in profile.units:
        if u.layer is not None and u.op in ops:
            grid[layers.index(u.layer)][ops.index(u.op)] = u.scores.get(name, math.nan)
    vals = [v for row in grid for v in row if math.isfinite(v)]
    vmax = max((abs(v) for v in vals), default=1.0) or 1.0
    signed = any(v < 0 for v in vals)
    im = ax2.imshow(grid, aspect="auto", cmap="RdBu_r" if signed else "viridis",
                    vmin=-vmax if signed else 0, vmax=vmax, interpolation="nearest")
    ax2.set_xticks(range(len(ops)), ops, rotation=45, ha="right", fontsize=8)
    ax2.set_yticks(range(len(layers)), [str(v) for v in layers], fontsize=6 if len(layers) > 20 else 8)
    ax2.set_ylabel("decoder layer")
    ax2.set_title(f"{name} score per unit")
    fig.colorbar(im, ax=ax2, label=name + (" (loss gain)" if name in GAIN_SCORES else ""))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ CLI


class ProfileError(Exception):
    """Bad input to ``gnmr-hf profile``: printed as one line, exit code 2."""


PRICE_POINTS = (0.05, 0.10, 0.25)
_LOW = ("nf4", "fp4", "int8")
_TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text")


PROFILE_EPILOG = """examples:
  gnmr-hf profile --output prof                              SmolLM2, NF4, the recipes' data, 10 % budget
  gnmr-hf profile --model PATH --low nf4 --budget 300MB --data train.jsonl --output prof
  gnmr-hf profile --output prof --criterion first_order,loss --heldout-batches 2   compare criteria
  gnmr-hf eval --model PATH --precision nf4 --skip-modules prof/profile.json --adapter ADAPTER
                                                             score an adapter on the planned mixed base

In Python: BitsAndBytesConfig(load_in_4bit=True, ..., llm_int8_skip_modules=json.load(open("prof/profile.json"))
["skip_modules"]) loads that base with stock transformers. Errors are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    from gnmr_hf.reporting.report import OneLineErrorParser

    p = OneLineErrorParser(
        prog="gnmr-hf profile",
        description="Profile which quantised linears are worth keeping on BF16 (a few batches of the training "
                    "data, before training) and plan a byte budget: prints the price table, writes "
                    "DIR/profile.json (skip_modules, units) and DIR/profile.png, nothing else (the default "
                    "generated training set is written to a temporary folder and removed).",
        epilog=PROFILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model folder with safetensors (the BF16 checkpoint), or smollm2-135m-instruct (default)")
    p.add_argument("--low", default="nf4", choices=_LOW, help="the quantised low path (default nf4)")
    p.add_argument("--budget", default="10%",
                   help="memory over the all-low model (+10%%nf4, +10%%int8: the served model's bytes), or extra "
                        "BF16 bytes: a percentage of the quantised weights' BF16 bytes (10%%), a fraction "
                        "in (0, 1] (0.1) or a size with a unit (300MB, 2GiB, 123456B; a bare number above 1 is "
                        "refused as ambiguous); it must buy at least the smallest linear and stay within the total "
                        "(checked once the model is loaded, before profiling); default 10%%")
    p.add_argument("--output", "-o", required=True,
                   help="output folder (profile.json, profile.png; created if missing; an existing file is refused)")
    p.add_argument("--data", default=None,
                   help="training data: a .json/.jsonl file or folder in the recipe's schema (tokenised as "
                        "recipes/finetune.py does), or a text file (.txt/.rst/.md: chunks of --max-seq-len tokens); "
                        "default: the SmolLM2 recipes' generated GSM8K-style training set")
    p.add_argument("--criterion", default=DEFAULT_CRITERION,
                   help=f"criteria, comma-separated ({', '.join(CRITERIA)}, or all); the first plans "
                        f"(default {DEFAULT_CRITERION})")
    p.add_argument("--batches", type=int, default=1,
                   help="batches to profile on (default 1: first_order on one batch costs about 1.6 training steps "
                        "and chose as well as two on SmolLM2, docs/profile.md)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per batch (default: the recipe's, 4)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per example (default: the recipe's; 512 for a text file)")
    p.add_argument("--heldout-batches", type=int, default=0,
                   help="also measure the plans on the next N batches of the data (default 0); refused when the "
                        "data has nothing left after the profile batches, a warning when it has less than asked")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--storage", default="host", choices=("host", "device", "disk"),
                   help="where the BF16 recovery weights live during profiling (default host)")
    p.add_argument("--recipe", default=None, help="the recipe YAML whose data and LoRA settings to use "
                   "(default: recipes/smollm2-135m/<low>.yaml)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-plot", action="store_true", help="do not write profile.png")
    p.add_argument("--no-ladder", action="store_true",
                   help="4-bit low paths: skip the precision ladder's table (INT8 and BF16 rungs under budgets of "
                        "memory over the 4-bit model; gnmr_hf.ladder, one model load per row)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return _run(args)
    except ProfileError as e:
        print(f"gnmr-hf profile: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"gnmr-hf profile: error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2


def _finetune_module(recipes: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gnmr_hf_recipe_finetune", recipes / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_recipe(args: argparse.Namespace, out: Path, scratch: Path):
    """The recipe's finetune module and configuration (its data, templates, batch size and LoRA). The default
    generated training set is written under ``scratch`` (a temporary folder), not the output folder."""
    from gnmr_hf.demo import DemoError, find_recipes

    try:
        recipes = find_recipes()
    except DemoError as e:
        raise ProfileError(str(e)) from None
    finetune = _finetune_module(recipes)
    recipe_file = Path(args.recipe) if args.recipe else recipes / "smollm2-135m" / ("int8.yaml" if args.low == "int8"
                                                                                   else "nf4.yaml")
    if not recipe_file.is_file():
        raise ProfileError(f"recipe {recipe_file} not found")
    argv = ["--config", str(recipe_file), "--output_dir", str(out), "--data_dir", str(scratch / "data")]
    if args.data and Path(args.data).suffix.lower() not in _TEXT_SUFFIXES:
        argv += ["--dataset", args.data]
    if args.max_seq_len:
        argv += ["--max_seq_len", str(args.max_seq_len)]
    try:
        recipe = finetune.load_config(argv)
    except finetune.RecipeError as e:
        raise ProfileError(str(e)) from None
    return finetune, recipe


def _text_batches(path: Path, tokenizer, n_batches: int, batch_size: int, seq_len: int) -> list[dict[str, Any]]:
    ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) > 1][: n_batches * batch_size]
    if not chunks:
        raise ProfileError(f"{path} holds fewer than 2 tokens")
    batches = []
    for i in range(0, len(chunks), batch_size):
        group = chunks[i:i + batch_size]
        width = max(len(c) for c in group)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([c + [pad] * (width - len(c)) for c in group])
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in group])
        labels = input_ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": input_ids, "attention_mask": mask, "labels": labels})
    return batches


def _record_batches(finetune, recipe, tokenizer, n_batches: int, batch_size: int, out: Path) -> list[dict[str, Any]]:
    from transformers import DataCollatorForSeq2Seq

    try:
        records = finetune.load_records(recipe.script, str(out))
        rows = finetune.tokenize_dataset(recipe.script, records.select(range(min(len(records), 4 * n_batches * batch_size))),
                                         tokenizer)
    except finetune.RecipeError as e:
        raise ProfileError(str(e)) from None
    rows = rows.select(range(min(len(rows), n_batches * batch_size)))
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    return [dict(collate([rows[j] for j in range(i, min(i + batch_size, len(rows)))]))
            for i in range(0, len(rows), batch_size)]


# what a tokenizer folder holds (tokenizer.save_pretrained writes one of these, with tokenizer_config.json)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.tiktoken")


def _load_tokenizer(model_path: Path, shown: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # transformers raises ValueError, OSError, TypeError ... depending on what is missing
        present = [f for f in _TOKENIZER_FILES if (Path(model_path) / f).is_file()]
        if not present:
            raise ProfileError(
                f"--model {shown}: the folder has no tokenizer files (it needs tokenizer.json, or tokenizer.model "
                "or vocab.json + merges.txt, with tokenizer_config.json: what tokenizer.save_pretrained(folder) "
                "writes)") from None
        first = (str(e).strip().splitlines() or [""])[0]
        raise ProfileError(f"--model {shown}: its tokenizer ({', '.join(present)}) did not load: "
                           f"{type(e).__name__}: {first}") from None


def _check_output(out: Path, shown: str) -> None:
    """``--output`` must be a folder or creatable as one (refused before anything is loaded or written)."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ProfileError(f"--output {shown}: " + ("an existing file, not a folder" if p == out else
                                                            f"{p} is a file, not a folder"))
            if not os.access(p, os.W_OK):
                raise ProfileError(f"--output {shown}: {p} is not writable")
            return


def _examples(batches: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Examples and target tokens in prepared-or-collated batches."""
    rows = sum(int(b["input_ids"].shape[0]) for b in batches)
    tokens = sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)
    return rows, tokens


def _run(args: argparse.Namespace) -> int:
    from gnmr_hf.memory import parse_memory_budget

    memory = parse_memory_budget(args.budget)  # "+10%nf4": converted once the model's linears are known
    if memory is not None and memory[1] != args.low:
        raise ProfileError(f"--budget {args.budget} is memory over the {memory[1]} model, but --low is {args.low}")
    budget_bytes, budget_fraction = (None, None) if memory is not None else parse_budget(args.budget)
    criteria = _criteria(args.criterion)
    for flag in ("batches", "batch_size", "max_seq_len", "threads"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ProfileError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.heldout_batches < 0:
        raise ProfileError(f"--heldout-batches must be >= 0, got {args.heldout_batches}")
    if args.data and not Path(args.data).exists():
        raise ProfileError(f"--data {args.data}: no such file or folder")
    out = Path(args.output).resolve()
    _check_output(out, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from gnmr_hf._import_utils import require

    for pkg in ("transformers", "bitsandbytes", "peft", "datasets"):
        require(pkg, "gnmr-hf profile")
    started = time.time()

    # the model folder
    if args.model == "smollm2-135m-instruct":
        from gnmr_hf.offline.smollm2 import smollm2_checkpoint

        model_path = smollm2_checkpoint()
    else:
        model_path = Path(args.model)
        if not (model_path / "config.json").is_file():
            raise ProfileError(f"--model {args.model}: not a model folder (no config.json)")
        if not list(model_path.glob("*.safetensors")):
            raise ProfileError(f"--model {args.model}: no *.safetensors files (the BF16 weights the recovery path "
                               "reads)")

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tokenizer = _load_tokenizer(model_path, args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    import tempfile

    # the generated training set (no --data) goes to a temporary folder: DIR holds profile.json and profile.png only
    with tempfile.TemporaryDirectory(prefix="gnmr-hf-profile-") as scratch:
        finetune, recipe = _load_recipe(args, out, Path(scratch))
        batch_size = args.batch_size or recipe.training.per_device_train_batch_size
        n_total = args.batches + args.heldout_batches
        text = bool(args.data) and Path(args.data).suffix.lower() in _TEXT_SUFFIXES
        if text:
            seq_len = args.max_seq_len or 512
            all_batches = _text_batches(Path(args.data), tokenizer, n_total, batch_size, seq_len)
        else:
            all_batches = _record_batches(finetune, recipe, tokenizer, n_total, batch_size, out)
    batches, heldout = all_batches[:args.batches], all_batches[args.batches:]
    if not batches:
        raise ProfileError("the data gave no batch")
    what = f"piece(s) of up to {seq_len} tokens" if text else "example(s)"
    rows, tokens = _examples(batches)
    used = (f"[profile] data: {args.data or 'the recipes generated training set'}: profiling {len(batches)} batch(es) "
            f"({rows} {what}, {tokens} target tokens; batch size {batch_size})")
    if args.heldout_batches:
        if not heldout:
            raise ProfileError(
                f"--heldout-batches {args.heldout_batches}: the data has nothing left for held-out batches (all "
                f"{rows} {what} went to the {len(batches)} profile batch(es)): give more data, fewer --batches, or "
                "--heldout-batches 0")
        h_rows, h_tokens = _examples(heldout)
        used += f", held-out {len(heldout)} batch(es) ({h_rows} {what}, {h_tokens} target tokens)"
    print(used, flush=True)
    if rows < args.batches * batch_size:
        print(f"gnmr-hf profile: warning: --batches {args.batches} x batch size {batch_size} asked for "
              f"{args.batches * batch_size} {what}; the data gave {rows}", file=sys.stderr, flush=True)
    if args.heldout_batches and h_rows < args.heldout_batches * batch_size:
        print(f"gnmr-hf profile: warning: --heldout-batches {args.heldout_batches} x batch size {batch_size} asked "
              f"for {args.heldout_batches * batch_size} {what}; the data left {h_rows} in {len(heldout)} batch(es)",
              file=sys.stderr, flush=True)

    import gnmr_hf

    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    if args.low == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.low, bnb_4bit_compute_dtype=dtype)
    device_map = {"": 0} if torch.cuda.is_available() else None
    print(f"[profile] loading {model_path} in {args.low} ({dtype}) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=qconfig,
                                                 device_map=device_map)
    if args.low != "int8":
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        keep_reference_layout(model)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=args.storage, units="linears",
                                      dtype=dtype)
    # the budget against the model's linears, before the profile costs anything
    info = _units(model, None)
    sizes, unit_names = [u.bytes for u in info], [u.name for u in info]
    linears = [m for u in info for m in u.modules]
    over_low = over_low_prices(model_path, linears, args.low)  # the price table's second currency
    if memory is not None:
        over_low = memory_budget(args.budget, model_path, linears, args.low)
        budget_bytes = over_low["bf16_budget"]
        print(f"[profile] budget {args.budget}: {over_low['over_low_bytes'] / 2**20:.2f} MiB over the "
              f"{over_low['low_model_bytes'] / 2**20:.1f} MiB {args.low} model = {budget_bytes / 2**20:.2f} MiB of "
              f"BF16 weights ({100 * budget_bytes / sum(sizes):.1f} % of the quantised linears')", flush=True)
    want = budget_bytes if budget_bytes is not None else int(budget_fraction * sum(sizes))
    why = budget_error(sizes, want, unit_names)
    if why:
        raise ProfileError(f"--budget {args.budget}: {why}")
    if "lora_grad" in criteria:
        import peft

        lora = recipe.lora
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha,
                                                           lora_dropout=lora.lora_dropout,
                                                           target_modules=lora.lora_target_modules,
                                                           task_type="CAUSAL_LM"))

    prof = profile_sensitivity(model, batches, criteria=criteria, progress=not args.quiet)
    name = prof._score_name(criteria[0]) if criteria[0] not in prof.skipped else None
    if name is None:
        raise ProfileError(f"criterion {criteria[0]} was skipped: {prof.skipped[criteria[0]]}")

    kw: dict[str, Any] = {"model": model, "batches": batches}
    if heldout:
        ref = measure_plan(model, [], heldout)
        kw.update(heldout=heldout, heldout_reference=(ref["loss_low"], ref["loss_high"]))
    main_plan = plan(prof, budget_bytes, budget_fraction=budget_fraction, criterion=name, **kw)
    # price points that buy no unit on this model (a tiny one) are left out
    price = [plan(prof, budget_fraction=f, criterion=name, **kw) for f in PRICE_POINTS
             if (budget_fraction is None or abs(f - budget_fraction) > 1e-9)
             and budget_error(sizes, int(f * prof.total_bytes)) is None]
    price = sorted(price + [main_plan], key=lambda p: p.budget_bytes)

    print()
    print(prof.table(name, top=15))
    print()
    print(prof.cost_table())
    print()
    print(f"price table (gap closed = (L_low - L_plan) / (L_low - L_high); L_low {prof.losses['low']:.4f}, "
          f"L_high {prof.losses['high']:.4f} on the profile batches):")
    print(format_price_table(price, over_low))
    ladder_rows = None
    if args.low != "int8" and not args.no_ladder:
        from gnmr_hf.ladder import format_ladder_table, ladder_table

        print(f"\n[profile] the precision ladder: each linear on {args.low}, INT8 or BF16, planned under memory over "
              f"the {args.low} model (one load per row) ...", flush=True)
        ladder_rows = ladder_table(model_path, batches, args.low, dtype=dtype, progress=not args.quiet)
        print(f"ladder price table (gap closed on the profile batches; L_low {ladder_rows['loss_low']:.4f}, "
              f"L_high {ladder_rows['loss_high']:.4f} as stock-loaded; served over {args.low} = the rungs' exact "
              "bytes with BF16 rungs in BF16):")
        print(format_ladder_table(ladder_rows))
    print()
    print(main_plan.summary())
    skips = main_plan.skip_modules()
    units_json = [{"index": u.index, "name": u.name, "bytes": u.bytes, "score": u.scores[name],
                   "modules": u.modules, "layer": u.layer, "op": u.op, "scores": u.scores} for u in prof.units]
    out.mkdir(parents=True, exist_ok=True)
    path = prof.to_json(out / "profile.json", skip_modules=skips, criterion=name, budget=args.budget,
                        plan=main_plan.to_dict(), price=[p.to_dict() for p in price], units=units_json,
                        **({} if ladder_rows is None else {"ladder": ladder_rows}),
                        command="gnmr-hf profile " + shlex.join(args.argv))
    written = [str(path)]
    if not args.no_plot:
        try:
            written.append(str(plot_profile(prof, price, out / "profile.png", name,
                                            title=f"{Path(str(model_path)).name}, {args.low}: profiled on {prof.tokens} target tokens")))
        except ImportError:
            print("[profile] matplotlib is not installed: no profile.png (pip install matplotlib)", file=sys.stderr)
    print()
    print("load with these linears unquantised:\n"
          f"  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={args.low!r}, llm_int8_skip_modules=json.load("
          f"open({str(path)!r}))['skip_modules'])" if args.low != "int8" else
          f"  BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=json.load(open({str(path)!r}))['skip_modules'])")
    print(f"[profile] wrote {', '.join(written)} in {time.time() - started:.0f} s")
    return 0


def random_sets(sizes: Sequence[int], budget: int, draws: int, seed: int = 0) -> list[list[int]]:
    """``draws`` random unit sets of at most ``budget`` bytes: units in a seeded random order, each taken
    when it still fits (the same fill rule as the greedy planner)."""
    r = random.Random(seed)
    out = []
    for _ in range(draws):
        order = list(range(len(sizes)))
        r.shuffle(order)
        chosen, used = [], 0
        for i in order:
            if used + sizes[i] <= budget:
                chosen.append(i)
                used += sizes[i]
        out.append(sorted(chosen))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
