"""The bitsandbytes export: the planned mixed model as a pre-quantised bitsandbytes folder (``gnmr-hf export``,
``--format bitsandbytes``, the default; :func:`export_planned`). The module docstring of :mod:`gnmr_hf.export`
says what the folder holds and who loads it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from gnmr_hf.export_folder import (
    ExportError,
    OutputFolderError,
    check_model_folder,
    check_output,
    check_sources,
    plan_file,
    staged_output,
)
from gnmr_hf.exports.card import _heldout_batches, model_card, source_name
from gnmr_hf.memory import model_bytes, predict_model_bytes

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


def read_plan(profile_json: str | os.PathLike, ladder: bool = False) -> tuple[list[str], dict[str, Any]]:
    """``(skip_modules, data)`` of a BF16-only plan, read by :meth:`gnmr_hf.planning.plan.Plan.load` (every schema,
    a folder meaning its ``profile.json``); with ``ladder`` (``--merge``, which only needs the plan's names checked
    against the model) a ladder plan's rung names too. One-line :class:`ExportError` for anything else."""
    from gnmr_hf.planning.plan import Plan, PlanError

    try:
        plan = Plan.load(plan_file(profile_json))  # export_folder's words for a missing file
        plan.require_bnb_low("")
    except PlanError as e:
        raise ExportError(str(e)) from None
    off = plan.not_in_skip_list()
    if off and ladder:
        return sorted(plan.rungs), plan.data
    int8 = plan.on("int8")
    if int8 and "schema_version" not in plan.data:  # a ladder recipe's or hand-built file: its own words
        raise ExportError(f"{plan.source} is a precision-ladder plan with {len(int8)} INT8 linears (e.g. {int8[0]}): "
                          f"{LADDER_BNB}")
    if not plan.planned:
        raise ExportError(f"{plan.source} has no skip_modules list: make it with gnmr-hf profile --budget")
    try:
        return plan.skip_modules(), plan.data
    except PlanError as e:
        raise ExportError(f"{e}; {LADDER_BNB}" if off else str(e)) from None


#: the earlier name of :func:`read_plan`
_read_plan = read_plan


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
    if quant not in QUANTS:
        raise ExportError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    if target not in TARGETS:
        raise ExportError(f"target {target!r}: one of {', '.join(TARGETS)}")
    model_path, out_dir = Path(model_path), Path(out_dir)
    check_model_folder(model_path)
    skips, profile = read_plan(profile_json, ladder=merge)
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
    serving, all_low_bytes = _check_against_model(model_path, skips, profile, profile_json, adapter, merge, quant,
                                                  target, double_quant)
    entries = serving["entries"]
    marker = {"model": name, "kind": "merged-bf16" if merge else quant, "skip_modules": skips,
              "target": None if merge else target, "llm_int8_skip_modules": None if merge else entries}
    with staged_output(out_dir, marker) as tmp:
        kind, held = _write_folder(tmp, model_path, entries, quant, adapter, merge, double_quant, name)
        size = _dir_bytes(tmp)
        bf16_size = sum(p.stat().st_size for p in model_path.glob("*.safetensors"))
        summary = {"folder": str(out_dir), "kind": kind, "quant": None if merge else quant, "kept": skips,
                   "target": None if merge else target, "skip_entries": None if merge else entries,
                   "vllm_aliases": serving["aliases"], "split_groups": serving["split"],
                   "bytes_on_disk": size, "bf16_checkpoint_bytes": bf16_size, "all_low_weights_bytes": all_low_bytes,
                   "weights_held_bytes": held["total"],
                   "plan": profile.get("plan"), "price": profile.get("price"), "model": name,
                   "profile_batches": profile.get("batches"), "profile_tokens": profile.get("tokens"),
                   "heldout_batches": _heldout_batches(profile)}
        (tmp / "README.md").write_text(model_card(summary, name, adapter is not None, merge))
    return summary


def _check_against_model(model_path: Path, skips: list[str], profile: dict[str, Any], profile_json, adapter,
                         merge: bool, quant: str, target: str, double_quant: bool) -> tuple[dict[str, Any], int]:
    """Everything about the plan against the model, from its config alone (a meta model), before anything is
    written: the serving entries (:func:`serving_skip_entries`) and the all-low model's predicted bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

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
    return serving, all_low_bytes


def _write_folder(tmp: Path, model_path: Path, entries: list[str], quant: str, adapter, merge: bool,
                  double_quant: bool, name: str) -> tuple[str, dict[str, int]]:
    """The model (the merged BF16 one, or the stock pre-quantised load with ``entries`` kept), the adapter and the
    tokenizer into ``tmp``; returns the folder's kind and what the model holds (``gnmr_hf.memory.model_bytes``)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

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
    return kind, held


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



# ------------------------------------------------------------------------------------------- gnmr-hf export


def check_options(args) -> str | None:
    """The first ``gnmr-hf export`` option that does not apply to this format, as a one-line reason."""
    if args.group_size is not None:
        return "--group-size is the compressed-tensors INT4 group: add --format compressed-tensors"
    if args.target is not None and args.target not in TARGETS:
        return (f"--target {args.target} is a compressed-tensors target (vLLM's W4A16 kernels); a bitsandbytes "
                f"folder is written for {' or '.join(TARGETS)}: add --format compressed-tensors")
    return None


def run(args, model_path: str) -> dict[str, Any]:
    """``gnmr-hf export --format bitsandbytes``: :func:`export_planned` with the command's options."""
    return export_planned(model_path, args.plan, args.output, quant=args.quant or "nf4", adapter=args.adapter,
                          merge=args.merge, force=args.force, double_quant=args.double_quant,
                          target=args.target or "vllm")


def describe(s: dict[str, Any]) -> str:
    """The line ``gnmr-hf export`` prints for the folder written."""
    mib = 2**20
    return (f"wrote {s['folder']} ({s['kind']}): {s['bytes_on_disk'] / mib:.1f} MiB on disk; the BF16 checkpoint "
            f"{s['bf16_checkpoint_bytes'] / mib:.1f} MiB, all-{(s['quant'] or 'nf4').upper()} weights "
            f"{s['all_low_weights_bytes'] / mib:.1f} MiB (predicted); {len(s['kept'])} module(s) kept unquantised"
            + (f"; for {s['target']}" + (f" ({len(s['vllm_aliases'])} fused alias(es) for vLLM)" if s['target'] == "vllm"
                                         else ", not vLLM") if s["target"] else ""))
