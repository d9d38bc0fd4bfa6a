"""A checkpoint anyone can load: the planned mixed model as a pre-quantised bitsandbytes folder.

``export_planned(model_path, profile_json, out_dir)`` (and ``gnmr-hf export``) writes a folder that stock
``AutoModelForCausalLM.from_pretrained(folder)`` loads with no arguments as the planned mixed model: the
quantised linears in bitsandbytes' 4-bit (NF4 / FP4) or INT8 serialisation, the planned linears (and
``lm_head``) in BF16, ``config.json``'s ``quantization_config`` listing them in ``llm_int8_skip_modules``
by full dotted name, the tokenizer, and a model card (``README.md``). It is the layout of the
pre-quantised ``*-bnb-4bit`` checkpoints practitioners share.

Who loads what (``target``, ``--target``; the skip list is matched by each loader against its *own*
module names):

- **transformers** (``from_pretrained(folder)``): every kept linear is listed by its full dotted name
  (``model.layers.1.self_attn.v_proj``), which selects exactly that module under transformers' rule (an
  entry matches from the start of a name up to a module boundary, as a regex, or as a suffix:
  :func:`transformers_selects`), so ``layers.1`` never catches ``layers.11``.
- **vLLM** fuses q/k/v into one ``...self_attn.qkv_proj`` and gate/up into one ``...mlp.gate_up_proj``
  (:mod:`gnmr_hf.planning.groups`: the layout per architecture) and keeps a module unquantised when a skip
  entry equals one of its dotted components or leading dotted parts (``is_layer_skipped_bnb``): a leaf name
  such as ``...v_proj`` matches no vLLM module. So ``target="vllm"`` (the default) also lists, for every
  kept fused group, the fused name vLLM matches (``model.layers.1.self_attn.qkv_proj``,
  ``model.layers.1.mlp.gate_up_proj``); o_proj and down_proj are their own groups. transformers matches no
  module by these aliases (checked at export time), so they change nothing it keeps. A fused module has one
  quantisation, so a plan that keeps part of a group (``v_proj`` but not ``q_proj``) cannot be served by
  vLLM: it is refused for ``target="vllm"`` in one line naming the split groups (the fix: a grouped plan,
  ``groups='vllm'``), and a model whose fused layout is unknown is refused likewise.
- ``target="transformers"`` writes the leaf names only, whatever the grouping: a folder for transformers
  (and PEFT on top) only, which its model card states; vLLM cannot load it.

:func:`selected_by` applies transformers' rule and the plain dotted-prefix rule to a list of names;
:func:`serving_skip_entries` builds the vLLM list and checks both rules on both name sets; the tests
(tests/test_export_vllm.py) check every exported entry per architecture, and load the folder.

``merge=True`` writes a merged BF16 model instead: the adapter folded into the original BF16 weights (not
into the quantised ones), the portable route for a server without bitsandbytes. It takes a precision-ladder
plan too (INT8 rungs; the plan's names are only checked against the model), which the bitsandbytes folder
refuses: one bitsandbytes checkpoint holds one low precision.

``gnmr-hf export --format compressed-tensors`` writes the plan (a ladder or a BF16-only plan, with the adapter
merged first when one is given) through :func:`gnmr_hf.export_ct.export_compressed_tensors` instead: INT4 /
INT8 / BF16 per linear in one checkpoint that stock ``from_pretrained`` and vLLM load (``--group-size``: the
INT4 group, 128 by default).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from gnmr_hf.export_folder import (
    ExportError,
    OutputFolderError,
    check_model_folder,
    check_output,
    check_sources,
    model_name,
    plan_file,
    staged_output,
)

QUANTS = ("nf4", "fp4", "int8")
TARGETS = ("vllm", "transformers")  # which server's module names the skip list is written for
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def transformers_selects(entry: str, name: str) -> bool:
    """transformers' ``should_convert_module`` rule (5.x): ``entry`` keeps ``name`` unquantised."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return bool(re.match(rf"(?:{entry}){boundary}", name)) or name.endswith(entry)


def vllm_selects(entry: str, name: str) -> bool:
    """vLLM's rule for ``llm_int8_skip_modules`` (:func:`gnmr_hf.planning.groups.is_layer_skipped_bnb`): ``entry``
    equals a dotted component of ``name`` or one of its leading dotted parts. Meaningful on vLLM's module
    names (fused ``qkv_proj`` / ``gate_up_proj``); on transformers' names it is the dotted-prefix part only."""
    from gnmr_hf.planning.groups import is_layer_skipped_bnb

    return is_layer_skipped_bnb(name, [entry])


def selected_by(entry: str, names: list[str]) -> dict[str, list[str]]:
    """The module names ``entry`` selects under each rule."""
    return {"transformers": [n for n in names if transformers_selects(entry, n)],
            "vllm": [n for n in names if vllm_selects(entry, n)]}


def serving_skip_entries(skips: list[str], model: Any, target: str = "vllm") -> dict[str, Any]:
    """The ``llm_int8_skip_modules`` to write for ``target``, checked against both loaders' rules.

    Args:
        skips: the plan's list (full dotted transformers names: its kept linears and ``keep_modules``).
        model: the transformers model (a meta-device one serves) the plan is for.
        target: ``"vllm"`` (the list also holds the fused alias of every kept group; a split plan or an unknown
            fused layout raises) or ``"transformers"`` (the list as it is; the split groups are reported).

    Returns:
        ``entries`` (the list to write), ``aliases`` (the fused names added), ``split`` (the vLLM names of the
        groups the plan splits; None when the layout is unknown and ``target`` is transformers).

    Raises:
        ExportError: one line: a split plan or an unknown layout for vLLM, or an entry that would select
            something else than meant under transformers' rule (transformers' names) or vLLM's (vLLM's names).
    """
    from gnmr_hf.planning.groups import (
        ServingLayoutError,
        describe_split,
        is_layer_skipped_bnb,
        serving_groups,
        split_groups,
        vllm_skip_entries,
    )

    if target not in TARGETS:
        raise ExportError(f"target {target!r}: one of {', '.join(TARGETS)}")
    try:
        groups = serving_groups(model)
    except ServingLayoutError as e:
        if target == "vllm":
            raise ExportError(f"{e}: no folder vLLM can load is known for it; pass --target transformers "
                              "(target='transformers') for a folder transformers loads") from None
        return {"entries": list(skips), "aliases": [], "split": None}
    members = {m for g in groups for m in g.members}
    kept = [s for s in skips if s in members]
    split = split_groups(kept, groups)
    if split and target == "vllm":
        rungs = {n: "bf16" for n in kept}
        raise ExportError(f"the plan splits {len(split)} serving group(s) that vLLM fuses into one module, so vLLM "
                          f"cannot load it: {describe_split(split, rungs)}; make a grouped plan (groups='vllm') that "
                          "keeps whole groups, or pass --target transformers (target='transformers') for a "
                          "transformers-only folder")
    aliases = [a for a in vllm_skip_entries(kept, groups) if a not in skips] if target == "vllm" else []
    entries = list(skips) + aliases
    # transformers' rule on transformers' names: each leaf name selects itself, each alias nothing
    names = [n for n, _ in model.named_modules() if n]
    for entry in entries:
        hits = [n for n in names if transformers_selects(entry, n)]
        if hits != ([] if entry in aliases else [entry]):
            raise ExportError(f"skip entry {entry!r} selects {hits[:3]} under transformers' rule (meant: "
                              f"{'nothing' if entry in aliases else entry})")
    # vLLM's rule on vLLM's names: exactly the fully kept groups stay unquantised
    if target == "vllm":
        wrong = [g.name for g in groups if is_layer_skipped_bnb(g.name, entries) != all(m in kept for m in g.members)]
        if wrong:
            raise ExportError(f"the skip list does not keep exactly the planned groups under vLLM's rule: {wrong[:3]}")
    return {"entries": entries, "aliases": aliases, "split": [g.name for g in split]}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


#: why a ladder plan (INT8 rungs) gets no bitsandbytes folder, and where it goes instead
LADDER_BNB = ("bitsandbytes' format holds one low precision per checkpoint (no stock loader mixes its 4- and 8-bit "
              "linears): export it with --format compressed-tensors (INT4 / INT8 / BF16 per linear, loaded by stock "
              "from_pretrained and by vLLM), or the merged BF16 model with --merge --adapter DIR; "
              "gnmr_hf.load_planned(model_path, profile.json) loads it as trained")


def _read_plan(profile_json: str | os.PathLike, ladder: bool = False) -> tuple[list[str], dict[str, Any]]:
    """``(skip_modules, data)`` of a BF16-only plan; with ``ladder`` (``--merge``, which only needs the plan's
    names checked against the model) a ladder plan's ``rungs`` names too."""
    path = plan_file(profile_json)
    from gnmr_hf.planning import SensitivityProfile
    from gnmr_hf.planning.ladder import int8_rungs
    from gnmr_hf.strict_json import read_json

    try:
        data = read_json(path)  # gnmr_hf.strict_json: a key named twice is refused
    except ValueError:
        data = None  # SensitivityProfile.from_json says what is wrong with it, in one line
    if isinstance(data, dict) and data.get("low") == "int4":
        from gnmr_hf.export_ct import INT4_PROFILE

        raise ExportError(f"{path} was {INT4_PROFILE}")
    if isinstance(data, dict) and "schema_version" in data:  # a file Plan.save wrote: its skip list, derived
        from gnmr_hf.planning.plan import Plan, PlanError

        try:
            plan = Plan.from_dict(data, path).require_planned()
            if ladder and plan.rungs:
                return sorted(plan.rungs), data
            return plan.skip_modules(), data
        except PlanError as e:
            raise ExportError(str(e) if "INT8" not in str(e) else f"{e}; {LADDER_BNB}") from None
    int8 = int8_rungs(data)
    if int8 and ladder:
        return sorted(data["rungs"]), data
    if int8:
        raise ExportError(f"{path} is a precision-ladder plan with {len(int8)} INT8 linears (e.g. {int8[0]}): "
                          f"{LADDER_BNB}")
    try:
        SensitivityProfile.from_json(path)  # validates the fields (one-line errors naming them)
    except ValueError as e:
        raise ExportError(str(e)) from None
    skips = data.get("skip_modules")
    if not isinstance(skips, list) or not all(isinstance(s, str) for s in skips) or not skips:
        raise ExportError(f"{path} has no skip_modules list: make it with gnmr-hf profile --budget")
    return skips, data


def export_planned(model_path: str | os.PathLike, profile_json: str | os.PathLike, out_dir: str | os.PathLike,
                   quant: str = "nf4", adapter: str | os.PathLike | None = None, merge: bool = False,
                   force: bool = False, double_quant: bool = False, model_name: str | None = None,
                   target: str = "vllm") -> dict[str, Any]:
    """Write the planned mixed model (or, with ``merge``, the merged BF16 model) to ``out_dir``.

    ``target``: ``"vllm"`` (default) writes a folder both transformers and vLLM load (the skip list holds the
    fused alias of every kept group; a plan that splits a group vLLM fuses is refused), ``"transformers"`` a
    folder for transformers only (the plan's leaf names; any grouping; the card says so). See the module
    docstring. Ignored with ``merge`` (a plain BF16 checkpoint every server loads).

    Returns a summary: the folder, its size on disk, the all-low and BF16 sizes for comparison, the kept
    modules. Bad input raises :class:`ExportError` before anything is written. ``out_dir`` follows
    :mod:`gnmr_hf.export_folder`'s contract: never the model folder, the adapter's or the profile's folder,
    the current folder or a folder holding any of them; ``force`` replaces only an earlier export (it holds
    ``.gnmr_export.json``); the folder is built beside ``out_dir`` and renamed into place (an earlier export
    renamed aside and removed last), so an interrupted export leaves the old one intact and no half-written
    folder. ``model_name``: how the model card names the source (default: its offline alias or folder name,
    never an absolute path).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.memory import model_bytes

    if quant not in QUANTS:
        raise ExportError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    if target not in TARGETS:
        raise ExportError(f"target {target!r}: one of {', '.join(TARGETS)}")
    model_path, out_dir = Path(model_path), Path(out_dir)
    check_model_folder(model_path)
    skips, profile = _read_plan(profile_json, ladder=merge)
    if merge and adapter is None:
        raise ExportError("--merge folds an adapter into the BF16 weights: give --adapter DIR")
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ExportError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    plan_path = Path(profile_json)
    protect = [("model folder", model_path, True),
               ("profile's folder", plan_path if plan_path.is_dir() else plan_path.parent, False)]
    if adapter is not None:
        protect.append(("adapter folder", Path(adapter), True))
    try:
        out_dir = check_output(out_dir, force=force, protect=protect)
    except OutputFolderError as e:
        raise ExportError(str(e)) from None
    name = model_name or source_name(model_path)

    # the plan must name this model's linears: every entry selects exactly one module, under both rules
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = [n for n, _ in meta.named_modules() if n]
    linears = {n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)}
    for entry in skips:
        sel = selected_by(entry, names)
        if entry not in names:
            raise ExportError(f"the plan names {entry!r}, which is not a module of {model_path} "
                              f"({len(linears)} linears, e.g. {sorted(linears)[0]}): a plan made for another model?")
        if sel["transformers"] != [entry] or sel["vllm"] != [entry]:
            raise ExportError(f"skip entry {entry!r} selects {sel} (not exactly itself)")
    # the list each loader matches against its own module names (vLLM: the fused aliases; a split plan refused)
    serving = {"entries": skips, "aliases": [], "split": []} if merge else serving_skip_entries(skips, meta, target)
    from gnmr_hf.memory import predict_model_bytes

    low = "nf4" if merge else quant
    all_low_bytes = predict_model_bytes(meta, sorted(n for n in linears if ".layers." in n), low,
                                        double_quant=double_quant)["total"]
    units = profile.get("units", [])
    decoder_linears = [n for n in linears if ".layers." in n]
    if units and len(units) != len(decoder_linears) and len(units) != meta.config.num_hidden_layers:
        raise ExportError(f"the profile has {len(units)} units; {model_path} has {len(decoder_linears)} decoder "
                          f"linears and {meta.config.num_hidden_layers} layers: a profile of another model")
    # the plan's recorded model identity and the adapter's shapes, as load_planned / gnmr-hf eval check them
    check_sources(model_path, plan_file(profile_json), profile, adapter, meta)
    del meta

    entries = serving["entries"]
    marker = {"model": name, "kind": "merged-bf16" if merge else quant, "skip_modules": skips,
              "target": None if merge else target, "llm_int8_skip_modules": None if merge else entries}
    with staged_output(out_dir, marker) as tmp:
        if merge:
            import peft

            base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
            merged = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
            merged.save_pretrained(tmp)
            held = model_bytes(merged)
            kind = "merged BF16 (adapter folded into the original weights)"
        else:
            if quant == "int8":
                q = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=entries)
            else:
                q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                                       bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=double_quant,
                                       llm_int8_skip_modules=entries)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, quantization_config=q)
            model.save_pretrained(tmp)
            held = model_bytes(model)
            kind = f"{quant.upper()} with the plan on BF16"
            if adapter is not None:
                shutil.copytree(adapter, tmp / "adapter")
                name_adapter_base(tmp / "adapter", name)
        for f in _TOKENIZER_FILES:
            if (model_path / f).is_file() and not (tmp / f).exists():
                shutil.copy2(model_path / f, tmp / f)
        size = _dir_bytes(tmp)
        bf16_size = sum(p.stat().st_size for p in model_path.glob("*.safetensors"))
        summary = {"folder": str(out_dir), "kind": kind, "quant": None if merge else quant, "kept": skips,
                   "target": None if merge else target, "skip_entries": None if merge else entries,
                   "vllm_aliases": serving["aliases"], "split_groups": serving["split"],
                   "bytes_on_disk": size, "bf16_checkpoint_bytes": bf16_size, "all_low_weights_bytes": all_low_bytes, "weights_held_bytes": held["total"],
                   "plan": profile.get("plan"), "price": profile.get("price"), "model": name,
                   "profile_batches": profile.get("batches"), "profile_tokens": profile.get("tokens"),
                   "heldout_batches": _heldout_batches(profile)}
        (tmp / "README.md").write_text(model_card(summary, name, adapter is not None, merge))
    return summary


# the offline aliases' recipe folders (the card's fine-tune command); another model gets the SmolLM2 recipe as a template
_RECIPE_DIRS = {"smollm2-135m-instruct": "smollm2-135m", "gemma3-270m": "gemma3-270m"}
# where the measured after-training results of the planned recipes are (the gnmr_hf sources' docs)
AFTER_TRAINING_DOCS = ("docs/qlora_budget.md (the gnmr_hf sources): held-out loss after LoRA fine-tuning of the "
                       "planned recipes against NF4 and BF16, served and merged, over seeds: \"Results\" and \"At 240 "
                       "steps\" (SmolLM2-135M), \"Gemma 3 270M on the Python docs\", \"SmolLM2 on the Python docs\"")


#: how the card names the source model: :func:`gnmr_hf.export_folder.model_name` (an offline alias, a hub id, else
#: the folder's base name; never an absolute path: the card is published)
source_name = model_name


def name_adapter_base(adapter_dir: Path, name: str) -> None:
    """The adapter copied into an export names its base model ``name`` (this export's source, by
    :func:`source_name`), not a folder of the machine it was trained on: ``base_model_name_or_path`` in its
    adapter_config.json, ``base_model`` (and the ``base_model:adapter:...`` tag) in its README.md front matter
    (PEFT writes the base's ``name_or_path``, an absolute path for a model loaded from a folder).
    ``PeftModel.from_pretrained(model, FOLDER + '/adapter')`` takes the model it is given and reads neither."""
    import json

    config = adapter_dir / "adapter_config.json"
    data = json.loads(config.read_text())
    if isinstance(data, dict) and data.get("base_model_name_or_path") not in (None, name):
        data["base_model_name_or_path"] = name
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    readme = adapter_dir / "README.md"
    if readme.is_file():
        text = readme.read_text()
        head = re.match(r"---\n.*?\n---\n", text, flags=re.S)
        was = re.search(r"(?m)^base_model:[ \t]*(\S.*?)[ \t]*$", head.group(0)) if head else None
        if was and was.group(1) != name:  # base_model and PEFT's tag base_model:adapter:<base>
            readme.write_text(head.group(0).replace(was.group(1), name) + text[head.end():])


def _heldout_batches(profile: dict[str, Any]) -> int | None:
    """``--heldout-batches N`` as the profile's recorded command gave it (None when not recorded)."""
    try:
        argv = shlex.split(str(profile.get("command") or ""))
    except ValueError:
        return None
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--heldout-batches" and i + 1 < len(argv) else (
            a.split("=", 1)[1] if a.startswith("--heldout-batches=") else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _batches(n: Any) -> str:
    return f"{n} batch{'es' if n != 1 else ''}" if isinstance(n, int) else "batches (count not recorded)"


def finetune_command(model: str) -> str:
    """A fine-tune command that works for an export of ``model``: the planned recipe on the BF16 source
    (it profiles and plans on its own training data and reads that checkpoint as the recovery source),
    never the exported folder (a pre-quantised folder cannot be its own recovery source)."""
    folder = _RECIPE_DIRS.get(model, "smollm2-135m")
    source = model if model in _RECIPE_DIRS else f"BF16_MODEL_FOLDER  # the folder {model} was exported from"
    return f"accelerate launch recipes/finetune.py --config recipes/{folder}/planned-nf4.yaml --model {source}"


def serving_lines(summary: dict[str, Any]) -> list[str]:
    """The card's "Serving" paragraph: which server loads this folder and by which names."""
    aliases, split = summary.get("vllm_aliases") or [], summary.get("split_groups")
    if summary.get("target") == "vllm":
        lines = ["## Serving", "", "Loaded by transformers (`from_pretrained(FOLDER)`, by the names above) and by vLLM "
                 "(`vllm serve FOLDER`: it reads `quantization_config`; older vLLM versions also want `--quantization "
                 "bitsandbytes`; vLLM is not run by gnmr_hf's tests). vLLM fuses q/k/v into one "
                 "`self_attn.qkv_proj` and gate/up into one `mlp.gate_up_proj` and matches the skip list against "
                 "those names, so the list also holds the fused name of every kept group (transformers matches no "
                 "module by them):", ""]
        lines += [f"- `{a}`" for a in aliases] or ["- none needed: no kept group is fused under another name (each kept linear is a vLLM module by its own name)"]
        return lines + [""]
    lines = ["## Serving", "", "**For transformers only** (exported with `--target transformers`): "
             "`from_pretrained(FOLDER)` loads it as planned; vLLM cannot load it."]
    if split:
        lines.append(f"The plan keeps part of {len(split)} group(s) that vLLM fuses into one module (one "
                     f"quantisation each): {', '.join(f'`{g}`' for g in split[:6])}"
                     f"{f' and {len(split) - 6} more' if len(split) > 6 else ''}. A grouped plan (groups='vllm') "
                     "exported with `--target vllm` is served by both.")
    elif split is None:
        lines.append("vLLM's fused layout is not known for this architecture.")
    else:
        lines.append("The skip list has no fused names (`qkv_proj`, `gate_up_proj`), which vLLM matches: export "
                     "again with `--target vllm` (the default) for a folder both load.")
    return lines + [""]


def model_card(summary: dict[str, Any], model: str | os.PathLike, has_adapter: bool, merge: bool) -> str:
    """The exported folder's README.md: what was kept and why, the price, the quality figures with what they
    are (in-sample on N profile batches; held-out when measured; where the after-training results are),
    the commands. ``model`` names the source (a path is reduced to :func:`source_name`: the card never
    records an absolute path)."""
    mib = 2**20
    name = model if isinstance(model, str) else source_name(model)
    plan = summary.get("plan") or {}
    n_prof = summary.get("profile_batches")
    n_held = summary.get("heldout_batches")
    labels = {"profile": "in-sample", "heldout": "held-out"}
    lines = ["---", "library_name: transformers", "tags: [gnmr_hf, bitsandbytes, mixed-precision]", "---", "",
             f"# {name}: {summary['kind']}", "",
             f"Exported by `gnmr-hf export` from the BF16 checkpoint of `{name}`.", ""]
    if merge:
        lines += ["The LoRA adapter is folded into the original BF16 weights: a plain BF16 checkpoint.", ""]
    else:
        lines += [f"The linears below stay in BF16; every other decoder linear is stored by bitsandbytes in "
                  f"{summary['quant'].upper()}. They were chosen by `gnmr-hf profile`: the linears worth the most "
                  f"loss per byte on the profile's {_batches(n_prof)} of the user's data, within the budget.", "",
                  "Kept unquantised (`quantization_config.llm_int8_skip_modules`, full dotted names: each selects "
                  "exactly its module under transformers' matching rule):", ""]
        lines += [f"- `{m}`" for m in summary["kept"]]
        lines.append("")
    lines += ["| | size |", "|---|---|",
              f"| this folder on disk | {summary['bytes_on_disk'] / mib:.1f} MiB |",
              f"| the BF16 checkpoint's weights | {summary['bf16_checkpoint_bytes'] / mib:.1f} MiB |",
              f"| all decoder linears in {(summary['quant'] or 'nf4').upper()} (predicted, gnmr_hf.memory) | "
              f"{summary['all_low_weights_bytes'] / mib:.1f} MiB |",
              f"| weights held when loaded (parameters, buffers, quant states) | {summary['weights_held_bytes'] / mib:.1f} MiB |",
              ""]
    if not merge and summary.get("all_low_weights_bytes"):
        over = summary["weights_held_bytes"] / summary["all_low_weights_bytes"] - 1
        lines += [f"Memory over the all-{(summary['quant'] or 'nf4').upper()} model: **{100 * over:+.1f} %** (weights held "
                  "when loaded against the predicted all-low load).", ""]
    price = summary.get("price") or []
    if price and not merge:
        low = (summary["quant"] or "nf4").upper()
        # each kept linear costs its BF16 bytes less its low bytes: 1.4375 of 2 for NF4/FP4, ~1 of 2 for INT8
        ratio = 2 / 1.4375 if low in ("NF4", "FP4") else 2.0
        lines += [f"The price table of the profile, in both currencies (memory over {low} from BF16 bytes by "
                  f"the per-weight price, {ratio:.3f} BF16 bytes per byte over {low}); gap closed before training, "
                  f"in-sample on the {_batches(n_prof)} the plan was chosen on, held-out where the profile measured it:",
                  "", f"| budget (BF16 bytes of the quantised linears) | linears kept | extra MiB (BF16) | memory over {low} |"
                  " gap closed before training |", "|---|---|---|---|---|"]
        for row in price:
            gaps = ", ".join(f"{labels.get(w, w)} {m.get('gap_closed', float('nan')):.3f}"
                             for w, m in (row.get("measured") or {}).items())
            lines.append(f"| {100 * row.get('budget_fraction', 0):.0f} % | {len(row.get('indices', []))} | "
                         f"{row.get('bytes', 0) / mib:.1f} | "
                         f"+{100 * row.get('bytes', 0) / ratio / summary['all_low_weights_bytes']:.1f} % | {gaps or '-'} |")
        lines.append("")
    if plan:
        measured = plan.get("measured") or {}
        lines += [f"Plan: {len(plan.get('indices', []))} linears, {100 * plan.get('fraction', 0):.1f} % of the "
                  "quantised weights' BF16 bytes. Gap closed = (L_low - L_plan) / (L_low - L_BF16), before any training:", ""]

        def losses(m: dict[str, Any]) -> str:
            return (f"loss all-low {m.get('loss_low', float('nan')):.4f}, plan {m.get('loss_plan', float('nan')):.4f}, "
                    f"BF16 {m.get('loss_high', float('nan')):.4f}")

        if "profile" in measured:
            m = measured["profile"]
            lines.append(f"- in-sample: {m.get('gap_closed', float('nan')):.3f} on the {_batches(n_prof)} the plan was "
                         f"chosen on ({summary.get('profile_tokens') or '?'} target tokens; {losses(m)}). In-sample "
                         "figures flatter the plan: it was picked to lower exactly this loss, and a value above 1 means "
                         "a loss below the BF16 model's on these batches, not a model better than BF16.")
        if "heldout" in measured:
            m = measured["heldout"]
            lines.append(f"- held-out: {m.get('gap_closed', float('nan')):.3f} on "
                         f"{_batches(n_held) if n_held is not None else 'the held-out batches'} the plan was not chosen "
                         f"on ({losses(m)}).")
        else:
            lines.append("- held-out: not measured (the profile was taken without `gnmr-hf profile --heldout-batches N`).")
        for where, m in measured.items():
            if where not in labels:
                lines.append(f"- {where}: {m.get('gap_closed', float('nan')):.3f} ({losses(m)}).")
        lines.append(f"- after training (what a fine-tune on this base keeps of it): not measured for this folder; "
                     f"the planned recipes' measured results are in {AFTER_TRAINING_DOCS}.")
        lines.append("")
    if not merge:
        lines += serving_lines(summary)
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(FOLDER)   # no arguments: the config says it all",
              "tokenizer = AutoTokenizer.from_pretrained(FOLDER)", "```", ""]
    if has_adapter:
        lines += ["The adapter trained on this base is in `adapter/`: "
                  "`peft.PeftModel.from_pretrained(model, FOLDER + '/adapter')`.", ""]
    lines += ["Train a LoRA on this folder as it is: load it as above and use any PEFT LoRA setup "
              "(`peft.get_peft_model(model, peft.LoraConfig(...))`).", "",
              f"The planned-NF4 recipe (gnmr_hf sources) trains from the BF16 model `{name}`, not from this folder: it "
              "profiles and plans on its own training data and reads the BF16 checkpoint as the recovery source, "
              "which a pre-quantised folder cannot be:", "", "```bash", finetune_command(name), "```", "",
              "Evaluate: `gnmr-hf eval --model FOLDER ...` (docs/eval.md).", ""]
    return "\n".join(lines)


FORMATS = ("bitsandbytes", "compressed-tensors")


def _ct_options(args) -> str | None:
    """The first option that does not apply to ``--format compressed-tensors``, as a one-line reason."""
    if args.merge:
        return ("--merge writes the merged BF16 model (format bitsandbytes' --merge); --format compressed-tensors "
                "merges --adapter into the BF16 weights itself before quantising")
    if args.quant is not None:
        return (f"--quant {args.quant} is bitsandbytes' low precision; compressed-tensors stores the low rung as INT4 "
                "(W4A16) and the INT8 rung as W8A16: leave --quant out (--group-size sets the INT4 group)")
    if args.double_quant:
        return "--double-quant is bitsandbytes' (4-bit scales quantised); compressed-tensors keeps BF16 scales"
    return None


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="gnmr-hf export", description="Write the planned mixed model as a folder stock "
                                "transformers loads with no arguments: pre-quantised bitsandbytes + the plan on BF16 "
                                "(--format bitsandbytes, BF16-only plans), or compressed-tensors with INT4 / INT8 / BF16 "
                                "per linear (--format compressed-tensors, ladder plans too; vLLM serves both).",
                                epilog="examples: gnmr-hf export --model ~/.cache/gnmr_hf/smollm2-135m-instruct "
                                       "--plan prof/ --output smollm2-planned-nf4;  gnmr-hf export --model gemma3-270m "
                                       "--plan run/profile.json --adapter run/ --format compressed-tensors --output g-ct")
    p.add_argument("--model", required=True, help="the BF16 model folder (safetensors), or an offline alias")
    p.add_argument("--plan", required=True, help="profile.json (or the folder holding it) from gnmr-hf profile --budget "
                   "or a recipe (a ladder plan's rungs: --format compressed-tensors or --merge)")
    p.add_argument("--output", required=True, help="the folder to write (refused if it exists and is not empty, or is "
                   "the model, adapter or profile folder, holds one, or is the current folder or a parent of it)")
    p.add_argument("--format", default="bitsandbytes", choices=FORMATS, dest="fmt",
                   help="bitsandbytes (default): NF4/FP4/INT8 with the planned linears on BF16; compressed-tensors: "
                   "W4A16 / W8A16 / BF16 per linear (the ladder), stock from_pretrained and vLLM (the serve extra)")
    p.add_argument("--quant", default=None, choices=QUANTS, help="bitsandbytes: the low precision (default nf4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="compressed-tensors: the INT4 group size (default: an int4 profile's own, else 128, vLLM's "
                   "W4A16 preset; another than an int4 profile's is refused; it must divide "
                   "every INT4 linear's input size, e.g. 64 for SmolLM2's 576)")
    p.add_argument("--target", default="vllm", choices=TARGETS,
                   help="vllm (default): a folder vLLM and transformers load (a plan that splits a fused q/k/v or "
                   "gate/up group is refused); transformers: transformers only, any plan")
    p.add_argument("--double-quant", action="store_true", help="bitsandbytes 4-bit: quantise the scales too")
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder: copied beside the model (adapter/) for "
                   "bitsandbytes, merged into the BF16 weights before quantising for compressed-tensors")
    p.add_argument("--merge", action="store_true", help="write the adapter merged into the BF16 weights instead "
                   "(any plan, the ladder included)")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --output (only a folder gnmr-hf "
                   "export wrote: it holds .gnmr_export.json; replaced by rename, the old one removed last)")
    args = p.parse_args(argv)
    from gnmr_hf.offline.gguf_models import resolve_model

    def fail(msg: str) -> int:
        print(f"gnmr-hf export: error: {msg}", file=sys.stderr)
        return 2

    mib = 2**20
    if args.fmt == "compressed-tensors":
        bad = _ct_options(args)
        if bad:
            return fail(bad)
        from gnmr_hf.export_ct import export_compressed_tensors

        try:
            s = export_compressed_tensors(resolve_model(args.model), args.plan, args.output, adapter=args.adapter,
                                          group_size=args.group_size,
                                          force=args.force, target=args.target)
        except (ExportError, OutputFolderError, FileNotFoundError, ImportError) as e:
            return fail(str(e))
        c = s["schemes"]
        print(f"wrote {s['folder']} (compressed-tensors, for {s['target']}): W4A16 {c['W4A16']} / W8A16 {c['W8A16']} / "
              f"BF16 {c['BF16']} decoder linears, INT4 group {s['group_size']}; {s['bytes_on_disk'] / mib:.1f} MiB on "
              f"disk; tensors {s['tensor_bytes'] / mib:.1f} MiB ({100 * (s['tensor_bytes'] / s['w4a16_tensor_bytes'] - 1):+.1f} "
              f"% over uniform W4A16, {s['w4a16_tensor_bytes'] / mib:.1f} MiB; BF16 {s['bf16_tensor_bytes'] / mib:.1f} MiB)")
        return 0
    if args.group_size is not None:
        return fail("--group-size is the compressed-tensors INT4 group: add --format compressed-tensors")
    try:
        s = export_planned(resolve_model(args.model), args.plan, args.output, quant=args.quant or "nf4",
                           adapter=args.adapter, merge=args.merge, force=args.force, double_quant=args.double_quant,
                           target=args.target)
    except (ExportError, FileNotFoundError) as e:
        return fail(str(e))
    print(f"wrote {s['folder']} ({s['kind']}): {s['bytes_on_disk'] / mib:.1f} MiB on disk; the BF16 checkpoint "
          f"{s['bf16_checkpoint_bytes'] / mib:.1f} MiB, all-{(s['quant'] or 'nf4').upper()} weights "
          f"{s['all_low_weights_bytes'] / mib:.1f} MiB (predicted); {len(s['kept'])} module(s) kept unquantised"
          + (f"; for {s['target']}" + (f" ({len(s['vllm_aliases'])} fused alias(es) for vLLM)" if s['target'] == "vllm"
                                       else ", not vLLM") if s["target"] else ""))
    return 0
