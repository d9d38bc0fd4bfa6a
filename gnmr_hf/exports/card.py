"""The model card (``README.md``) of a bitsandbytes export: what was kept and why, the price, the quality figures
with what they are (in-sample on N profile batches; held-out when measured; where the after-training results are),
the commands, and which server loads the folder. The compressed-tensors card is
:func:`gnmr_hf.export_ct.model_card`; a new format writes its own card beside its exporter, from these pieces
(:func:`finetune_command`, :func:`source_name`) where they fit.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from gnmr_hf.export_folder import model_name
from gnmr_hf.rungs import get_rung

# the offline aliases' recipe folders (the card's fine-tune command); another model gets the SmolLM2 recipe as a template
_RECIPE_DIRS = {"smollm2-135m-instruct": "smollm2-135m", "gemma3-270m": "gemma3-270m"}
# where the measured after-training results of the planned recipes are (the gnmr_hf sources' docs)
AFTER_TRAINING_DOCS = ("docs/qlora_budget.md (the gnmr_hf sources): held-out loss after LoRA fine-tuning of the "
                       "planned recipes against NF4 and BF16, served and merged, over seeds: \"Results\" and \"At 240 "
                       "steps\" (SmolLM2-135M), \"Gemma 3 270M on the Python docs\", \"SmolLM2 on the Python docs\"")


#: how the card names the source model: :func:`gnmr_hf.export_folder.model_name` (an offline alias, a hub id, else
#: the folder's base name; never an absolute path: the card is published)
source_name = model_name


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
                 "versions that have a bitsandbytes method (`vllm serve FOLDER`: it reads `quantization_config`; older "
                 "versions also want `--quantization bitsandbytes`). vLLM 0.32.0 has none: its CPU build refuses "
                 "the folder (`Unknown quantization method: bitsandbytes`, run by bench/serve/vllm_cpu.py's worker; "
                 "its QuantizationMethods list has no bitsandbytes on any device); serve vLLM a compressed-tensors "
                 "export (`--format compressed-tensors`) instead. vLLM fuses q/k/v into one "
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
    if not merge:
        lines += _price_lines(summary, labels, n_prof)
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




def _price_lines(summary: dict[str, Any], labels: dict[str, str], n_prof: Any) -> list[str]:
    """The profile's price table, in both currencies: BF16 bytes and memory over the low format, converted by the
    per-weight price of the rungs (:meth:`gnmr_hf.rungs.Rung.per_weight`: each kept linear costs its BF16 bytes
    less its low bytes, 1.4375 of 2 for NF4/FP4, about 1 of 2 for INT8)."""
    price = summary.get("price") or []
    if not price:
        return []
    mib = 2**20
    quant = summary["quant"] or "nf4"
    low = quant.upper()
    bf16 = get_rung("bf16").per_weight()
    ratio = bf16 / (bf16 - get_rung(quant).per_weight())
    lines = [f"The price table of the profile, in both currencies (memory over {low} from BF16 bytes by "
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
    return lines + [""]
