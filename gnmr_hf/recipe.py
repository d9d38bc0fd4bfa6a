"""The recipe format: the YAML configuration that ``recipes/finetune.py`` trains from, and its training data.

A recipe is parsed by ``transformers.HfArgumentParser`` into ``TrainingArguments`` and this module's
:class:`ScriptArguments` (model, data, precision), :class:`LoraArguments`, :class:`GNMRArguments` (the
``gnmr:`` block) and :class:`ProfileArguments` (the ``profile:`` block); :func:`load_config` reads a file with
its ``include:`` chain and command-line overrides and refuses what the chosen precision would ignore
(:func:`validate`). :func:`training_rows` is the one way to the tokenised training rows of a recipe's
``dataset`` (generated problems, JSON records or ``text:PATH``): the recipe script and ``gnmr-hf profile``
both read their data through it. :func:`recipes_folder` finds the shipped recipes (package data in a wheel,
``recipes/`` in a clone).
"""

import argparse
import dataclasses
import difflib
import importlib.resources
import json
import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import HfArgumentParser, TrainingArguments

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
            from gnmr_hf.hardware import auto_compute_dtype

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
    def from_dict(cls, block: dict[str, Any], given: dict[str, str] | None = None) -> "GNMRArguments":
        """Parse and validate the block (every value, whatever the precision; see :func:`validate`
        for which keys a precision uses). ``given``: where each key came from (``"in FILE"``, ``"on the
        command line"``; default ``"in the gnmr block"``)."""
        from gnmr_hf.core.controller import GNMRConfig, init_steps_from_fraction

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
    plan: str | None = None
    given: dict[str, str] = field(default_factory=dict)

    @property
    def ladder(self) -> bool:
        """True when a kept linear may run on another rung than BF16 (the precision ladder)."""
        return self.rungs != ("bf16",)

    @classmethod
    def from_dict(cls, block: dict[str, Any], given: dict[str, str] | None = None) -> "ProfileArguments":
        """Parse and check the block (one-line ``RecipeError`` naming the key)."""
        from gnmr_hf.planning import CRITERIA, parse_budget

        known = ["budget", "criterion", "batches", "policy", "gnmr_share", "rungs", "groups", "plan"]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise _unknown([f"profile.{k}" for k in unknown], [f"profile.{k}" for k in known], "in the profile block")
        out = cls(enabled=True, given={k: (given or {}).get(k, "in the profile block") for k in block})
        if "budget" in block:
            out.budget = str(block["budget"])
        try:
            from gnmr_hf.memory import parse_memory_budget

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
            from gnmr_hf.planning.planner import GROUPINGS

            if block["groups"] not in GROUPINGS:
                raise RecipeError(f"profile.groups must be {' or '.join(GROUPINGS)} (whole serving groups: q/k/v of a "
                                  f"layer together, gate/up together) or null (a free plan), got {block['groups']!r}")
            out.groups = block["groups"]
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
            if out.criterion not in (None, "first_order"):
                raise RecipeError(f"profile.rungs [{rungs}] ranks by the first-order gain of each rung; "
                                  f"profile.criterion {out.criterion!r} does not apply")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "given"}


def _parse_rungs(value: Any) -> tuple[str, ...]:
    """``[int8, bf16]`` (a list), ``"int8,bf16"`` (the command line) or ``"bf16"`` -> ``("int8", "bf16")``,
    cheapest first; a one-line ``RecipeError`` for anything else."""
    from gnmr_hf.planning.ladder import RUNGS

    items = [str(v).strip() for v in value] if isinstance(value, (list, tuple)) else \
        [v.strip() for v in str(value).split(",")] if isinstance(value, str) else None
    if not items or any(v not in RUNGS for v in items) or len(set(items)) != len(items):
        raise RecipeError(f"profile.rungs must be a non-empty list of distinct rungs from {', '.join(RUNGS)} "
                          f"(e.g. [int8, bf16]), got {value!r}")
    return tuple(r for r in RUNGS if r in items)


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


class RecipeParser(HfArgumentParser):
    """``HfArgumentParser`` over the recipe's dataclasses that raises instead of printing usage and exiting."""

    def __init__(self) -> None:
        super().__init__((ScriptArguments, LoraArguments, TrainingArguments), prog="finetune.py",
                         allow_abbrev=False,  # "--max_step" is an error, not silently --max_steps
                         description=__doc__.split("\n\n")[0], epilog=_gnmr_help())
        self.add_argument("--config", default=None, help="YAML file of field: value (include: base.yaml)")
        import torch

        # the recipe's own defaults, below the YAML file: without CUDA, use_cpu turns accelerate's
        # multi-process launch into a gloo DDP run; LoRA leaves no parameter of a DDP replica unused
        self.set_defaults(use_cpu=not torch.cuda.is_available(), ddp_find_unused_parameters=False,
                          remove_unused_columns=False, report_to="none", disable_tqdm=False)

    def error(self, message: str):  # argparse's own message ("argument --max_steps: invalid int value ...")
        raise RecipeError(message)

    def known_keys(self) -> list[str]:
        return [a.dest for a in self._actions if a.option_strings and a.dest not in ("help", "config")]

    def given_on_command_line(self, argv: list[str]) -> list[str]:
        """The keys (dataclass field names) ``argv`` sets, under either spelling (``--max_steps``,
        ``--max-steps``, ``--max_steps=3``)."""
        dest = {o: a.dest for a in self._actions for o in a.option_strings if a.dest not in ("help", "config")}
        return [dest[t.split("=", 1)[0]] for t in argv if t.startswith("--") and t.split("=", 1)[0] in dest]


def _gnmr_help() -> str:
    from gnmr_hf.core.controller import GNMRConfig

    names = [f.name for f in dataclasses.fields(GNMRConfig)] + ["init_fraction", "storage", "monitor"]
    return ("gnmr: block (YAML) / --gnmr.KEY value (command line), KEY one of: " + ", ".join(names)
            + "; see gnmr_hf.GNMRConfig and docs/recipes.md")


def read_config_file(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a dict, its ``include:`` chain resolved (the including file's keys win).

    The ``gnmr:`` and ``profile:`` blocks merge key by key, so a variant file can change one value.

    Args:
        path: the YAML file.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"config file {path} not found")
    if path.resolve() in _chain:
        raise RecipeError(f"config include loop: {' -> '.join(str(p) for p in (*_chain, path.resolve()))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a mapping of key: value")
    include = data.pop("include", None)
    if include is None:
        return data
    merged = read_config_file(path.parent / str(include), (*_chain, path.resolve()))
    blocks = {}
    for name in BLOCKS:
        inner, outer = merged.get(name), data.pop(name, None)
        if isinstance(inner, dict) and isinstance(outer, dict):
            blocks[name] = {**inner, **outer}
        elif outer is not None or inner is not None:
            blocks[name] = outer if outer is not None else inner
    merged.update(data)
    merged.update(blocks)
    return merged


def config_sources(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict[str, str]:
    """Which file of ``path``'s include chain set each key (``gnmr.KEY`` for the gnmr block's keys), in
    :func:`read_config_file`'s merge order (the including file wins). Call it on a file that
    :func:`read_config_file` has read (it assumes valid YAML and no include loop)."""
    import yaml

    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    out: dict[str, str] = {}
    if data.get("include") is not None:
        out.update(config_sources(path.parent / str(data["include"]), (*_chain, path.resolve())))
    for key, value in data.items():
        if key in BLOCKS and isinstance(value, dict):
            out.update({f"{key}.{k}": str(path) for k in value})
        elif key != "include":
            out[key] = str(path)
    return out


def _as_argv(key: str, value: Any) -> list[str]:
    """A YAML value as the command-line tokens argparse would see, so both pass the same type checks."""
    if isinstance(value, list):
        return [f"--{key}", *(str(v) for v in value)]
    if isinstance(value, dict):
        return [f"--{key}", json.dumps(value)]  # TrainingArguments reads its dict fields from JSON
    return [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]


def _unknown(keys: list[str], known: list[str], where: str) -> RecipeError:
    hints = []
    for k in keys:
        close = difflib.get_close_matches(k, known, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return RecipeError(f"unknown key(s) {where}: {', '.join(hints)}")


def _split_gnmr_flags(argv: list[str], block_name: str = "gnmr") -> tuple[list[str], dict[str, Any]]:
    """Take ``--gnmr.KEY value`` / ``--gnmr.KEY=value`` (or another block's) out of ``argv``; values are
    read as YAML scalars."""
    import yaml

    prefix = f"--{block_name}."
    rest, block, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(prefix):
            rest.append(arg)
            i += 1
            continue
        key, eq, value = arg[len(prefix):].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise RecipeError(f"{arg} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        try:
            block[key.replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError:
            block[key.replace("-", "_")] = value
    return rest, block


def load_config(argv: list[str]) -> Recipe:
    """The run's configuration: dataclass defaults, then the ``--config`` YAML, then the command line.

    Args:
        argv: the script's arguments (without the program name).

    Raises:
        RecipeError: unknown keys (named, with the closest known one), values of the wrong type or out of
            range, an unknown precision, a missing config file.
    """
    parser = RecipeParser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    config_file = pre.parse_known_args(argv)[0].config
    settings = read_config_file(config_file) if config_file else {}
    gnmr_block = settings.pop("gnmr", None) or {}
    if not isinstance(gnmr_block, dict):
        raise RecipeError(f"gnmr in {config_file} must be a mapping of key: value")
    argv, gnmr_flags = _split_gnmr_flags(argv)
    # which keys were set, and where (defaults are not "given"; see validate)
    sources = config_sources(config_file) if config_file else {}
    gnmr_given = {k: f"in {sources.get(f'gnmr.{k}', config_file)}" for k in gnmr_block}
    gnmr_given.update({k: "on the command line" for k in gnmr_flags})
    gnmr_block.update(gnmr_flags)
    profile_block = settings.pop("profile", None)
    if profile_block is not None and not isinstance(profile_block, dict):
        raise RecipeError(f"profile in {config_file} must be a mapping of key: value")
    argv, profile_flags = _split_gnmr_flags(argv, "profile")
    profile_given = {k: f"in {sources.get(f'profile.{k}', config_file)}" for k in (profile_block or {})}
    profile_given.update({k: "on the command line" for k in profile_flags})
    if profile_block is not None or profile_flags:
        profile = ProfileArguments.from_dict({**(profile_block or {}), **profile_flags}, profile_given)
    else:
        profile = ProfileArguments()

    known = parser.known_keys()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise _unknown(unknown, known, f"in {config_file}")
    tokens: list[str] = []
    for key, value in settings.items():
        if value is None:
            parser.set_defaults(**{key: None})  # argparse has no token for "null"
        else:
            tokens += _as_argv(key, value)
    try:
        *parsed, rest = parser.parse_args_into_dataclasses(tokens + list(argv), return_remaining_strings=True,
                                                           look_for_args_file=False)
    except ValueError as e:  # a dataclass's __post_init__ (TrainingArguments' own checks among them)
        raise RecipeError(str(e).strip().splitlines()[0]) from None
    if rest:
        flags = [r[2:].split("=")[0] for r in rest if r.startswith("--")] or rest
        raise _unknown(flags, known, "on the command line")
    script, lora, training = parsed[:3]
    given = {k: f"in {sources.get(k, config_file)}" for k in settings}
    given.update({k: "on the command line" for k in parser.given_on_command_line(argv)})
    return Recipe(script=script, lora=lora, training=training, gnmr=GNMRArguments.from_dict(gnmr_block, gnmr_given),
                  config_file=config_file, given=given, profile=profile)


# the keys a profile policy overwrites or never reads (gnmr.*), and the profile keys a policy ignores
HYBRID_OVERWRITTEN = ("max_active", "max_active_bytes")
PROFILE_STATIC_ONLY_IGNORED = ("gnmr_share",)


def _refuse_ignored_keys(recipe: Recipe) -> None:
    """Refuse a key the profile's policy would ignore, when the user set it: on the command line, or in the
    file that sets ``profile.policy`` (a key inherited from an included recipe, such as gnmr-nf4.yaml's
    gnmr block under planned-nf4.yaml, is not the user's choice and passes)."""
    prof, gnmr = recipe.profile, recipe.gnmr
    anchor = prof.given.get("policy")

    def by_user(where: str) -> bool:
        return where == "on the command line" or where == anchor

    policy = prof.policy

    def refuse(block: str, given: dict[str, str], candidates, why: str) -> None:
        k = next((k for k in candidates if k in given and by_user(given[k])), None)
        if k is not None:
            raise RecipeError(f"{block}.{k} (set {given[k]}) has no effect with profile.policy {policy}: {why}")

    if prof.enabled and policy == "static":
        refuse("gnmr", gnmr.given, [k for k in gnmr.given if k != "monitor"],
               "the planned set is fixed and no GNMR controller runs; use profile.policy hybrid (GNMR over the "
               "unplanned linears) or gnmr (the paper's controller)")
        refuse("profile", prof.given, PROFILE_STATIC_ONLY_IGNORED, "it splits the budget of profile.policy hybrid")
    if prof.enabled and policy == "hybrid":
        refuse("gnmr", gnmr.given, HYBRID_OVERWRITTEN,
               "GNMR's count and bytes come from the plan (the budget times profile.gnmr_share); set "
               "profile.budget and profile.gnmr_share instead")
    if policy == "gnmr":
        refuse("profile", prof.given, [k for k in prof.given if k != "policy"],
               "no profile is taken (the paper's controller over decoder layers); use profile.policy static or "
               "hybrid to plan")


def validate(recipe: Recipe) -> Recipe:
    """Refuse a setting that ``recipe.script.precision`` would ignore, before anything is loaded (:func:`run`
    calls it first; :func:`load_config` checks each value, this checks them against the precision).

    Raises ``RecipeError`` naming the key, where it was set and the precision. Only keys the config file (or
    a file it includes) or the command line set count, whatever their value (``bnb_4bit_use_double_quant:
    false`` too); defaults never do. The rules:

    - ``bnb_4bit_*``: nf4 and gnmr-nf4 only (the other precisions load no 4-bit weight);
    - the ``gnmr:`` block: gnmr and gnmr-nf4 (where ``monitor: true`` is refused: the callback switches
      layers there); on bf16, int8 and nf4 only with ``monitor: true``, and then not the keys that choose
      or store recovery weights (:data:`SELECTION_KEYS`; ``max_active: 0`` is allowed), since a monitor-only
      run has none; ``monitor: false`` alone is allowed everywhere.

    A monitor-only run gets ``max_active = 0`` (what ``GNMRCallback`` asks of a model without dual-path
    layers), so run.json records the configuration the callback ran with. Returns ``recipe``.
    """
    precision, gnmr = recipe.script.precision, recipe.gnmr
    if recipe.lora.lora_init not in LORA_INITS:
        raise RecipeError(f"lora_init must be one of {', '.join(LORA_INITS)}, got {recipe.lora.lora_init!r}")
    if recipe.lora.lora_init in ("loftq", "calibrated") and precision not in NF4_PRECISIONS:
        raise RecipeError(f"lora_init: {recipe.lora.lora_init} (set {recipe.given.get('lora_init', 'in the recipe')}) needs a 4-bit base "
                          f"(precision nf4 or gnmr-nf4), not {precision}: it starts LoRA from the 4-bit "
                          "quantisation error")
    if recipe.profile.enabled and precision not in GNMR_PRECISIONS:
        where = next(iter(recipe.profile.given.values()), "in the profile block")
        raise RecipeError(f"profile (set {where}) has no effect with precision {precision}: the planned BF16 linears "
                          "need the recovery path of precision gnmr or gnmr-nf4")
    four = [k for k in recipe.given if k.startswith("bnb_4bit_")]
    if four and precision not in NF4_PRECISIONS:
        k = four[0]
        raise RecipeError(f"{k} (set {recipe.given[k]}) has no effect with precision {precision}: it applies to "
                          f"the 4-bit base of precision nf4 or gnmr-nf4 only")
    if precision in GNMR_PRECISIONS:
        _refuse_ignored_keys(recipe)
        if gnmr.monitor:
            raise RecipeError(f"gnmr.monitor: true (set {gnmr.given['monitor']}) has no effect with precision "
                              f"{precision}: its callback switches layers to the recovery path; a monitor-only run is "
                              "precision bf16, int8 or nf4 with gnmr.monitor: true")
        return recipe
    keys = [k for k in gnmr.given if k != "monitor"]
    if keys and not gnmr.monitor:
        k = keys[0]
        raise RecipeError(f"gnmr.{k} (set {gnmr.given[k]}) has no effect with precision {precision}: the gnmr "
                          f"block applies to precision gnmr or gnmr-nf4, or to a monitor-only run (gnmr.monitor: "
                          "true, its statistics settings only)")
    unused = [k for k in keys if k in SELECTION_KEYS and not (k == "max_active" and gnmr.config.max_active == 0)]
    if unused:
        k = unused[0]
        raise RecipeError(f"gnmr.{k} (set {gnmr.given[k]}) has no effect on a monitor-only run (precision "
                          f"{precision}, gnmr.monitor: true): no layer has a recovery path; it applies to "
                          "precision gnmr or gnmr-nf4")
    if gnmr.monitor:
        gnmr.config = dataclasses.replace(gnmr.config, max_active=0)
    return recipe


def recipes_folder(explicit: str | os.PathLike | None = None) -> Path:
    """The recipes folder: ``explicit``, else the one shipped in the package, else a clone's ``recipes/``.

    An installed wheel holds the recipes as the ``gnmr_hf.recipes`` package data (pyproject.toml maps
    it onto ``recipes/``); a clone used through ``PYTHONPATH`` or an editable install has them next to
    the package. ``accelerate launch`` needs them as real files, which both are.

    Raises:
        RecipeError: no folder with ``finetune.py`` and ``smollm2-135m/`` among the candidates.
    """
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = [Path(str(importlib.resources.files("gnmr_hf").joinpath("recipes"))),
                      Path(__file__).resolve().parents[1] / "recipes"]
    for c in candidates:
        if (c / "finetune.py").is_file() and (c / "smollm2-135m").is_dir():
            return c
    where = explicit or " or ".join(str(c) for c in candidates)
    raise RecipeError(f"the recipes folder (finetune.py, smollm2-135m/) was not found in {where}: "
                      "reinstall gnmr_hf, or pass --recipes PATH")


# ----------------------------------------------------------------------------------------------
# the training data

def template_fields(*templates: str) -> list[str]:
    """Names of the ``{field}`` placeholders in str.format templates."""
    fields = []
    for t in templates:
        for _, name, _, _ in string.Formatter().parse(t):
            if name:
                base = name.split(".")[0].split("[")[0]
                if base not in fields:
                    fields.append(base)
    return fields


def load_records(script: ScriptArguments, output_dir: str):
    """The raw training records as a ``datasets.Dataset``."""
    import datasets

    name = script.dataset
    if name == GENERATED:
        from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl

        data_dir = script.data_dir or os.path.join(output_dir, "data")
        folder = write_gsm8k_jsonl(data_dir, n_train=script.num_generated, seed=script.generated_seed)
        ds = datasets.load_dataset("json", data_files=[str(folder / "train.jsonl")], split="train")
    elif os.path.exists(name):
        files = [name]
        if os.path.isdir(name):
            files = sorted(str(p) for p in Path(name).iterdir() if p.suffix in (".json", ".jsonl"))
            if not files:
                raise RecipeError(f"dataset folder {name} holds no .json/.jsonl files")
        try:
            ds = datasets.load_dataset("json", data_files=files, split="train")
        except Exception as e:
            raise RecipeError(f"could not read {name} as JSON lines: {e}") from None
    else:
        try:
            ds = datasets.load_dataset(name, script.dataset_config, split=script.dataset_split)
        except Exception as e:
            raise RecipeError(f"dataset {name!r} not found (not a local file, and datasets gave "
                              f"{type(e).__name__}: {e})") from None
    if script.max_train_examples is not None:
        ds = ds.select(range(min(script.max_train_examples, len(ds))))
    return ds


def text_dataset(script: ScriptArguments, tokenizer):
    """``dataset: text:PATH``: the training blocks of ``gnmr_hf.offline.text_data.text_task`` as a
    ``datasets.Dataset`` (``max_train_examples`` keeps the first blocks), and the split's summary."""
    import datasets

    from gnmr_hf.offline.text_data import text_task

    source = script.dataset[len(TEXT):]
    try:
        train, _, summary = text_task(source, tokenizer, script.max_seq_len)
    except (FileNotFoundError, ValueError) as e:
        raise RecipeError(f"dataset {script.dataset}: {e}") from None
    if script.max_train_examples is not None:
        train = train[: script.max_train_examples]
    return datasets.Dataset.from_list(train), summary


def tokenize_dataset(script: ScriptArguments, records, tokenizer):
    """Token ids and labels: the prompt's labels are -100, so the loss covers only the response."""
    fields = template_fields(script.prompt_template, script.response_template)
    missing = [f for f in fields if f not in records.column_names]
    if missing:
        raise RecipeError(
            f"the dataset has no field(s) {', '.join(map(repr, missing))} used by the prompt/response "
            f"template; its fields are {', '.join(records.column_names)}"
        )
    max_len = script.max_seq_len

    def encode(row: dict[str, Any]) -> dict[str, list[int]]:
        prompt = script.prompt_template.format(**row)
        response = script.response_template.format(**row)
        if script.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
            response = response.lstrip()
        # prompt and response tokenised apart, so the boundary between them is exact
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p + r)[:max_len]
        labels = ([-100] * len(p) + r)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    ds = records.map(encode, remove_columns=records.column_names, desc="tokenizing")
    # a prompt longer than max_seq_len leaves nothing to learn from
    ds = ds.filter(lambda row: any(x != -100 for x in row["labels"]), desc="dropping prompt-only rows")
    if len(ds) == 0:
        raise RecipeError(f"no training example fits max_seq_len={max_len}")
    return ds


def training_rows(script: ScriptArguments, tokenizer, output_dir: str | os.PathLike,
                  limit: int | None = None) -> tuple[Any, dict[str, Any] | None]:
    """A recipe's tokenised training rows (``input_ids``, ``attention_mask``, ``labels``) as a
    ``datasets.Dataset``, and for ``dataset: text:PATH`` the held-out split's summary (else None).

    Generated problems and JSON records: the prompt and response templates over each record, the loss on
    the response only (:func:`tokenize_dataset`; the generated set is written under ``script.data_dir`` or
    ``output_dir/data``). ``text:PATH``: fixed blocks of ``max_seq_len`` tokens, the loss on every token, every
    20th file held out (:func:`text_dataset`). ``limit`` keeps the first rows (tokenising only what that
    needs, give or take the rows a long prompt drops).

    Raises:
        RecipeError: the data cannot be read, lacks a template's field, or leaves no row.
    """
    if script.dataset.startswith(TEXT):
        ds, summary = text_dataset(script, tokenizer)
    else:
        records = load_records(script, str(output_dir))
        if limit is not None:
            records = records.select(range(min(len(records), 4 * limit)))
        ds, summary = tokenize_dataset(script, records, tokenizer), None
    if limit is not None:
        ds = ds.select(range(min(len(ds), limit)))
    return ds, summary
