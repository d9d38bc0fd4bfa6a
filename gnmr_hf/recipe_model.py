"""The model a recipe trains: its folder resolved, its base loaded for ``precision`` (bitsandbytes, the dual path),
LoRA applied and, for ``lora_init: loftq`` / ``calibrated``, initialised (recipes/finetune.py calls these)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from gnmr_hf._import_utils import require
from gnmr_hf.backends.base import active_units, set_active_units
from gnmr_hf.backends.dispatch import PREQUANTISED, prepare_dual_path, prequantised
from gnmr_hf.calibrated_init import calibrated_lora_init
from gnmr_hf.loftq import replace_lora_weights_loftq
from gnmr_hf.offline.gguf_models import model_name, resolve_model
from gnmr_hf.recipe import (
    GNMR_PRECISIONS,
    INT8_PRECISIONS,
    NF4_PRECISIONS,
    Recipe,
    RecipeError,
    ScriptArguments,
)


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: an offline model's cache (``smollm2-135m-instruct``, ``gemma3-270m``:
    ``gnmr_hf.offline.gguf_models``), a folder as given, or a hub id (offline cache)."""
    # the one resolver (profile, eval, export, demo too)
    try:
        name = resolve_model(name)  # an alias -> its folder; a folder or hub id stays; else one line naming the aliases
    except (FileNotFoundError, ImportError) as e:
        raise RecipeError(str(e)) from None
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise RecipeError(f"model folder {name} has no config.json")
        return name
    from huggingface_hub import snapshot_download

    try:
        # a folder, so that the recovery path (gnmr) can read the original BF16 safetensors
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline without a cached copy, gated repo, typo in the id ...
        raise RecipeError(f"model {name!r} not found: not a folder, and the hub gave {type(e).__name__}: {e}") from None


def refuse_prequantised(model_path: str) -> None:
    """A one-line ``RecipeError`` for a pre-quantised model folder (its config.json has a ``quantization_config``,
    e.g. a ``gnmr-hf export`` folder): every precision loads (and quantises) a BF16 checkpoint, and the
    recovery path reads its BF16 weights."""
    what = prequantised(model_path)
    if what:
        raise RecipeError(PREQUANTISED.format(source=f"model {model_path}", what=what))


def sharded_run(args) -> bool:
    """Whether the run asks for FSDP: the Trainer's ``fsdp`` argument (``--fsdp full_shard --fsdp_config ...``) or
    an ``accelerate launch`` FSDP config (which sets ``ACCELERATE_USE_FSDP``)."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def quantization_config(script: ScriptArguments, sharded: bool = False):
    """The ``BitsAndBytesConfig`` of ``script.precision`` (None for bf16); 4-bit computes in
    ``script.compute_dtype``. ``sharded`` (an FSDP run): the 4-bit weights are packed into the compute dtype
    (``bnb_4bit_quant_storage``), so that FSDP2 shards them as ordinary tensors (the route transformers, PEFT and
    bitsandbytes document for FSDP + QLoRA)."""
    if script.precision == "bf16":
        return None
    require("bitsandbytes", f"precision: {script.precision}")
    from transformers import BitsAndBytesConfig

    if script.precision in INT8_PRECISIONS:
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = {"bnb_4bit_quant_storage": getattr(torch, script.compute_dtype)} if sharded else {}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=getattr(torch, script.compute_dtype),
                              bnb_4bit_use_double_quant=script.bnb_4bit_use_double_quant, **storage)


def load_model(recipe: Recipe, model_path: str):
    """The base model for ``recipe.script.precision`` with LoRA applied (a ``peft.PeftModel``).

    ``recipe.script.compute_dtype`` is the dtype the model is loaded and computed in: the unquantised
    weights, the 4-bit compute dtype and the recovery weights (bench/value/nf4_bench.py uses FP32 on CPUs
    without BF16 matrix instructions).
    """
    import peft
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, recipe.script.compute_dtype)
    refuse_prequantised(model_path)

    # under DDP on GPUs each process holds a whole replica on its own device
    device_map = {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.cuda.is_available() else None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=device_map,
                                                     quantization_config=quantization_config(
                                                         recipe.script, sharded_run(recipe.training)))
    except OSError as e:
        raise RecipeError(f"could not load the model from {model_path}: {e}") from None
    if recipe.script.precision in GNMR_PRECISIONS:
        # before LoRA: the dual-path layers replace the quantised linears that LoRA then wraps
        # a profile plans single linears: each is its own unit (units="linears"), else the decoder layers
        model = prepare_dual_path(model, recovery_source=model_path, storage=recipe.gnmr.storage,
                                    dtype=dtype, units="linears" if recipe.profile.enabled else None)
    elif recipe.script.precision in NF4_PRECISIONS:
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        # plain QLoRA computes as the dual path's low-cost layers do, in training and evaluation alike
        keep_reference_layout(model)
    if recipe.training.activation_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings would cut the checkpointed graph
    lora = peft.LoraConfig(r=recipe.lora.lora_r, lora_alpha=recipe.lora.lora_alpha,
                           lora_dropout=recipe.lora.lora_dropout, target_modules=recipe.lora.lora_target_modules,
                           task_type="CAUSAL_LM")
    name_model(model, model_path)
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as e:  # e.g. target modules the model does not have
        raise RecipeError(f"LoRA: {e}") from None


def name_model(model, model_path: str) -> str:
    """Name the loaded model by its name, not this machine's folder (``gnmr_hf.offline.gguf_models.model_name``: the
    alias, the hub id, else the folder's base name), before LoRA is applied: PEFT records
    ``model.name_or_path`` as the adapter's ``base_model_name_or_path`` (adapter_config.json) and the config's
    ``_name_or_path`` as ``base_model`` in its README.md, and a planned recipe's profile.json records the latter
    too, all in the training folder users publish. The weights are read before (and the recovery path from
    ``model_path``), so nothing loads by this name; the saved adapter loads with stock PEFT given the model
    (``PeftModel.from_pretrained(model, run_dir)``). Returns the name."""
    name = model_name(model_path)
    model.config.name_or_path = name  # the config's _name_or_path
    model.name_or_path = name
    return name


def lora_pairs(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every LoRA pair's A and B weights (copies), by module: what an init is compared against afterwards."""
    return {id(m): (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
            for m in model.modules() if isinstance(getattr(m, "lora_B", None), torch.nn.ModuleDict)
            and "default" in m.lora_B}


def kept_default(model, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The LoRA pairs whose A and B are bit-identical to ``pairs`` (their default init): counted, not assumed."""
    return sum(1 for m in model.modules() if id(m) in pairs
               and torch.equal(m.lora_A["default"].weight, pairs[id(m)][0])
               and torch.equal(m.lora_B["default"].weight, pairs[id(m)][1]))


def loftq_init(recipe: Recipe, model, model_path: str, planned: dict[str, Any] | None) -> dict[str, Any]:
    """``lora_init: loftq``, after the plan: its linears run on BF16 (no quantisation residual) and keep the
    default init. Returns run.json's ``loftq`` record."""
    args = recipe.training
    t0 = time.time()
    skip = list((planned or {}).get("modules") or [])
    pairs = lora_pairs(model)
    try:
        replace_lora_weights_loftq(model, model_path, skip=skip,
                                   progress=args.process_index == 0 and not args.disable_tqdm)
    except ValueError as e:  # a rank above a linear's dimension, another checkpoint: one line
        raise RecipeError(f"lora_init: loftq: {e}") from None
    kept = kept_default(model, pairs)
    loftq = {"seconds": round(time.time() - t0, 2), "kept_default": kept, "skip": len(skip)}
    if args.process_index == 0:
        print(f"lora_init: loftq ({loftq['seconds']:.1f} s; {kept} LoRA pairs keep the default init, "
              f"{len(skip)} planned linears asked)")
    return loftq


def calibrated_init(recipe: Recipe, model, model_path: str, planned: dict[str, Any] | None, train_ds,
                    tokenizer) -> dict[str, Any]:
    """``lora_init: calibrated``, after the plan as LoftQ: the linears it keeps off NF4 keep the default init;
    calibrated on the first ``profile.batches`` training batches (the profile's own batches when the recipe
    plans), on the inputs of the model it trains (the planned linears on their rungs). Returns run.json's
    ``calibrated_init`` record."""
    from transformers import DataCollatorForSeq2Seq

    args = recipe.training
    bs = args.per_device_train_batch_size
    n = min(recipe.profile.batches, max(1, len(train_ds) // bs))
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    calib = [collate([train_ds[j] for j in range(i * bs, min((i + 1) * bs, len(train_ds)))]) for i in range(n)]
    skip = list((planned or {}).get("modules") or [])
    before = active_units(model) if planned else None
    if planned:
        set_active_units(model, planned["indices"])
    try:
        summary = calibrated_lora_init(model, calib, model_path, skip=skip,
                                       progress=args.process_index == 0 and not args.disable_tqdm)
    except ValueError as e:
        raise RecipeError(f"lora_init: calibrated: {e}") from None
    finally:
        if planned:
            set_active_units(model, before)
    if args.process_index == 0:
        err = summary["output_error"]
        print(f"lora_init: calibrated ({summary['seconds']:.1f} s; {summary['linears']} LoRA pairs on "
              f"{summary['tokens']} tokens, {summary['skipped']} planned linears keep the default init; output "
              f"error {err['calibrated'] / max(err['zero'], 1e-30):.3f} of NF4's, LoftQ's would be "
              f"{err['loftq'] / max(err['zero'], 1e-30):.3f})")
    return {k: summary[k] for k in ("seconds", "linears", "skipped", "tokens", "damp", "output_error")}
