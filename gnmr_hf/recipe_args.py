"""A recipe's arguments: the dataclasses ``HfArgumentParser`` fills beside ``TrainingArguments``
(:class:`ScriptArguments`: model, data, precision; :class:`LoraArguments`; :class:`GNMRArguments`, the ``gnmr:``
block; :class:`ProfileArguments`, the ``profile:`` block), the :class:`Recipe` that holds them, the precision
names and :class:`RecipeError`. :mod:`gnmr_hf.recipe` parses a file into them (and re-exports every name here)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

from gnmr_hf.core.controller import GNMRConfig, init_steps_from_fraction
from gnmr_hf.hardware import auto_compute_dtype
from gnmr_hf.memory import parse_memory_budget
from gnmr_hf.planning import CRITERIA, parse_budget, planned_rungs
from gnmr_hf.planning.planner import GROUPINGS
from gnmr_hf.serving import ServeError, serve_target

GENERATED = "generated-arithmetic"
TEXT = "text:"  # dataset: text:PATH, plain text (a file, a folder or a glob): gnmr_hf.offline.text_data
SMOLLM2 = "smollm2-135m-instruct"
INT8_PRECISIONS = ("int8", "gnmr")
NF4_PRECISIONS = ("nf4", "gnmr-nf4")
GNMR_PRECISIONS = ("gnmr", "gnmr-nf4")
LORA_INITS = ("default", "loftq", "calibrated")
# gnmr: keys that only choose which layers go to the recovery path, or where its weights live: a monitor-only
# run (no dual path, nothing recoverable) never uses them
SELECTION_KEYS = ("max_active", "lock_steps", "full_recovery_steps", "max_active_bytes", "storage")


class RecipeError(Exception):
    """A problem with the configuration or the inputs: reported as one line, exit code 2."""


def _unknown(keys: list[str], known: list[str], where: str) -> RecipeError:
    hints = []
    for k in keys:
        close = difflib.get_close_matches(k, known, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return RecipeError(f"unknown key(s) {where}: {', '.join(hints)}")


# ----------------------------------------------------------------------------------------------
# configuration: the script's own dataclasses next to TrainingArguments, the gnmr: block, the parser


@dataclass
class ScriptArguments:
    """The model, the data and the precision of the base weights.

    Args:
        model (`str`): a local folder with ``config.json``, a hub id, or an offline alias
            (``"smollm2-135m-instruct"``, ``"gemma3-270m"``: converted once from the packages' GGUF, offline).
        precision (`str`): bf16, int8, gnmr, nf4 or gnmr-nf4 (see the module docstring).
        bnb_4bit_use_double_quant (`bool`): nf4 / gnmr-nf4: quantise the 4-bit scales too (QLoRA's
            double quantisation).
        dataset (`str`): a hub id (``"openai/gsm8k"``), a local .json/.jsonl file or folder of them,
            ``"generated-arithmetic"`` (GSM8K-schema word problems from ``gnmr_hf.offline.gsm8k``), or
            ``"text:PATH"``: plain text (a file, a folder searched recursively, or a glob; e.g. the Python
            docs, ``text:/usr/share/doc/python3.11/html/_sources``) cut into blocks of ``max_seq_len`` tokens
            with the loss on every token, every 20th file held out (``gnmr_hf.offline.text_data``; the
            templates are not used).
        dataset_config (`str`, *optional*): the hub dataset's config name (``"main"`` for openai/gsm8k).
        dataset_split (`str`): the split to train on.
        data_dir (`str`, *optional*): where generated-arithmetic writes its files; default
            ``{output_dir}/data``.
        num_generated (`int`): training problems for generated-arithmetic.
        generated_seed (`int`): the seed of the generated problems (TrainingArguments' ``data_seed`` is
            the sampler's).
        max_train_examples (`int`, *optional*): keep only the first N records.
        prompt_template (`str`), response_template (`str`): ``str.format`` templates over a record's
            fields; the loss covers the response only.
        chat_template (`bool`): wrap the prompt as a user turn with the tokenizer's chat template.
        max_seq_len (`int`): tokens per example (prompt + response), truncated beyond.
        compute_dtype (`str`): ``bfloat16`` (the paper's setting), ``float32`` or ``float16``: the dtype the
            model is loaded and computed in (unquantised weights, 4-bit compute dtype, recovery path).
            On CPUs without BF16 matrix units a float32 step is several times faster.
    """

    model: str = field(default=SMOLLM2, metadata={"help": "local folder, hub id, or an offline alias: "
                                                           "smollm2-135m-instruct, gemma3-270m"})
    precision: Literal["bf16", "int8", "gnmr", "nf4", "gnmr-nf4"] = field(
        default="bf16", metadata={"help": "base weights: bf16, int8, gnmr (INT8 + GNMR), nf4, gnmr-nf4"})
    bnb_4bit_use_double_quant: bool = field(default=False, metadata={"help": "nf4: double quantisation"})
    dataset: str = field(default=GENERATED, metadata={"help": "hub id, .json/.jsonl file or folder, or "
                                                              "generated-arithmetic"})
    dataset_config: str | None = field(default=None, metadata={"help": "hub dataset config name"})
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    data_dir: str | None = field(default=None, metadata={"help": "generated data folder ({output_dir}/data)"})
    num_generated: int = field(default=512, metadata={"help": "generated-arithmetic: training problems"})
    generated_seed: int = field(default=0, metadata={"help": "generated-arithmetic: seed of the problems"})
    max_train_examples: int | None = field(default=None, metadata={"help": "keep only the first N records"})
    prompt_template: str = field(default="Question: {question}\nAnswer:", metadata={"help": "str.format template"})
    response_template: str = field(default=" {answer}", metadata={"help": "str.format template (the loss)"})
    chat_template: bool = field(default=False, metadata={"help": "prompt as a chat user turn"})
    max_seq_len: int = field(default=512, metadata={"help": "tokens per example"})
    compute_dtype: Literal["bfloat16", "float32", "float16", "auto"] = field(
        default="bfloat16", metadata={"help": "dtype the model is loaded and computed in: the unquantised weights, "
                                              "the 4-bit compute dtype and the recovery path (float32 is several "
                                              "times faster on CPUs without BF16 matrix units; auto: bfloat16 where "
                                              "the hardware has BF16 units, else float32, see gnmr_hf.hardware)"})

    def __post_init__(self) -> None:
        for name in ("num_generated", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_train_examples is not None and self.max_train_examples < 1:
            raise ValueError(f"max_train_examples must be >= 1 or null, got {self.max_train_examples}")
        if self.compute_dtype == "auto":  # resolved here, so the run and run.json see the dtype it chose
            self.compute_dtype, reason = auto_compute_dtype()
            print(f"compute_dtype auto -> {self.compute_dtype}: {reason}", flush=True)


@dataclass
class LoraArguments:
    """The LoRA adapter (``peft.LoraConfig``), with TRL's script names.

    Args:
        lora_r (`int`): the rank r.
        lora_alpha (`int`): the scaling numerator alpha (the update is scaled by alpha / r).
        lora_dropout (`float`): dropout on the adapter's input.
        lora_target_modules (`list[str]`): names of the linear layers that get an adapter.
        lora_init (`str`): ``default`` (PEFT's: A random, B = 0) or ``loftq`` (4-bit bases: each pair on a
            linear that stays quantised starts from the rank-r SVD of its quantisation residual, PEFT's
            ``replace_lora_weights_loftq`` through ``gnmr_hf.loftq``; a planned linear on BF16 keeps the default)
            or ``calibrated`` (4-bit bases: each such pair set in closed form to minimise its linear's output
            error against the BF16 weight on the first ``profile.batches`` training batches, CLoQ / QERA,
            ``gnmr_hf.calibrated_init``; planned linears keep the default).
    """

    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "modules that get an adapter"})
    lora_init: str = field(default="default", metadata={
        "help": "default (A random, B = 0), loftq (4-bit bases: LoftQ on the linears that stay quantised) or "
                "calibrated (4-bit bases: closed-form output-error init on the profile batches)"})


@dataclass
class GNMRArguments:
    """The ``gnmr:`` block: a ``gnmr_hf.GNMRConfig`` plus what the recipe does with it.

    Args:
        config (`gnmr_hf.GNMRConfig`): from the block's remaining keys (``GNMRConfig.from_dict``).
        init_fraction (`float`, *optional*): the initial-threshold phase as a fraction of the run's
            steps; ``GNMRCallback`` turns it into ``init_steps`` once ``max_steps`` is known.
        storage (`str`): where the BF16 recovery weights live: host, device or disk.
        monitor (`bool`): on a bf16/int8/nf4 run, attach the callback monitor-only (a per-layer trace).
        given (`dict[str, str]`): the block's keys set in the config file or on the command line (not
            defaults), each with where it came from (``"in FILE"``, ``"on the command line"``);
            :func:`validate` reads it.
    """

    config: Any
    init_fraction: float | None = None
    storage: str = "host"
    monitor: bool = False
    given: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, block: dict[str, Any], given: dict[str, str] | None = None) -> GNMRArguments:
        """Parse and validate the block (every value, whatever the precision; see :func:`validate`
        for which keys a precision uses). ``given``: where each key came from (``"in FILE"``, ``"on the
        command line"``; default ``"in the gnmr block"``)."""
        given = {k: (given or {}).get(k, "in the gnmr block") for k in block}
        block = dict(block)
        own = {k: block.pop(k) for k in ("init_fraction", "storage", "monitor") if k in block}
        known = [f.name for f in dataclasses.fields(GNMRConfig)] + ["init_fraction", "storage", "monitor"]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise _unknown([f"gnmr.{k}" for k in unknown], [f"gnmr.{k}" for k in known], "in the gnmr block")
        try:
            config = GNMRConfig.from_dict(block)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"gnmr: {e}") from None
        if own.get("storage", "host") not in ("host", "device", "disk"):
            raise RecipeError(f"gnmr.storage must be host, device or disk, got {own['storage']!r}")
        if not isinstance(own.get("monitor", False), bool):
            raise RecipeError(f"gnmr.monitor must be true or false, got {own['monitor']!r}")
        if own.get("init_fraction") is not None:
            try:  # GNMRCallback's own rule, here so that it fails before the model is loaded
                init_steps_from_fraction(own["init_fraction"], 0)
            except ValueError as e:
                raise RecipeError(f"gnmr.{e}") from None
            if config.init_steps:
                raise RecipeError(f"gnmr: give init_fraction ({own['init_fraction']}) or init_steps "
                                  f"({config.init_steps}), not both")
        return cls(config=config, given=given, **own)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.config), "init_fraction": self.init_fraction, "storage": self.storage,
                "monitor": self.monitor}


# gnmr: the paper's controller over decoder layers (the gnmr block), no profile: the rest of the block is inert
PROFILE_POLICIES = ("static", "hybrid", "gnmr")
BLOCKS = ("gnmr", "profile")  # the config file's nested blocks (merged key by key through include:)


@dataclass
class ProfileArguments:
    """The ``profile:`` block (precision gnmr or gnmr-nf4): before training, measure where the low-cost
    path's error is on the first ``batches`` training batches (``gnmr_hf.profile_sensitivity``, every
    quantised linear its own unit), plan the linears to keep on BF16 within ``budget`` (greedy by score
    per byte), and train with that plan.

    Args:
        budget (`str`): what the plan may add to the served model over the all-NF4 model, whatever the
            compute dtype (the one budget currency, docs/profile.md): ``"+10%nf4"`` (of the NF4 model), a size
            (``"300MB"``) or a share (``"10%"``, ``0.1``) of what keeping every quantised linear on BF16 adds;
            see ``gnmr_hf.planning.budget.served_budget``.
        criterion (`str`): the profile criterion (``gnmr_hf.planning.CRITERIA``; default its default).
        batches (`int`): training batches to profile on.
        policy (`str`): ``static``: the planned set on BF16 at every step (``gnmr_hf.StaticPolicy``);
            ``hybrid``: the planned set within ``1 - gnmr_share`` of the budget, and GNMR (the ``gnmr:``
            block's thresholds, locks and window) over the other linears with the rest
            (``gnmr_hf.HybridPolicy``); ``gnmr``: no profile at all, the paper's controller over decoder
            layers as the ``gnmr:`` block configures it (the run is the plain gnmr / gnmr-nf4 recipe's).
        gnmr_share (`float`): hybrid: the share of the budget GNMR gets.
        rungs (`tuple[str, ...]`): what a kept linear may run on: ``("bf16",)`` (the default: the plan
            above), or the precision ladder, ``("int8", "bf16")`` (``[int8, bf16]`` in a file, ``int8,bf16``
            on the command line): each linear on NF4, INT8 or BF16, chosen by the first-order gain of each
            rung per byte (``gnmr_hf.planning.ladder``) under ``budget`` written as memory over the NF4
            model (``+10%nf4``); ``("int8",)`` the same with the INT8 rung only. Policy static only.
        groups (`str | None`): ``None`` (the default: a free plan, linear by linear) or ``"vllm"``: buy whole
            serving groups, q/k/v of a layer together and gate/up together, as vLLM fuses them (the layout
            read from the model's architecture, ``gnmr_hf.planning.groups``; an unknown one refused in one
            line), for the BF16-only plan and the ladder (one rung per group), so the plan can be served by
            vLLM (docs/profile.md, "Grouped plans").
        serve (`str | None`): the server the run will be exported for (``gnmr_hf.serving.TARGETS``: ``vllm-gpu``,
            ``vllm-cpu``, ``transformers``, ``gguf``, ``bitsandbytes``; docs/serving.md): the plan buys only the
            rungs it serves (``rungs`` narrowed to them: a ladder recipe for vllm-cpu or bitsandbytes plans BF16
            only; a rung it does not serve set on the command line is refused) and keeps the groups it fuses
            (``groups: vllm`` for the vLLM targets; ``groups: null`` refused); the plan records it, and
            ``gnmr-hf export --plan`` writes the target's format for it and refuses another. Policy static only.
        plan (`str | None`): a plan to train with as saved (``--profile.plan PATH``: a ``profile.json`` or the
            folder holding one, from ``gnmr-hf profile`` or an earlier planned run; ``gnmr_hf.planning.Plan``):
            nothing is profiled; a plan of another model, low format, group size, rung set or grouping is
            refused in one line before training. Policy static only.
        given (`dict[str, str]`): the keys set in a file or on the command line, and where.
    """

    enabled: bool = False
    budget: str = "10%"
    criterion: str | None = None
    batches: int = 2
    policy: str = "static"
    gnmr_share: float = 0.25
    rungs: tuple[str, ...] = ("bf16",)
    groups: str | None = None
    serve: str | None = None
    plan: str | None = None
    given: dict[str, str] = field(default_factory=dict)

    @property
    def ladder(self) -> bool:
        """True when a kept linear may run on another rung than BF16 (the precision ladder)."""
        return self.rungs != ("bf16",)

    @classmethod
    def from_dict(cls, block: dict[str, Any], given: dict[str, str] | None = None) -> ProfileArguments:
        """Parse and check the block (one-line ``RecipeError`` naming the key)."""
        known = ["budget", "criterion", "batches", "policy", "gnmr_share", "rungs", "groups", "serve", "plan"]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise _unknown([f"profile.{k}" for k in unknown], [f"profile.{k}" for k in known], "in the profile block")
        out = cls(enabled=True, given={k: (given or {}).get(k, "in the profile block") for k in block})
        if "budget" in block:
            out.budget = str(block["budget"])
        try:
            memory = parse_memory_budget(out.budget)  # "+10%nf4": memory over the all-NF4 model
            if memory is not None and memory[1] != "nf4":
                raise ValueError(f"budget {out.budget!r} is memory over the {memory[1]} model; the recipes' "
                                 "planned runs have an NF4 base: write +N%nf4")
            if memory is None:
                parse_budget(out.budget)
        except ValueError as e:
            raise RecipeError(f"profile.{e}") from None
        if block.get("criterion") is not None:
            if block["criterion"] not in CRITERIA:
                raise RecipeError(f"profile.criterion must be one of {', '.join(CRITERIA)}, got {block['criterion']!r}")
            out.criterion = block["criterion"]
        if "batches" in block:
            if isinstance(block["batches"], bool) or not isinstance(block["batches"], int) or block["batches"] < 1:
                raise RecipeError(f"profile.batches must be an integer >= 1, got {block['batches']!r}")
            out.batches = block["batches"]
        if "policy" in block:
            if block["policy"] not in PROFILE_POLICIES:
                raise RecipeError(f"profile.policy must be static, hybrid or gnmr, got {block['policy']!r}")
            out.policy = block["policy"]
            out.enabled = out.policy != "gnmr"  # gnmr: no profile, the paper's controller exactly
        if "gnmr_share" in block:
            share = block["gnmr_share"]
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
                raise RecipeError(f"profile.gnmr_share must be a number in (0, 1), got {share!r}")
            out.gnmr_share = float(share)
        if "rungs" in block:
            out.rungs = _parse_rungs(block["rungs"])
        if block.get("groups") is not None:
            if block["groups"] not in GROUPINGS:
                raise RecipeError(f"profile.groups must be {' or '.join(GROUPINGS)} (whole serving groups: q/k/v of a "
                                  f"layer together, gate/up together) or null (a free plan), got {block['groups']!r}")
            out.groups = block["groups"]
        if block.get("serve") is not None:
            _apply_serve(out, block)
        if block.get("plan") is not None:
            if not isinstance(block["plan"], (str, os.PathLike)) or not str(block["plan"]).strip():
                raise RecipeError(f"profile.plan must be a path (a profile.json or its folder), got {block['plan']!r}")
            out.plan = str(block["plan"])
            if out.policy != "static":
                raise RecipeError(f"profile.plan trains with a saved plan at every step: it needs profile.policy "
                                  f"static, got {out.policy}")
            typed = [k for k in ("budget", "criterion", "batches") if out.given.get(k) == "on the command line"]
            if typed:
                raise RecipeError(f"profile.{typed[0]} (set on the command line) has no effect with profile.plan: the "
                                  "plan is used as saved, nothing is profiled (profile again to change it)")
        if out.ladder and out.enabled:  # policy gnmr takes no profile: the paper's controller, one line away
            rungs = ", ".join(out.rungs)
            if memory is None:
                raise RecipeError(f"profile.rungs [{rungs}] plans under memory over the NF4 model: write profile.budget "
                                  f"as +N%nf4 (e.g. +10%nf4), not {out.budget!r}")
            if out.policy != "static":
                raise RecipeError(f"profile.rungs [{rungs}] needs profile.policy static (the ladder's rungs are fixed "
                                  f"for the run), got {out.policy}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "given"}


def _apply_serve(out: ProfileArguments, block: dict[str, Any]) -> None:
    """``profile.serve``: the recipe's rungs narrowed to those the target serves (a ladder recipe for vLLM's CPU
    build plans BF16 groups) and the target's groups, or one ``RecipeError`` line for a target not known, a rung it
    cannot load asked for on the command line (or no rung left), a free plan it cannot load, or a policy that is
    not static."""
    try:
        target = serve_target(str(block["serve"]))
    except ServeError as e:
        raise RecipeError(f"profile.serve: {e}") from None
    if out.policy != "static":
        raise RecipeError(f"profile.serve {target.name} plans the set that server loads, fixed for the run: it needs "
                          f"profile.policy static, got {out.policy}")
    bad = [r for r in out.rungs if r not in target.rungs]
    if bad and (out.given.get("rungs") == "on the command line" or len(bad) == len(out.rungs)):
        raise RecipeError(f"profile.rungs [{', '.join(out.rungs)}]: {target.name} does not serve "
                          f"{', '.join(bad)} (its rungs: {', '.join(target.rungs)}; {target.evidence})")
    out.rungs = tuple(r for r in out.rungs if r in target.rungs)  # a recipe file's ladder narrowed to the server's
    if target.groups:
        if "groups" in block and block["groups"] != target.groups:
            raise RecipeError(f"profile.groups null: {target.name} fuses q/k/v and gate/up, each group on one rung, so "
                              "a free plan splits groups it cannot load (profile.serve keeps whole groups; drop "
                              "profile.groups)")
        out.groups = target.groups
    out.serve = target.name


def _parse_rungs(value: Any) -> tuple[str, ...]:
    """``[int8, bf16]`` (a list), ``"int8,bf16"`` (the command line) or ``"bf16"`` -> ``("int8", "bf16")``,
    cheapest first; any rung registered as a planned rung (:func:`gnmr_hf.rungs.planned_rungs`: the stock ``int8``
    and ``bf16`` and any a user registers; :mod:`gnmr_hf.planning` re-exports it) is taken; a one-line ``RecipeError`` naming the registered ones for
    anything else."""
    registered = planned_rungs()
    items = [str(v).strip() for v in value] if isinstance(value, (list, tuple)) else \
        [v.strip() for v in str(value).split(",")] if isinstance(value, str) else None
    if not items or any(v not in registered for v in items) or len(set(items)) != len(items):
        raise RecipeError(f"profile.rungs must be a non-empty list of distinct rungs from {', '.join(registered)} "
                          f"(the registered ones; e.g. [int8, bf16]), got {value!r}")
    return tuple(r for r in registered if r in items)


@dataclass
class Recipe:
    """Everything one run needs, parsed and validated (see :func:`load_config`).

    ``given`` maps every ScriptArguments / LoraArguments / TrainingArguments key set in the config file (or
    a file it includes) or on the command line to where it came from; the others are defaults.
    """

    script: ScriptArguments
    lora: LoraArguments
    training: TrainingArguments
    gnmr: GNMRArguments
    config_file: str | None = None
    given: dict[str, str] = field(default_factory=dict)
    profile: ProfileArguments = field(default_factory=ProfileArguments)
