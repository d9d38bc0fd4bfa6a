"""One type for every plan this project makes: :class:`Plan`, its file (``profile.json``) and :class:`PlanError`.

A plan says, for a model's quantised decoder linears, which run on another rung than the low format: ``rungs``
maps a full linear name (``model.layers.3.self_attn.v_proj``) to ``"int8"`` or ``"bf16"``; every other decoder
linear stays on ``low`` (``nf4``, ``fp4``, ``int8``, or ``int4``: the compressed-tensors export's W4A16 with its
``group_size``). Beside the rungs it records the serving groups it respects (``groups``: ``"vllm"`` or None),
the rungs it was chosen over (``rung_set``: ``("bf16",)`` for a BF16-only plan, ``("int8", "bf16")`` for the
ladder), its budget as written and in bytes, its price, the identity of the model it was made on and how it
was chosen (``chosen_by``: criterion, batches, tokens, the batches' digests, the command).

:meth:`Plan.load` takes a plan file or the folder holding its ``profile.json`` and reads every schema this
project has written:

==========================  ==================================================================================
writer                      what the file holds
==========================  ==================================================================================
:meth:`Plan.save`           this module's schema (``schema_version`` 1, ``kind`` ``gnmr_hf.plan``)
``gnmr-hf profile``         a sensitivity profile with ``low``, ``budget``, ``skip_modules``, the BF16-only
                            ``plan`` and (``--low nf4``/``fp4``) the ladder table, whose row at the file's
                            budget is its ladder plan (``Plan.load(path, rung_set=("int8", "bf16"))``)
``gnmr-hf profile --low     a hand-built dict: ``low: int4``, ``group_size``, ``rungs``, ``budget_bytes`` ...
int4``
a planned recipe            a sensitivity profile with ``skip_modules`` and the run's ``plan`` record
a ladder recipe             a hand-built dict: ``rungs``, the run's ``plan`` record, ``model_identity``, ``units``
a hand-built skip list      ``{"skip_modules": [...]}`` alone: every entry on BF16 (``lm_head`` kept)
a profile, no plan          ``SensitivityProfile.to_json`` (or the older bench files: ``criterion``, ``units``
                            with a ``score``): a :class:`Plan` with ``planned`` False and no rungs
==========================  ==================================================================================

Every refusal is one :class:`PlanError` line naming the file (a key named twice in one JSON object is
:class:`gnmr_hf.strict_json.DuplicateKeyError`, also a ``ValueError``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gnmr_hf.memory import parse_memory_budget
from gnmr_hf.planning.groups import INT4_PROFILE
from gnmr_hf.planning.profile_format import check_profile_dict
from gnmr_hf.rungs import get_rung, planned_rungs
from gnmr_hf.rungs.int4 import INT4_LOWS
from gnmr_hf.serving import ServeError, check_plan, serve_target
from gnmr_hf.strict_json import DuplicateKeyError, read_json

#: the schema :meth:`Plan.save` writes
SCHEMA_VERSION = 1
#: the ``kind`` of a file :meth:`Plan.save` wrote
KIND = "gnmr_hf.plan"
#: a GGUF plan's low (``gnmr-hf profile --serve gguf``) -> the ggml type its unplanned linears are written at
GGUF_LOWS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}
#: the low formats a plan is made over (``int4``: the compressed-tensors export's W4A16, ``int4-asym`` its
#: W4A16_ASYM; ``q4_0`` ...: a GGUF file's ggml types, :mod:`gnmr_hf.planning.gguf_plan`)
LOWS = ("nf4", "fp4", "int8", *INT4_LOWS, *GGUF_LOWS)
#: what refuses a GGUF plan where a bitsandbytes or compressed-tensors one is needed
GGUF_PROFILE = "profiled against a GGUF file's ggml types (gnmr-hf profile --serve gguf): export it with --format gguf"
#: the stock rungs a planned linear may be on, cheapest first; a plan takes any registered planned rung
#: (:func:`gnmr_hf.rungs.planned_rungs`: these and any a user registers with :func:`gnmr_hf.rungs.register_rung`)
RUNGS = ("int8", "bf16")
#: the file a folder holds its plan in
PLAN_FILE = "profile.json"


class PlanError(ValueError):
    """A plan file that cannot be read as a plan, or a plan asked for what it cannot give (one line)."""


def skip_list(modules: Sequence[str], keep: Sequence[str]) -> list[str]:
    """The ``llm_int8_skip_modules`` order: ``keep`` first (a given list replaces transformers' default, which keeps
    ``lm_head``), then ``modules``, each name once (:func:`gnmr_hf.planning.skiplist.skip_modules` and
    :meth:`Plan.skip_modules` both write it)."""
    out: list[str] = []
    for name in [*keep, *modules]:
        if name not in out:
            out.append(name)
    return out


def plan_file(path: str | os.PathLike) -> Path:
    """The plan file ``path`` names: the file itself, or ``DIR/profile.json`` for a folder; one :class:`PlanError`
    line when there is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / PLAN_FILE).is_file():
            raise PlanError(f"{path}: a folder without {PLAN_FILE} (give a recipe's output folder, gnmr-hf profile's "
                            f"--output folder, or the {PLAN_FILE} itself)")
        path = path / PLAN_FILE
    if not path.is_file():
        raise PlanError(f"{path}: no such plan file (a {PLAN_FILE} from a recipe or gnmr-hf profile --budget)")
    return path


def recorded_identity(data: Any) -> dict[str, Any] | None:
    """The ``model_identity`` a plan or profile dict records: at the top level (the ladder files, :meth:`Plan.save`)
    or in ``meta`` (a profile's); None when it records none."""
    if not isinstance(data, dict):
        return None
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    found = data.get("model_identity", meta.get("model_identity"))
    return found if isinstance(found, dict) else None


@dataclass
class Plan:
    """A plan: each planned decoder linear's rung over the low format, and where the plan came from.

    Attributes:
        rungs: full linear name -> ``"int8"`` or ``"bf16"``; every other decoder linear is on ``low``.
        low: the low format (one of :data:`LOWS`).
        group_size: the INT4 group size (``low`` ``"int4"`` or ``"int4-asym"``); None for the bitsandbytes and GGUF
            formats.
        groups: ``"vllm"`` when the plan buys whole serving groups, None for a free plan.
        rung_set: the rungs the plan was chosen over: ``("bf16",)`` (a BF16-only plan), ``("int8",)`` or
            ``("int8", "bf16")`` (the ladder).
        budget: the budget as written (``"+10%nf4"``, ``"10%"``); None when not recorded.
        budget_bytes: the budget in bytes, in the currency its writer planned in (``chosen_by["currency"]``).
        price_bytes: what the plan adds over the all-low model, in the same currency; None when not recorded.
        model_identity: :func:`gnmr_hf.planning.profiler.model_identity` of the model it was made on (None: a
            file written before identities were recorded).
        chosen_by: how it was chosen: ``criterion``, ``batches``, ``tokens``, ``batch_digests``, ``policy``,
            ``command``, ``currency``, ``writer`` (whichever the file records).
        keep_modules: modules a stock load keeps unquantised anyway (``lm_head``); they head
            :meth:`skip_modules`.
        planned: False for a profile that holds no plan (no rungs chosen).
        serve: the serving target it was made for (:data:`gnmr_hf.serving.TARGETS`: ``gnmr-hf profile --serve``, a
            recipe's ``profile.serve``), None when none was named; a plan with a rung or grouping its target cannot
            load is refused (:class:`PlanError`). A plan a recipe trains over a bitsandbytes low may name a server
            of another low (vLLM: INT4): the rungs and groups are the server's, and the export plans the low anew
            (``gnmr-hf export --replan``) or re-types it.
        schema_version: :data:`SCHEMA_VERSION`.
        source: the file it was loaded from (not saved).
    """

    rungs: dict[str, str]
    low: str = "nf4"
    group_size: int | None = None
    groups: str | None = None
    rung_set: tuple[str, ...] = ("bf16",)
    budget: str | None = None
    budget_bytes: int | None = None
    price_bytes: int | None = None
    model_identity: dict[str, Any] | None = None
    chosen_by: dict[str, Any] = field(default_factory=dict)
    keep_modules: list[str] = field(default_factory=list)
    planned: bool = True
    serve: str | None = None
    schema_version: int = SCHEMA_VERSION
    source: Path | None = field(default=None, compare=False, repr=False)
    data: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the file as read

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        if self.low not in LOWS:
            raise PlanError(f"{where}low {self.low!r} is not a low format a plan is made over ({', '.join(LOWS)})")
        if not isinstance(self.rungs, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in self.rungs.items()):
            raise PlanError(f"{where}'rungs' must map linear names to rungs ({', '.join(planned_rungs())})")
        known = planned_rungs()
        bad = {n: r for n, r in self.rungs.items() if r not in known}
        if bad:
            raise PlanError(f"{where}unknown rung(s) {bad}: each is one of {known}")
        self.rung_set = tuple(r for r in known if r in self.rung_set)
        if not self.rung_set:
            raise PlanError(f"{where}rung_set must name rungs from {', '.join(known)}")
        off = sorted(n for n, r in self.rungs.items() if r not in self.rung_set)
        if off:
            raise PlanError(f"{where}{off[0]} is on {self.rungs[off[0]]}, which is not among the rungs the plan was "
                            f"chosen over ({', '.join(self.rung_set)})")
        if (self.group_size is None) != (self.low not in INT4_LOWS):
            raise PlanError(f"{where}group_size {self.group_size!r} with low {self.low}: an int4 plan records its group "
                            "size, a bitsandbytes one none")
        if self.serve is not None:
            try:
                target = serve_target(self.serve)
                check_plan(self.rungs, self.low, target, "it", training=True)
            except ServeError as e:
                raise PlanError(f"{where}made for serve {self.serve!r}: {e}") from None
            if target.groups and self.groups != target.groups:
                raise PlanError(f"{where}made for serve {self.serve!r}, which fuses serving groups, but the plan is "
                                "free (groups null): plan it with --serve, which keeps whole groups")

    # ------------------------------------------------------------------------------------- derived
    @property
    def is_int4(self) -> bool:
        """True for a plan over the compressed-tensors export's INT4 (``gnmr-hf profile --low int4``): no
        bitsandbytes load, skip list or folder serves it (``--low int4-asym`` too). The one place that asks."""
        return self.low in INT4_LOWS

    @property
    def is_gguf(self) -> bool:
        """True for a plan over a GGUF file's ggml type (``gnmr-hf profile --serve gguf``: low ``q4_0`` ...)."""
        return self.low in GGUF_LOWS

    @property
    def export_only(self) -> str | None:
        """Why no bitsandbytes load, skip list or folder serves the plan (an INT4 or GGUF plan: what exports it),
        or None for a plan over a bitsandbytes low format."""
        return INT4_PROFILE if self.is_int4 else GGUF_PROFILE if self.is_gguf else None

    def require_bnb_low(self, who: str) -> Plan:
        """``self``, or one :class:`PlanError` line when the plan is over INT4 (``who``: what refuses it, e.g.
        ``"load_planned loads bitsandbytes low paths"``)."""
        if self.export_only:
            raise PlanError(f"{self.source or 'the plan'} was {self.export_only}" + (f" ({who})" if who else ""))
        return self

    def on(self, rung: str) -> list[str]:
        """The planned linears on ``rung``, sorted."""
        return sorted(n for n, r in self.rungs.items() if r == rung)

    @property
    def ladder(self) -> bool:
        """True when the plan was chosen over other rungs than BF16 alone (the precision ladder)."""
        return self.rung_set != ("bf16",)

    def describe(self) -> str:
        """A few words: ``"a BF16-only nf4 plan, free"``, ``"an int8+bf16 ladder plan over int4 (group 128), grouped"``."""
        what = "a BF16-only" if not self.ladder else f"a {'+'.join(self.rung_set)} ladder"
        low = f"{self.low} (group {self.group_size})" if self.group_size else self.low
        return f"{what} plan over {low}, {'grouped (' + self.groups + ')' if self.groups else 'free'}"

    def skip_modules(self) -> list[str]:
        """The ``llm_int8_skip_modules`` list of a stock ``BitsAndBytesConfig``: the kept modules, then the
        planned linears (:func:`gnmr_hf.planning.skiplist.skip_modules`). A plan with INT8 rungs or over INT4 has
        none (:class:`PlanError`): no stock bitsandbytes checkpoint mixes 4- and 8-bit linears."""
        self._require_bnb("a skip list")
        return skip_list([n for n, r in self.rungs.items() if r == "bf16" and n not in self.keep_modules],
                         keep=self.keep_modules or ["lm_head"])

    def bnb_config(self, compute_dtype: Any = None, double_quant: bool = False, **kwargs: Any):
        """The stock ``BitsAndBytesConfig`` that loads this plan: ``low`` (4-bit ``nf4``/``fp4`` or 8-bit) with
        :meth:`skip_modules` unquantised. ``kwargs`` go to ``BitsAndBytesConfig``."""
        self._require_bnb("a BitsAndBytesConfig")
        from transformers import BitsAndBytesConfig

        if self.low == "int8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=self.skip_modules(), **kwargs)
        extra = {} if compute_dtype is None else {"bnb_4bit_compute_dtype": compute_dtype}
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.low,
                                  bnb_4bit_use_double_quant=double_quant, llm_int8_skip_modules=self.skip_modules(),
                                  **extra, **kwargs)

    def ct_config(self, linears: Sequence[str], group_size: int | None = None):
        """The compressed-tensors ``QuantizationConfig`` that serves this plan (what ``gnmr-hf export --format
        compressed-tensors`` applies): every one of ``linears`` (the model's decoder linears) not on a rung in
        W4A16 groups of ``group_size`` (default: the plan's, else 128), the INT8 rungs W8A16 per channel, the
        BF16 rungs and ``lm_head`` ignored; None when nothing is quantised. Needs ``compressed-tensors``."""
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

        gs = group_size or self.group_size or 128
        unknown = sorted(set(self.rungs) - set(linears))
        if unknown:
            raise PlanError(f"{self.source or 'the plan'} plans {unknown[0]}, which is none of the given linears")
        other = sorted({r for r in self.rungs.values() if "compressed-tensors" not in get_rung(r).exports})
        if other:
            raise PlanError(f"{self.source or 'the plan'} puts linears on {', '.join(other)}, which compressed-tensors "
                            "has no scheme for (the rung registers none)")
        # each linear's scheme: the low format's (W4A16) unless planned, else its rung's compressed-tensors entry
        # (gnmr_hf.rungs: INT8 "W8A16", BF16 "ignore"); one config group per scheme, W4A16 first
        low = get_rung(self.low).exports["compressed-tensors"] if self.low in INT4_LOWS else "W4A16"
        by_scheme: dict[str, list[str]] = {}
        for n in linears:
            scheme = get_rung(self.rungs[n]).exports["compressed-tensors"] if n in self.rungs else low
            by_scheme.setdefault(scheme, []).append(n)
        ignore = ["lm_head"] + by_scheme.pop("ignore", [])
        order = sorted(by_scheme, key=lambda k: (k != low, k))
        groups = {f"group_{i}": QuantizationScheme(targets=by_scheme[k], weights=ct_weight_args(k, gs))
                  for i, k in enumerate(order)}
        return QuantizationConfig(config_groups=groups, ignore=ignore) if groups else None

    def _require_bnb(self, what: str) -> None:
        where = f"{self.source} " if self.source else "the plan "
        if self.export_only:
            raise PlanError(f"{where}was {self.export_only} (it has no {what})")
        int8 = self.on("int8")
        if int8:
            raise PlanError(f"{where}puts {len(int8)} linear(s) on INT8 (e.g. {int8[0]}): no stock bitsandbytes "
                            f"checkpoint mixes 4- and 8-bit linears, so it has no {what} (gnmr_hf.load_planned "
                            "loads it; gnmr-hf export --format compressed-tensors exports it)")
        other = self.not_in_skip_list()
        if other:
            raise PlanError(f"{where}puts {len(other)} linear(s) on {self.rungs[other[0]]} (e.g. {other[0]}), which "
                            f"a stock bitsandbytes checkpoint cannot hold, so it has no {what} (gnmr_hf.load_planned "
                            "loads it)")

    def not_in_skip_list(self) -> list[str]:
        """The planned linears whose rung a bitsandbytes skip list cannot say (every rung but BF16's, whose
        registry entry writes ``"skip"`` for bitsandbytes), sorted."""
        return sorted(n for n, r in self.rungs.items() if get_rung(r).exports.get("bitsandbytes") != "skip")

    def require_planned(self) -> Plan:
        """``self``, or one :class:`PlanError` line when the file held a profile and no plan."""
        if not self.planned:
            raise PlanError(f"{self.source or 'the file'} is a profile without a plan (no skip_modules): plan it "
                            "(gnmr-hf profile --budget, or gnmr_hf.plan and to_json(..., skip_modules=...)) or pass "
                            "the rungs as a dict")
        return self

    # ------------------------------------------------------------------------------------- the file
    def to_dict(self) -> dict[str, Any]:
        """The file's dict (:data:`SCHEMA_VERSION`). A BF16-only bitsandbytes plan also records its
        ``skip_modules``, so the readers of older files take it as they are."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version, "kind": KIND, "low": self.low, "group_size": self.group_size,
            "groups": self.groups, "rung_set": list(self.rung_set), "planned": self.planned,
            "rungs": dict(self.rungs), "keep_modules": list(self.keep_modules), "budget": self.budget,
            "budget_bytes": self.budget_bytes, "price_bytes": self.price_bytes,
            "model_identity": self.model_identity, "chosen_by": dict(self.chosen_by), "serve": self.serve}
        if self.planned and not self.export_only and not self.not_in_skip_list():
            out["skip_modules"] = self.skip_modules()
        return out

    def save(self, path: str | os.PathLike, **extra: Any) -> Path:
        """Write the plan (and ``extra`` top-level keys, which :meth:`load` ignores) to ``path``, or to
        ``path/profile.json`` when ``path`` is a folder; returns the file. Written whole or not at all."""
        path = Path(path)
        if path.is_dir():
            path = path / PLAN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        own = self.to_dict()
        clash = sorted(set(extra) & set(own))
        if clash:
            raise PlanError(f"Plan.save: extra key(s) {clash} are the plan's own")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({**own, **extra}, indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, rung_set: Sequence[str] | None = None) -> Plan:
        """The plan in a file, or in ``DIR/profile.json`` for a folder, whichever schema wrote it (the module's
        table). ``rung_set``: a file that holds more than one plan (``gnmr-hf profile``'s, with its ladder table)
        gives its plan over those rungs when it has one at its budget; otherwise (and by default) its main plan.

        Raises:
            PlanError: no such file or folder, not JSON, not a plan (one line naming the file and the field).
            DuplicateKeyError: an object names a key twice.
        """
        path = plan_file(path)
        try:
            data = read_json(path)
        except DuplicateKeyError:
            raise
        except (ValueError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: not JSON ({e})") from None
        return cls.from_dict(data, path, rung_set)

    @classmethod
    def from_dict(cls, data: Any, source: str | os.PathLike | None = None,
                  rung_set: Sequence[str] | None = None) -> Plan:
        """:meth:`load` on a file's parsed dict (``source``: the file, for the messages)."""
        src = Path(source) if source is not None else None
        where = str(src) if src is not None else "the plan"
        if not isinstance(data, dict):
            raise PlanError(f"{where}: not a plan (a JSON object with a 'rungs' mapping or a profile's skip_modules)")
        if "schema_version" in data:
            plan = _from_schema(data, where)
        elif "rungs" in data:  # a ladder plan: gnmr-hf profile --low int4, a ladder recipe, or hand-built
            plan = _from_rungs_file(data, where)
        else:
            plan = _from_profile(data, where, rung_set)
        plan.source, plan.data = src, data
        return plan


def ct_weight_args(scheme: str, group_size: int):
    """compressed-tensors' ``QuantizationArgs`` of a scheme's weights (a rung's ``exports["compressed-tensors"]``
    entry; ``"low"`` and ``"int8"`` name the stock two): ``"W4A16"`` (``"low"``) is vLLM's preset, its group size
    set, ``"W8A16"`` (``"int8"``) INT8 per output channel, symmetric; another scheme name is vLLM's preset of that
    name (``preset_name_to_scheme``)."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    scheme = {"low": "W4A16", "int8": "W8A16"}.get(scheme, scheme)
    if scheme == "W8A16":
        return QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)
    args = preset_name_to_scheme(scheme, ["Linear"]).weights
    if scheme not in ("W4A16", "W4A16_ASYM") or args.group_size == group_size:
        return args
    return args.model_copy(update={"group_size": group_size})


# ------------------------------------------------------------------------------------------- schemas


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _build(where: str, **kw: Any) -> Plan:
    try:
        return Plan(**kw)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def _from_schema(data: dict[str, Any], where: str) -> Plan:
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise PlanError(f"{where}: schema_version {version!r} is not one this gnmr_hf reads (it reads {SCHEMA_VERSION})")
    if data.get("kind") != KIND:
        raise PlanError(f"{where}: kind {data.get('kind')!r} is not {KIND!r}")
    for key in ("low", "rungs"):
        if key not in data:
            raise PlanError(f"{where}: missing field {key!r}")
    keep = data.get("keep_modules") or []
    if not isinstance(keep, list) or not all(isinstance(m, str) for m in keep):
        raise PlanError(f"{where}: keep_modules must be a list of module names")
    if data.get("model_identity") is not None and not isinstance(data["model_identity"], dict):
        raise PlanError(f"{where}: model_identity must be an object or null")
    if not isinstance(data.get("chosen_by", {}), dict):
        raise PlanError(f"{where}: chosen_by must be an object")
    rung_set = data.get("rung_set") or ["bf16"]
    if not isinstance(rung_set, list):
        raise PlanError(f"{where}: rung_set must be a list of rungs")
    return _build(where, rungs=data["rungs"], low=data["low"], group_size=_opt_int(data.get("group_size")),
                  groups=_opt_str(data.get("groups")), rung_set=tuple(rung_set), budget=_opt_str(data.get("budget")),
                  budget_bytes=_opt_int(data.get("budget_bytes")), price_bytes=_opt_int(data.get("price_bytes")),
                  model_identity=data.get("model_identity"), chosen_by=dict(data.get("chosen_by") or {}),
                  keep_modules=list(keep), planned=bool(data.get("planned", True)), serve=_opt_str(data.get("serve")))


def _from_rungs_file(data: dict[str, Any], where: str) -> Plan:
    """``gnmr-hf profile --low int4``'s dict, a ladder recipe's, or a hand-built ``{"rungs": {...}}``."""
    rungs = data["rungs"]
    if not isinstance(rungs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rungs.items()):
        raise PlanError(f"{where}: 'rungs' must map linear names to rungs ({', '.join(planned_rungs())})")
    record = data.get("plan") if isinstance(data.get("plan"), dict) else {}
    low = data.get("low", record.get("low", "nf4"))  # a ladder recipe's record says (since issue 59): NF4
    if low in INT4_LOWS:  # gnmr-hf profile --low int4 (--serve: the target's rungs, recorded since issue 60)
        recorded = data.get("rung_set")
        rung_set = tuple(recorded) if isinstance(recorded, list) and recorded else ("int8", "bf16")
        scheme = get_rung(low).exports["compressed-tensors"]
        currency, writer = f"compressed-tensors folder bytes over uniform {scheme}", f"gnmr-hf profile --low {low}"
        price = data.get("price_bytes", record.get("price_bytes"))
    else:
        counts = record.get("rung_counts")
        rung_set = tuple(counts) if isinstance(counts, dict) and counts else \
            tuple(r for r in planned_rungs() if r in rungs.values()) or ("int8", "bf16")
        currency = "memory over the NF4 model" if record else None
        writer = "a ladder recipe" if record else "hand-built"
        price = record.get("price_over_nf4_bytes", record.get("over_low_bytes"))
    chosen = {"writer": writer, "criterion": record.get("criterion", "first_order") if record or low in INT4_LOWS else None,
              "batches": data.get("batches"), "tokens": data.get("tokens"), "policy": record.get("policy"),
              "command": data.get("command"), "currency": currency}
    return _build(where, rungs=dict(rungs), low=low, group_size=_opt_int(data.get("group_size")),
                  groups=_opt_str(data.get("groups", record.get("groups"))), rung_set=rung_set,
                  budget=_opt_str(data.get("budget", record.get("budget"))),
                  budget_bytes=_opt_int(data.get("budget_bytes", record.get("budget_bytes"))),
                  price_bytes=_opt_int(price), model_identity=recorded_identity(data),
                  chosen_by={k: v for k, v in chosen.items() if v is not None}, serve=_opt_str(data.get("serve")))


def _is_old_bench_profile(data: dict[str, Any]) -> bool:
    """The bench's first profile.json files (``criterion``, ``batches``, ``seconds``, ``losses``, ``units`` with a
    ``score``): written before the profile format, and never a plan."""
    units = data.get("units")
    return ("format" not in data and "skip_modules" not in data and "plan" not in data and isinstance(units, list)
            and bool(units) and all(isinstance(u, dict) and "score" in u and "modules" not in u for u in units))


def _from_profile(data: dict[str, Any], where: str, rung_set: Sequence[str] | None) -> Plan:
    """A sensitivity profile: ``gnmr-hf profile``'s, a planned recipe's, or one without a plan."""
    chosen: dict[str, Any] = {"criterion": data.get("criterion"), "batches": data.get("batches"),
                              "tokens": data.get("tokens"), "command": data.get("command")}
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    if meta.get("batch_digests"):
        chosen["batch_digests"] = meta["batch_digests"]
    if _is_old_bench_profile(data):
        chosen["writer"] = "an early bench profile"
        return _build(where, rungs={}, low=_opt_str(data.get("low")) or "nf4", planned=False,
                      chosen_by={k: v for k, v in chosen.items() if v is not None})
    try:
        check_profile_dict(data)  # one line naming a bad field
    except ValueError as e:
        skips = data.get("skip_modules")
        if set(data) == {"skip_modules"} and isinstance(skips, list) and skips and all(isinstance(n, str) for n in skips):
            # a hand-built skip list: every entry on BF16 (lm_head, which a stock load keeps anyway, kept)
            return _build(where, rungs={n: "bf16" for n in skips if n != "lm_head"}, low="nf4",
                          keep_modules=[n for n in skips if n == "lm_head"], chosen_by={"writer": "hand-built"})
        raise PlanError(f"{where}: neither a ladder plan (no 'rungs') nor a profile: {e}") from None
    keep = list(data.get("keep_modules") or [])
    skips = data.get("skip_modules")
    record = data.get("plan") if isinstance(data.get("plan"), dict) else {}
    cli = "command" in data  # gnmr-hf profile records its command
    chosen["writer"] = "gnmr-hf profile" if cli else "a planned recipe" if record else "a profile"
    chosen["criterion"] = chosen["criterion"] or record.get("criterion")
    chosen["policy"] = record.get("policy")
    # gnmr-hf profile records its low format at the top, a planned recipe in its record (since issue 59; an older
    # recipe file says nothing: NF4, the planned recipes' usual base)
    low = _opt_str(data.get("low")) or _opt_str(record.get("low")) or "nf4"
    if isinstance(skips, list) and skips and all(isinstance(n, str) for n in skips):
        names = [n for n in skips if n not in keep]
    elif isinstance(record.get("modules"), list):
        names = [str(n) for n in record["modules"]]
    else:
        return _build(where, rungs={}, low=low, planned=False, keep_modules=keep,
                      model_identity=recorded_identity(data), chosen_by={k: v for k, v in chosen.items() if v is not None})
    if "price_over_nf4_bytes" in record:  # a planned recipe: the one currency
        price, currency = record["price_over_nf4_bytes"], "memory over the NF4 model"
    else:  # gnmr-hf profile: the planner's BF16 bytes
        price, currency = record.get("bytes"), "BF16 bytes of the planned linears"
    chosen["currency"] = currency
    want = tuple(r for r in planned_rungs() if r in (rung_set or ()))
    if want and want != ("bf16",):
        row = _ladder_row(data, want)
        if row is not None:
            chosen.update(currency=f"memory over the {low.upper()} model", writer="gnmr-hf profile (its ladder table)",
                          criterion="first_order")
            return _build(where, rungs=dict(row["rung_of"]), low=low, groups=None, rung_set=want,
                          budget=_opt_str(data.get("budget")), budget_bytes=_opt_int(row.get("budget_bytes")),
                          price_bytes=_opt_int(row.get("price_bytes")), model_identity=recorded_identity(data),
                          chosen_by={k: v for k, v in chosen.items() if v is not None})
    return _build(where, rungs={n: "bf16" for n in names}, low=low, groups=_recorded_groups(data), rung_set=("bf16",),
                  budget=_opt_str(data.get("budget", record.get("budget"))),
                  budget_bytes=_opt_int(record.get("budget_bytes")), price_bytes=_opt_int(price),
                  model_identity=recorded_identity(data), chosen_by={k: v for k, v in chosen.items() if v is not None},
                  keep_modules=keep, serve=_opt_str(data.get("serve", record.get("serve"))))


def _recorded_groups(data: dict[str, Any]) -> str | None:
    """The ``groups`` a profile's plan records (under ``plan``, or at the top); None for a free plan (as
    :func:`gnmr_hf.planning.planner.plan_groups`, which imports this module's neighbours)."""
    for where in (data.get("plan"), data):
        if isinstance(where, dict) and where.get("groups") is not None:
            return str(where["groups"])
    return None


def _ladder_row(data: dict[str, Any], rung_set: tuple[str, ...]) -> dict[str, Any] | None:
    """``gnmr-hf profile``'s ladder-table row over ``rung_set`` at the file's own budget (``+N%nf4``), if any."""
    table = data.get("ladder")
    budget = data.get("budget")
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list) or not isinstance(budget, str):
        return None
    try:
        memory = parse_memory_budget(budget)
    except ValueError:
        return None
    if memory is None or memory[1] != table.get("low"):
        return None
    for row in table["rows"]:
        if (isinstance(row, dict) and row.get("rungs") == "+".join(rung_set) and isinstance(row.get("rung_of"), dict)
                and isinstance(row.get("memory_over_low"), (int, float))
                and abs(row["memory_over_low"] - memory[0]) < 1e-9):
            return row
    return None


def load_plan(path: str | os.PathLike, rung_set: Sequence[str] | None = None) -> Plan:
    """:meth:`Plan.load`."""
    return Plan.load(path, rung_set)


__all__ = ["KIND", "LOWS", "PLAN_FILE", "Plan", "PlanError", "SCHEMA_VERSION", "load_plan", "plan_file",
           "recorded_identity"]
