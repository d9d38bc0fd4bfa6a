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
import importlib.resources
import json
import os
import string
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser, TrainingArguments

from gnmr_hf.core.controller import GNMRConfig
from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl
from gnmr_hf.offline.text_data import text_task
from gnmr_hf.recipe_args import (  # noqa: F401  (re-exported: gnmr_hf.recipe is the recipe format's face)
    BLOCKS,
    GENERATED,
    GNMR_PRECISIONS,
    INT8_PRECISIONS,
    LORA_INITS,
    NF4_PRECISIONS,
    PROFILE_POLICIES,
    SELECTION_KEYS,
    SMOLLM2,
    TEXT,
    GNMRArguments,
    LoraArguments,
    ProfileArguments,
    Recipe,
    RecipeError,
    ScriptArguments,
    _parse_rungs,
    _unknown,
)


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
