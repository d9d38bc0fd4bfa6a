"""The profile and its JSON file: :class:`UnitScore`, :class:`SensitivityProfile` (``profile.json``)."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.planning.criteria import DEFAULT_CRITERION, SCORE_NAMES
from gnmr_hf.planning.plan import Plan, plan_file
from gnmr_hf.planning.profile_format import FORMAT_VERSION, _check_profile_dict, _is_int, _is_number  # noqa: F401
from gnmr_hf.strict_json import read_json

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
    #: the plan the file holds, read by :meth:`gnmr_hf.planning.plan.Plan.load` (:meth:`from_json` sets it; a
    #: profile without a plan gives one with ``planned`` False); None for a profile built in memory
    plan: Any = field(default=None, compare=False, repr=False)

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
        """Read a profile written by :meth:`to_json` (or ``gnmr-hf profile``'s ``profile.json``, or a recipe's),
        from the file or the folder holding it. The profile's data is read here; the plan it holds is
        :meth:`gnmr_hf.planning.plan.Plan.from_dict`'s (:attr:`plan`), the one reader of plans.

        Raises:
            ValueError: not JSON, or not a valid profile (one line: the file and the field; see :meth:`from_dict`).
        """
        if Path(path).is_dir():
            path = plan_file(path)
        try:
            data = read_json(path)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        try:
            profile = cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        profile.plan = Plan.from_dict(data, path)
        return profile


def _pct(fraction: float) -> str:
    """A fraction as a percentage for the price tables: whole when it is, else one decimal."""
    v = 100 * fraction
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"


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


