"""LoRA fine-tuning of a causal LM on a BF16, INT8 or NF4 base, optionally with GNMR-controlled BF16 recovery.

Launch with accelerate (one process, CPU or GPU DDP; the config files are in recipes/accelerate/):

    accelerate launch [--config_file recipes/accelerate/cpu.yaml] recipes/finetune.py \\
        --config recipes/smollm2-135m/gnmr.yaml [--max_steps 3 --output_dir out/x --gnmr.max_active 4 ...]

The configuration is parsed by ``transformers.HfArgumentParser`` into three dataclasses: every
``transformers.TrainingArguments`` field (``learning_rate``, ``per_device_train_batch_size``, ``max_steps``,
``bf16``, ``activation_checkpointing``, ...), :class:`ScriptArguments` (model, data, precision) and
:class:`LoraArguments`; ``--help`` lists them all. A YAML file given by ``--config`` sets them by their
field names; a key ``include: other.yaml`` (a path relative to the file) reads that file first and lets
this one override it, so a model's shared values live in one ``base.yaml``. The nested ``gnmr:`` block
is ``gnmr_hf.GNMRConfig.from_dict`` input plus ``init_fraction``, ``storage`` and ``monitor``; on the
command line its keys are ``--gnmr.KEY value``. Command-line values override the file. A setting the
chosen precision would ignore is an error, before anything is loaded (:func:`validate`): the
``gnmr`` block outside gnmr / gnmr-nf4 (except a monitor-only run's statistics settings), ``bnb_4bit_*``
outside nf4 / gnmr-nf4.

The run, top to bottom: parse the configuration, load the base model for ``precision``

    bf16      the BF16 checkpoint + LoRA (the high-fidelity reference)
    int8      the checkpoint in bitsandbytes INT8 + LoRA (the fixed low-cost path)
    gnmr      INT8 + a BF16 recovery path per decoder layer (gnmr_hf.prepare_dual_path) + LoRA,
              with gnmr_hf.GNMRCallback switching up to ``gnmr.max_active`` layers to BF16
    nf4       the checkpoint in bitsandbytes NF4 (BF16 compute) + LoRA: plain QLoRA
    gnmr-nf4  NF4 + a BF16 recovery path per decoder layer + LoRA, switched by GNMRCallback

build the dataset (a prompt template over each record's fields; loss only on the answer tokens),
train with the Hugging Face Trainer (``resume_from_checkpoint`` resumes), and write into ``output_dir``:
the LoRA adapter (plain PEFT), ``trainer_state.json`` (the loss log), ``gnmr_trace.jsonl`` +
``gnmr_summary.json`` (runs with the callback), and ``run.json`` (configuration, package versions,
wall time, peak memory, losses, GNMR summary; written last, it marks a complete run).

Errors in the configuration or the inputs end the run with a one-line message and exit code 2.
"""

import dataclasses
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# the recipe format (its dataclasses, the YAML parser, validation) and its data live in the package, so that
# gnmr-hf profile reads a recipe's data exactly as this script does
from gnmr_hf.recipe import (  # noqa: F401  (re-exported: the tests and the benches use finetune.NAME)
    BLOCKS,
    GENERATED,
    GNMR_PRECISIONS,
    HYBRID_OVERWRITTEN,
    INT8_PRECISIONS,
    LORA_INITS,
    NF4_PRECISIONS,
    PROFILE_POLICIES,
    PROFILE_STATIC_ONLY_IGNORED,
    SELECTION_KEYS,
    SMOLLM2,
    TEXT,
    GNMRArguments,
    LoraArguments,
    ProfileArguments,
    Recipe,
    RecipeError,
    RecipeParser,
    ScriptArguments,
    config_sources,
    load_config,
    load_records,
    read_config_file,
    template_fields,
    text_dataset,
    tokenize_dataset,
    training_rows,
    validate,
)

# ----------------------------------------------------------------------------------------------
# building blocks (importable: the tests and bench/gpu_13b_shape.py use them)


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: an offline model's cache (``smollm2-135m-instruct``, ``gemma3-270m``:
    ``gnmr_hf.offline.gguf_models``), a folder as given, or a hub id (offline cache)."""
    from gnmr_hf.offline.gguf_models import MODELS, gguf_checkpoint

    if name in MODELS:
        try:
            return str(gguf_checkpoint(name))
        except (FileNotFoundError, ImportError) as e:
            raise RecipeError(str(e)) from None
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise RecipeError(f"model folder {name} has no config.json")
        return name
    parts = name.split("/")
    if name.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts):
        raise RecipeError(f"model {name!r} not found (no such folder, and not a hub id)")
    from huggingface_hub import snapshot_download

    try:
        # a folder, so that the recovery path (gnmr) can read the original BF16 safetensors
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline without a cached copy, gated repo, typo in the id ...
        raise RecipeError(f"model {name!r} not found: not a folder, and the hub gave {type(e).__name__}: {e}") from None


def quantization_config(script: ScriptArguments):
    """The ``BitsAndBytesConfig`` of ``script.precision`` (None for bf16); 4-bit computes in
    ``script.compute_dtype``."""
    if script.precision == "bf16":
        return None
    import torch

    from gnmr_hf._import_utils import require

    require("bitsandbytes", f"precision: {script.precision}")
    from transformers import BitsAndBytesConfig

    if script.precision in INT8_PRECISIONS:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=getattr(torch, script.compute_dtype),
                              bnb_4bit_use_double_quant=script.bnb_4bit_use_double_quant)


def load_model(recipe: Recipe, model_path: str):
    """The base model for ``recipe.script.precision`` with LoRA applied (a ``peft.PeftModel``).

    ``recipe.script.compute_dtype`` is the dtype the model is loaded and computed in: the unquantised
    weights, the 4-bit compute dtype and the recovery weights (bench/nf4_bench.py uses FP32 on CPUs
    without BF16 matrix instructions).
    """
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, recipe.script.compute_dtype)

    # under DDP on GPUs each process holds a whole replica on its own device
    device_map = {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.cuda.is_available() else None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=device_map,
                                                     quantization_config=quantization_config(recipe.script))
    except OSError as e:
        raise RecipeError(f"could not load the model from {model_path}: {e}") from None
    if recipe.script.precision in GNMR_PRECISIONS:
        import gnmr_hf

        # before LoRA: the dual-path layers replace the quantised linears that LoRA then wraps
        # a profile plans single linears: each is its own unit (units="linears"), else the decoder layers
        model = gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=recipe.gnmr.storage,
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
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as e:  # e.g. target modules the model does not have
        raise RecipeError(f"LoRA: {e}") from None



def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("gnmr_hf", "torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def peak_memory() -> dict[str, Any]:
    """Peak device memory on a GPU (torch's allocator), else the process's peak resident set size."""
    import torch

    if torch.cuda.is_available():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_memory_kind": "torch.cuda.max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_memory_bytes": int(rss) * 1024, "peak_memory_kind": "peak RSS (CPU)"}


# ----------------------------------------------------------------------------------------------
# the run


def stored_bytes_per_bf16_byte(model) -> float:
    """The recovery weights' stored bytes per BF16 byte (1.0 for BF16, 2.0 for FP32): the dtype every
    dual-path layer keeps its checkpoint weight in."""
    import torch

    from gnmr_hf.backends.base import dual_path_modules

    dtypes = {m._gnmr_source.dtype for m in dual_path_modules(model) if getattr(m, "_gnmr_source", None) is not None}
    if len(dtypes) != 1:
        raise RecipeError(f"the dual-path layers keep their recovery weights in {len(dtypes)} dtypes "
                          f"({sorted(map(str, dtypes))}); a profile plan needs one")
    return torch.finfo(dtypes.pop()).bits / 16


def planned_policy(recipe: Recipe, model, train_ds, tokenizer,
                   model_path: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Profile the first ``recipe.profile.batches`` training batches, plan the BF16 linears within the
    budget and build the callback's policy (``StaticPolicy`` or ``HybridPolicy``); writes
    ``{output_dir}/profile.json`` (the profile, the plan and its ``skip_modules``) on the main process.

    Returns:
        ``(policy, plan_record)``.
    """
    from transformers import DataCollatorForSeq2Seq

    import gnmr_hf
    from gnmr_hf.core.controller import init_steps_from_fraction
    from gnmr_hf.planning import DEFAULT_CRITERION, memory_budget, parse_budget

    prof_args, args = recipe.profile, recipe.training
    bs = args.per_device_train_batch_size
    if len(train_ds) < prof_args.batches * bs:
        raise RecipeError(f"profile.batches {prof_args.batches} x batch size {bs} is more than the "
                          f"{len(train_ds)} training examples")
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    device = next(p.device for p in model.parameters())
    batches = [{k: v.to(device) for k, v in collate([train_ds[j] for j in range(i * bs, (i + 1) * bs)]).items()}
               for i in range(prof_args.batches)]
    if prof_args.ladder:
        return ladder_policy(recipe, model, batches, model_path or resolve_model_path(recipe.script.model))
    criterion = prof_args.criterion or DEFAULT_CRITERION
    # every rank profiles the same batches of the same weights, so every rank plans the same set
    profile = gnmr_hf.profile_sensitivity(model, batches, criteria=(criterion,),
                                          progress=args.process_index == 0 and not args.disable_tqdm)
    over_low = memory_budget(prof_args.budget, model_path or resolve_model_path(recipe.script.model),
                             [m for u in profile.units for m in u.modules], "nf4",
                             double_quant=recipe.script.bnb_4bit_use_double_quant)
    scale = stored_bytes_per_bf16_byte(model)
    if over_low is not None:
        # "+10%nf4": the plan adds that much to the served NF4 model (BF16 rungs); held in training at `scale`
        budget_bytes, fraction = int(over_low["bf16_budget"] * scale), None
    else:
        budget_bytes, fraction = parse_budget(prof_args.budget)
    budget = budget_bytes if budget_bytes is not None else int(fraction * profile.total_bytes)
    planned_budget = budget if prof_args.policy == "static" else int(budget * (1 - prof_args.gnmr_share))
    # the budget counts the bytes the recovery path holds: the profile prices BF16 weights, the dual
    # path stores them in the compute dtype (FP32 doubles each unit's price)
    plan = gnmr_hf.plan(profile, budget_bytes=int(planned_budget // scale), criterion=criterion, model=model,
                        batches=batches)
    unit_bytes = [int(u.bytes * scale) for u in profile.units]
    U = len(unit_bytes)
    if prof_args.policy == "static":
        policy = gnmr_hf.StaticPolicy(U, plan.indices, max_active=max(1, len(plan.indices)), unit_bytes=unit_bytes)
    else:
        config = recipe.gnmr.config
        if recipe.gnmr.init_fraction is not None:
            steps = args.max_steps if args.max_steps > 0 else 0
            config = dataclasses.replace(config, init_steps=init_steps_from_fraction(recipe.gnmr.init_fraction, steps))
        config = dataclasses.replace(config, max_active=U,
                                     max_active_bytes=budget - sum(unit_bytes[i] for i in plan.indices))
        policy = gnmr_hf.HybridPolicy(U, plan.indices, config, unit_bytes=unit_bytes)
    # the plan's own record first: its budget_bytes is the planned share in BF16 bytes, the run's is the
    # whole budget in held bytes
    record = {**plan.to_dict(), "plan_budget_bytes": plan.budget_bytes, "criterion": criterion,
              "budget_bytes": budget, "policy": prof_args.policy, "held_bytes": sum(unit_bytes[i] for i in plan.indices),
              "stored_bytes_per_bf16_byte": scale, **({} if over_low is None else {"memory_budget": over_low}),
              "profile_seconds": round(sum(c.get("seconds", 0.0) for c in profile.costs.values()), 2)}
    if args.process_index == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        profile.to_json(Path(args.output_dir) / "profile.json", plan=record, skip_modules=plan.skip_modules())
        print(plan.summary())
        if scale != 1:
            print(f"recovery weights stored in {recipe.script.compute_dtype}: {scale:g} bytes held per BF16 byte, "
                  f"so the plan holds {record['held_bytes'] / 2**20:.2f} MiB of the {budget / 2**20:.2f} MiB budget")
        print(f"profile.json: llm_int8_skip_modules for a stock BitsAndBytesConfig: {len(plan.skip_modules())} names")
    return policy, record


def ladder_policy(recipe: Recipe, model, batches, model_path: str) -> tuple[Any, dict[str, Any]]:
    """``profile.rungs: [int8, bf16]``: the precision ladder (``gnmr_hf.planning.ladder``). Every decoder
    linear's first-order gain on each rung is measured on ``batches`` with a stock-loaded NF4 model (a second
    load, freed before training), the rungs are chosen under ``profile.budget`` (memory over the NF4 model,
    weights and quant states as bitsandbytes stores them) by gain per byte, the dual path of ``model`` is
    set to those rungs (``prepare_dual_path(..., rungs=...)``) and the planned linears run on them at every
    step (``StaticPolicy``). Writes ``{output_dir}/profile.json`` with the ``rungs`` mapping that
    ``gnmr_hf.load_planned(model_path, profile.json)`` serves from stock bitsandbytes modules.

    Returns:
        ``(policy, plan_record)``.
    """
    import gc

    import torch

    import gnmr_hf
    from gnmr_hf.planning import memory_budget
    from gnmr_hf.planning.ladder import _stock_low, choose_rungs, plan_gain, rung_gains
    from gnmr_hf.planning.passes import _units

    prof_args, args, script = recipe.profile, recipe.training, recipe.script
    dtype = getattr(torch, script.compute_dtype)
    t0 = time.time()
    device = next(p.device for p in model.parameters())
    stock = _stock_low(model_path, "nf4", dtype, double_quant=script.bnb_4bit_use_double_quant,
                       device_map={"": device.index or 0} if device.type == "cuda" else None)
    try:
        ladder_units = rung_gains(stock, model_path, batches, "nf4", double_quant=script.bnb_4bit_use_double_quant)
    finally:
        del stock
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    over_low = memory_budget(prof_args.budget, model_path, [u.name for u in ladder_units], "nf4",
                             double_quant=script.bnb_4bit_use_double_quant)
    chosen = choose_rungs(ladder_units, over_low["over_low_bytes"], prof_args.rungs)
    gain, price = plan_gain(ladder_units, chosen)
    # the recovery path of every planned linear on its rung (INT8: Linear8bitLt over the checkpoint weight)
    gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=recipe.gnmr.storage, dtype=dtype,
                              units="linears", rungs=chosen)
    units = _units(model, "linears")
    names = [u.modules for u in units]
    indices = [i for i, mods in enumerate(names) if any(m in chosen for m in mods)]
    if sum(len(names[i]) for i in indices) != len(chosen):
        raise RecipeError(f"the ladder planned {len(chosen)} linears, the model's units hold "
                          f"{sum(len(names[i]) for i in indices)} of them")
    # what each unit's recovery path holds when active: a BF16 rung in the compute dtype, an INT8 rung its
    # int8 weight and row scales
    unit_bytes = [sum(m._gnmr_source.weight_bytes(m) for m in u.dual) for u in units]
    policy = gnmr_hf.StaticPolicy(len(units), indices, max_active=max(1, len(indices)), unit_bytes=unit_bytes)
    counts = {r: sum(1 for v in chosen.values() if v == r) for r in prof_args.rungs}
    record = {"rungs": chosen, "rung_counts": counts, "indices": indices, "modules": sorted(chosen),
              "skip_modules": sorted(n for n, r in chosen.items() if r == "bf16"),
              "gain": gain, "over_low_bytes": price, "memory_budget": over_low,
              "memory_over_nf4": price / over_low["low_model_bytes"], "held_bytes": policy.set_bytes,
              "budget_bytes": over_low["over_low_bytes"], "policy": "static", "criterion": "first_order",
              "profile_seconds": round(time.time() - t0, 2)}
    if args.process_index == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        saved = {"rungs": chosen, "plan": record,
                 "units": [{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                           for u in ladder_units]}
        tmp = Path(args.output_dir) / ".profile.json.tmp"
        tmp.write_text(json.dumps(saved, indent=1) + "\n")
        os.replace(tmp, Path(args.output_dir) / "profile.json")
        print(f"the precision ladder at {prof_args.budget}: {', '.join(f'{v} {k}' for k, v in counts.items())} "
              f"of {len(ladder_units)} linears, +{100 * record['memory_over_nf4']:.1f} % memory over the NF4 model "
              f"({price / 2**20:.2f} MiB), first-order gain {gain:.4g}")
        print("profile.json: serve the mixed model with gnmr_hf.load_planned(model_path, 'profile.json') "
              "(no stock loader mixes 4- and 8-bit linears)")
    return policy, record


def run(recipe: Recipe, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Train one LoRA adapter as ``recipe`` says; returns the run.json record (written on rank 0).

    Args:
        recipe: the configuration from :func:`load_config`.
        extra_callbacks: more ``TrainerCallback`` objects (bench/gpu_13b_shape.py times steps with one).
    """
    import torch
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, set_seed

    recipe = validate(recipe)  # before anything is loaded or written
    script, args = recipe.script, recipe.training
    start = time.time()
    # bitsandbytes warns on every INT8 matmul that it casts BF16 inputs to FP16; once is enough
    warnings.filterwarnings("once", message="MatMul8bitLt: inputs will be cast")
    if args.process_index == 0:
        Path(args.output_dir, "run.json").unlink(missing_ok=True)  # a stale one would mark this run done
    set_seed(args.seed)
    model_path = resolve_model_path(script.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # one process writes the generated data and the tokenised cache, the others then read them
    with args.main_process_first(desc="dataset"):
        train_ds, text_summary = training_rows(script, tokenizer, args.output_dir)

    callbacks = list(extra_callbacks or [])
    if recipe.profile.enabled:
        # the callback needs the plan: built after the model is loaded and profiled; the data checked now
        bs = args.per_device_train_batch_size
        if len(train_ds) < recipe.profile.batches * bs:
            raise RecipeError(f"profile.batches {recipe.profile.batches} (set {recipe.profile.given.get('batches', 'by default')})"
                              f" x batch size {bs} is more than the {len(train_ds)} training examples")
    elif script.precision in GNMR_PRECISIONS or recipe.gnmr.monitor:
        import gnmr_hf

        try:  # before the model: the callback's own argument checks end the run with one line
            callbacks.append(gnmr_hf.GNMRCallback(recipe.gnmr.config, init_fraction=recipe.gnmr.init_fraction))
        except (TypeError, ValueError) as e:
            raise RecipeError(f"gnmr: {e}") from None

    model = load_model(recipe, model_path)
    if args.process_index == 0:
        model.print_trainable_parameters()
    planned = None
    if recipe.profile.enabled:
        policy, planned = planned_policy(recipe, model, train_ds, tokenizer, model_path)
        callbacks.append(__import__("gnmr_hf").GNMRCallback(policy=policy))
    loftq = None
    if recipe.lora.lora_init == "loftq":
        # after the plan: its linears run on BF16 (no quantisation residual) and keep the default init
        from gnmr_hf.loftq import replace_lora_weights_loftq

        t0 = time.time()
        skip = list((planned or {}).get("modules") or [])
        # counted, not assumed: the pairs whose A and B are bit-identical to their default init afterwards
        pairs = {id(m): (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
                 for m in model.modules() if isinstance(getattr(m, "lora_B", None), torch.nn.ModuleDict)
                 and "default" in m.lora_B}
        try:
            replace_lora_weights_loftq(model, model_path, skip=skip,
                                       progress=args.process_index == 0 and not args.disable_tqdm)
        except ValueError as e:  # a rank above a linear's dimension, another checkpoint: one line
            raise RecipeError(f"lora_init: loftq: {e}") from None
        kept = sum(1 for m in model.modules() if id(m) in pairs
                   and torch.equal(m.lora_A["default"].weight, pairs[id(m)][0])
                   and torch.equal(m.lora_B["default"].weight, pairs[id(m)][1]))
        loftq = {"seconds": round(time.time() - t0, 2), "kept_default": kept, "skip": len(skip)}
        if args.process_index == 0:
            print(f"lora_init: loftq ({loftq['seconds']:.1f} s; {kept} LoRA pairs keep the default init, "
                  f"{len(skip)} planned linears asked)")

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=callbacks,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.time() - start

    trainer.save_model(args.output_dir)  # a PeftModel saves just the adapter
    trainer.save_state()  # trainer_state.json: the loss log the demo plots
    record: dict[str, Any] = {}
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        record = {
            "status": "complete",
            "config": {"script": dataclasses.asdict(script), "lora": dataclasses.asdict(recipe.lora),
                       "gnmr": recipe.gnmr.to_dict(), "training": json.loads(args.to_json_string())},
            "config_file": recipe.config_file,
            "model_path": model_path,
            "versions": package_versions(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "world_size": args.world_size,
            "num_train_examples": len(train_ds),
            "global_step": trainer.state.global_step,
            "wall_time_s": round(train_seconds, 2),
            "train_runtime_s": result.metrics.get("train_runtime"),
            "final_loss": losses[-1] if losses else None,
            "first_loss": losses[0] if losses else None,
            "mean_train_loss": result.training_loss,
            **peak_memory(),
            "gnmr_summary": None,
        }
        if text_summary is not None:
            record["text_data"] = text_summary
        if planned is not None:
            record["profile"] = {**recipe.profile.to_dict(), "plan": planned}
        if loftq is not None:
            record["loftq"] = loftq
        summary = Path(args.output_dir) / "gnmr_summary.json"
        if summary.is_file():
            record["gnmr_summary"] = json.loads(summary.read_text())
        tmp = Path(args.output_dir) / ".run.json.tmp"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, Path(args.output_dir) / "run.json")  # run.json last: it marks a complete run
        print(f"run.json: final loss {record['final_loss']}, wall time {record['wall_time_s']} s, "
              f"peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB ({record['peak_memory_kind']})")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        RecipeParser().print_help()
        return 0
    from gnmr_hf._import_utils import quiet_import_noise

    quiet_import_noise()
    try:
        run(load_config(argv))
    except (RecipeError, ImportError) as e:  # gnmr_hf's require() names the extra to install
        print(f"finetune.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
