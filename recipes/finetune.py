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

if __name__ == "__main__":  # a misspelt model, a missing config or data file: one line before transformers loads
    from gnmr_hf.preflight import check_recipe

    _why = check_recipe(sys.argv[1:])
    if _why:
        print(f"finetune.py: error: {_why}", file=sys.stderr)
        raise SystemExit(2)

if __name__ == "__main__":  # before gnmr_hf.recipe's imports (transformers), which load torchao and bitsandbytes
    from gnmr_hf._import_utils import quiet_import_noise

    quiet_import_noise()  # their messages at import (--help included) that a user cannot act on

# the recipe format (its dataclasses, the YAML parser, validation) and its data live in the package, so that
# gnmr-hf profile reads a recipe's data exactly as this script does
from gnmr_hf.recipe import (  # noqa: E402, F401  (re-exported: the tests and the benches use finetune.NAME)
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
# building blocks (importable: the tests and bench/gpu/gpu_13b_shape.py use them)


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: an offline model's cache (``smollm2-135m-instruct``, ``gemma3-270m``:
    ``gnmr_hf.offline.gguf_models``), a folder as given, or a hub id (offline cache)."""
    from gnmr_hf.offline.gguf_models import resolve_model

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
    from gnmr_hf.backends.dispatch import PREQUANTISED, prequantised

    what = prequantised(model_path)
    if what:
        raise RecipeError(PREQUANTISED.format(source=f"model {model_path}", what=what))


def sharded_run(args) -> bool:
    """Whether the run asks for FSDP: the Trainer's ``fsdp`` argument (``--fsdp full_shard --fsdp_config ...``) or
    an ``accelerate launch`` FSDP config (which sets ``ACCELERATE_USE_FSDP``)."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


#: the precisions that shard under FSDP2: a 4-bit base stored in the compute dtype (``bnb_4bit_quant_storage``)
SHARDABLE = ("bf16", *NF4_PRECISIONS)


def prepare_sharding(recipe: Recipe) -> None:
    """A sharded (FSDP) run: refuse what cannot shard in one line (an INT8 base: ``Int8Params`` are integer
    weights with their row scales beside them; FSDP1), and on a machine without CUDA let accelerate's FSDP plugin
    take effect in the CPU processes (``recipes/stress/pretrain.accelerate_fsdp_on_cpu``: tests, dry runs)."""
    import torch

    script, args = recipe.script, recipe.training
    if script.precision not in SHARDABLE:
        raise RecipeError(f"precision {script.precision} does not shard under FSDP: its INT8 base (Int8Params) cannot "
                          f"be sharded; shard {', '.join(SHARDABLE)} (docs/fsdp2.md) or train {script.precision} with "
                          "DDP (recipes/accelerate/2gpu-ddp.yaml)")
    config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    version = int(config.get("version", os.environ.get("FSDP_VERSION", 1)) or 1)
    if version != 2:
        raise RecipeError(f"FSDP version {version}: the recipes shard with FSDP2 only (fsdp_version: 2, "
                          "recipes/accelerate/fsdp2-qlora.yaml, docs/fsdp2.md)")
    if not torch.cuda.is_available():
        import importlib.util

        spec = importlib.util.spec_from_file_location("gnmr_stress_pretrain",
                                                      Path(__file__).resolve().parent / "stress" / "pretrain.py")
        pretrain = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pretrain)
        pretrain.accelerate_fsdp_on_cpu()


def same_plan_on_every_rank(plan: dict[str, Any]) -> int:
    """Check that every rank planned the same linears (each profiles the same batches; a difference would make
    the ranks train different models): rank 0's plan is gathered with every other rank's and compared on every
    rank, so all of them stop together on a difference. Returns the number of ranks that agreed (1 without a
    process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1
    mine = {k: plan.get(k) for k in ("indices", "modules", "rungs")}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    odd = [r for r, p in enumerate(every) if p != every[0]]
    if odd:
        raise RecipeError(f"the ranks planned different linears (rank {odd[0]} differs from rank 0: "
                          f"{every[odd[0]]['indices']} vs {every[0]['indices']}); profile.batches must read the "
                          "same data on every rank")
    return len(every)


def save_sharded_adapter(trainer, output_dir: str) -> None:
    """Save the LoRA adapter of an FSDP2 run as a stock PEFT adapter: the Trainer's ``save_model`` writes nothing
    for a sharded state dict outside checkpoints, so every trainable (LoRA) ``DTensor`` is gathered in full (a
    collective, the same order on every rank; the 4-bit base is not gathered) and rank 0 writes it."""
    from torch.distributed.tensor import DTensor

    model = trainer.accelerator.unwrap_model(trainer.model)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for n, p in model.named_parameters() if p.requires_grad}
    if trainer.is_world_process_zero():
        model.save_pretrained(output_dir, state_dict=full)


def quantization_config(script: ScriptArguments, sharded: bool = False):
    """The ``BitsAndBytesConfig`` of ``script.precision`` (None for bf16); 4-bit computes in
    ``script.compute_dtype``. ``sharded`` (an FSDP run): the 4-bit weights are packed into the compute dtype
    (``bnb_4bit_quant_storage``), so that FSDP2 shards them as ordinary tensors (the route transformers, PEFT and
    bitsandbytes document for FSDP + QLoRA)."""
    if script.precision == "bf16":
        return None
    import torch

    from gnmr_hf._import_utils import require

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
    import torch
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
    name_model(model, model_path)
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as e:  # e.g. target modules the model does not have
        raise RecipeError(f"LoRA: {e}") from None



def name_model(model, model_path: str) -> str:
    """Name the loaded model by its name, not this machine's folder (``gnmr_hf.export_folder.model_name``: the
    alias, the hub id, else the folder's base name), before LoRA is applied: PEFT records
    ``model.name_or_path`` as the adapter's ``base_model_name_or_path`` (adapter_config.json) and the config's
    ``_name_or_path`` as ``base_model`` in its README.md, and a planned recipe's profile.json records the latter
    too, all in the training folder users publish. The weights are read before (and the recovery path from
    ``model_path``), so nothing loads by this name; the saved adapter loads with stock PEFT given the model
    (``PeftModel.from_pretrained(model, run_dir)``). Returns the name."""
    from gnmr_hf.export_folder import model_name

    name = model_name(model_path)
    model.config.name_or_path = name  # the config's _name_or_path
    model.name_or_path = name
    return name


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


def _unit_prices(units, rungs: tuple[str, ...], double_quant: bool) -> list[dict[str, int]]:
    """Each unit's price on each rung in the one currency: what it adds to the served model over NF4."""
    from gnmr_hf.planning.budget import rung_price

    return [{r: sum(rung_price(m.out_features * m.in_features, m.out_features, r, "nf4", double_quant)
                    for m in u.dual) for r in rungs} for u in units]


def _serving_layout(recipe: Recipe, model, units):
    """``profile.groups``' serving groups over the units' linears (None for a free plan), read from the model's
    architecture; an unknown layout is refused in one line before anything is profiled."""
    if recipe.profile.groups is None:
        return None
    from gnmr_hf.planning.planner import serving_layout

    try:
        return serving_layout(recipe.profile.groups, model=model, linears=[m for u in units for m in u.modules])
    except ValueError as e:
        raise RecipeError(f"profile.groups {recipe.profile.groups}: {e}") from None


def _served_budget(recipe: Recipe, model_path: str, units, prices: list[dict[str, int]]) -> dict[str, Any]:
    """``profile.budget`` in the one currency (``gnmr_hf.planning.budget.served_budget``), refused in one line
    before anything is profiled when it buys no unit or exceeds what there is to keep."""
    from gnmr_hf.planning import over_low_prices
    from gnmr_hf.planning.budget import budget_refusal, served_budget

    text, dq = recipe.profile.budget, recipe.script.bnb_4bit_use_double_quant
    linears = [m for u in units for m in u.modules]
    nf4 = over_low_prices(model_path, linears, "nf4", dq)["low_model_bytes"]
    try:
        budget = served_budget(text, nf4, sum(p["bf16"] for p in prices) if "bf16" in recipe.profile.rungs
                               else sum(max(p.values()) for p in prices))
    except ValueError as e:
        raise RecipeError(f"profile.{e}") from None
    cheapest = [min((v, r) for r, v in p.items()) for p in prices]
    why = budget_refusal(text, budget, cheapest, [max(p.values()) for p in prices], [u.name for u in units])
    if why:
        raise RecipeError(f"profile.{why}")
    return {"budget": text, "budget_bytes": budget, "nf4_model_bytes": nf4}


def _currency_record(budget: dict[str, Any], price: int, held: int) -> dict[str, Any]:
    """run.json's budget keys, the same in every planned recipe (docs/profile.md, "The one budget currency")."""
    nf4 = budget["nf4_model_bytes"]
    return {"budget": budget["budget"], "budget_bytes": budget["budget_bytes"], "price_over_nf4_bytes": price,
            "memory_over_nf4": price / nf4, "nf4_model_bytes": nf4, "held_bytes": held, "held_over_nf4": held / nf4}


def planned_policy(recipe: Recipe, model, train_ds, tokenizer,
                   model_path: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Profile the first ``recipe.profile.batches`` training batches, plan the BF16 linears within the
    budget and build the callback's policy (``StaticPolicy`` or ``HybridPolicy``); writes
    ``{output_dir}/profile.json`` (the profile, the plan and its ``skip_modules``) on the main process.

    The budget is in the one currency of every planned recipe: what the plan adds to the served model over
    the all-NF4 one (BF16 rungs at BF16 bytes less the NF4 bytes they replace), whatever ``compute_dtype``
    the recovery path holds them in; a budget that buys no unit is refused before the profile.

    Returns:
        ``(policy, plan_record)``.
    """
    from transformers import DataCollatorForSeq2Seq

    import gnmr_hf
    from gnmr_hf.core.controller import init_steps_from_fraction
    from gnmr_hf.planning import DEFAULT_CRITERION
    from gnmr_hf.planning.budget import budget_refusal, planner_budget
    from gnmr_hf.planning.passes import _units

    prof_args, args = recipe.profile, recipe.training
    if prof_args.plan is not None:  # --profile.plan: the saved plan, nothing profiled
        return saved_plan_policy(recipe, model, model_path or resolve_model_path(recipe.script.model))
    bs = args.per_device_train_batch_size
    if len(train_ds) < prof_args.batches * bs:
        raise RecipeError(f"profile.batches {prof_args.batches} x batch size {bs} is more than the "
                          f"{len(train_ds)} training examples")
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    device = next(p.device for p in model.parameters())
    batches = [{k: v.to(device) for k, v in collate([train_ds[j] for j in range(i * bs, (i + 1) * bs)]).items()}
               for i in range(prof_args.batches)]
    model_path = model_path or resolve_model_path(recipe.script.model)
    if prof_args.ladder:
        return ladder_policy(recipe, model, batches, model_path)
    criterion = prof_args.criterion or DEFAULT_CRITERION
    # the budget in the one currency, checked before the profile costs anything
    units = _units(model, "linears")
    prices = [p["bf16"] for p in _unit_prices(units, ("bf16",), recipe.script.bnb_4bit_use_double_quant)]
    currency = _served_budget(recipe, model_path, units, [{"bf16": p} for p in prices])
    budget = currency["budget_bytes"]
    layout = _serving_layout(recipe, model, units)  # profile.groups: whole serving groups (None: free)
    planned_budget = budget if prof_args.policy == "static" else int(budget * (1 - prof_args.gnmr_share))
    if planned_budget < budget:
        why = budget_refusal(f"{prof_args.budget} x (1 - profile.gnmr_share {prof_args.gnmr_share:g})", planned_budget,
                             [(p, "bf16") for p in prices], prices, [u.name for u in units])
        if why:
            raise RecipeError(f"profile.{why}")
    # what each unit's recovery path holds when active: its checkpoint weight in the compute dtype
    unit_bytes = [sum(m._gnmr_source.weight_bytes(m) for m in u.dual) for u in units]
    scale = stored_bytes_per_bf16_byte(model)
    # every rank profiles the same batches of the same weights, so every rank plans the same set
    profile = gnmr_hf.profile_sensitivity(model, batches, criteria=(criterion,),
                                          progress=args.process_index == 0 and not args.disable_tqdm)
    if [u.name for u in profile.units] != [u.name for u in units]:
        raise RecipeError(f"the profile's {len(profile.units)} units are not the model's {len(units)} linears")
    # the planner chooses in its own unit (BF16 bytes): the largest BF16 budget whose set fits the served one
    sizes = [u.bytes for u in profile.units]
    scores = profile.scores(profile._score_name(criterion))
    if layout is None:
        bf16_budget = planner_budget(scores, sizes, prices, planned_budget)
    else:  # the grouped planner's purchases: a group's score, bytes and price are its members' sums
        from gnmr_hf.planning.groups import purchase_totals, purchases

        buys = purchases([u.modules for u in profile.units], layout)
        bf16_budget = planner_budget(*(purchase_totals(buys, v) for v in (scores, sizes, prices)), planned_budget)
    try:
        plan = gnmr_hf.plan(profile, budget_bytes=bf16_budget, criterion=criterion, model=model, batches=batches,
                            groups=prof_args.groups)
    except ValueError as e:
        raise RecipeError(f"profile.budget {prof_args.budget}: {e}") from None
    chosen = plan.indices
    price = sum(prices[i] for i in chosen)
    if price > planned_budget:  # planner_budget's promise, checked
        raise RecipeError(f"the plan costs {price} B over NF4, more than its budget {planned_budget} B")
    if not chosen and prof_args.policy == "static":
        raise RecipeError(f"profile.budget {prof_args.budget} = {budget} B over the NF4 model buys nothing: no linear "
                          f"that fits has a positive {criterion} score on the {prof_args.batches} profiled batch(es) "
                          "(give a larger budget or other data, or plan without one: precision nf4)")
    U = len(unit_bytes)
    held = sum(unit_bytes[i] for i in chosen)
    extra: dict[str, Any] = {}
    if prof_args.policy == "static":
        policy = gnmr_hf.StaticPolicy(U, chosen, max_active=max(1, len(chosen)), unit_bytes=unit_bytes)
    else:
        config = recipe.gnmr.config
        if recipe.gnmr.init_fraction is not None:
            steps = args.max_steps if args.max_steps > 0 else 0
            config = dataclasses.replace(config, init_steps=init_steps_from_fraction(recipe.gnmr.init_fraction, steps))
        # GNMR gets the rest of the budget; the controller counts held bytes, so the rest is turned into held
        # bytes at the smallest held-per-served ratio of any linear: any set it holds then fits the rest as served
        rest = budget - price
        cap = int(rest * min(h / p for h, p in zip(unit_bytes, prices) if p > 0))
        config = dataclasses.replace(config, max_active=U, max_active_bytes=cap)
        policy = gnmr_hf.HybridPolicy(U, chosen, config, unit_bytes=unit_bytes)
        extra = {"gnmr_budget_bytes": rest, "gnmr_max_active_bytes": cap}
    # the plan's own record first (its budget_bytes and bytes are the planner's BF16 bytes), then the run's
    record = {**plan.to_dict(), "plan_budget_bytes": plan.budget_bytes, "criterion": criterion,
              "policy": prof_args.policy, "low": "nf4" if recipe.script.precision in NF4_PRECISIONS else "int8",
              **_currency_record(currency, price, held), **extra,
              "stored_bytes_per_bf16_byte": scale,
              "profile_seconds": round(sum(c.get("seconds", 0.0) for c in profile.costs.values()), 2)}
    if args.process_index == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        profile.to_json(Path(args.output_dir) / "profile.json", plan=record, skip_modules=plan.skip_modules())
        print(plan.summary())
        print(f"budget {prof_args.budget}: {budget / 2**20:.2f} MiB over the {currency['nf4_model_bytes'] / 2**20:.1f} "
              f"MiB NF4 model; the plan adds {price / 2**20:.2f} MiB served (+{100 * price / currency['nf4_model_bytes']:.1f} "
              f"%) and its recovery path holds {held / 2**20:.2f} MiB in {recipe.script.compute_dtype} while training")
        print(f"profile.json: llm_int8_skip_modules for a stock BitsAndBytesConfig: {len(plan.skip_modules())} names")
    return policy, record


def check_saved_plan(recipe: Recipe, model_path: str):
    """``profile.plan`` read (:meth:`gnmr_hf.planning.Plan.load`) and checked against this run before anything is
    trained: the model (its recorded identity, else the shapes it records), the low format, the group size, the
    rungs it was chosen over and its serving groups; one ``RecipeError`` line naming what differs and, where a
    profile command writes a plan that fits, that command."""
    from gnmr_hf.planning.ladder import _check_same_model
    from gnmr_hf.planning.plan import Plan, PlanError

    prof = recipe.profile
    precision = recipe.script.precision
    low = "nf4" if precision in NF4_PRECISIONS else "int8"
    rungs = "+".join(prof.rungs)
    try:
        plan = Plan.load(prof.plan, rung_set=prof.rungs)
    except (PlanError, ValueError) as e:
        raise RecipeError(f"profile.plan: {e}") from None
    where = f"profile.plan {plan.source}"
    if not plan.planned:
        raise RecipeError(f"{where} holds a profile and no plan: give the output of gnmr-hf profile --budget ... "
                          "or of a planned run")
    budget = plan.budget if plan.budget and plan.budget.endswith(low) else f"+10%{low}"
    profile_cmd = f"gnmr-hf profile --model {recipe.script.model} --low {low} --budget {budget}"
    if plan.low != low or plan.group_size is not None:
        raise RecipeError(f"{where} is {plan.describe()}; this run trains over {low} (precision {precision}): profile "
                          f"it over {low} ({profile_cmd} --output DIR)")
    if plan.rung_set != prof.rungs:
        if prof.ladder and plan.rung_set == ("bf16",):
            fix = (f"{profile_cmd} --output DIR writes the ladder plan beside the BF16-only one (its ladder table at "
                   f"the budget; not with --no-ladder), or train the BF16-only plan with profile.rungs bf16 "
                   f"(planned-nf4.yaml)" if low != "int8" else "a ladder run's output folder holds one")
        elif not prof.ladder:
            fix = "give a BF16-only plan (gnmr-hf profile's, a planned-nf4 run's) or train it with profile.rungs " \
                  f"{','.join(plan.rung_set)} (planned-ladder-nf4.yaml)"
        else:
            fix = f"train it with profile.rungs {','.join(plan.rung_set)}"
        raise RecipeError(f"{where} is {plan.describe()}, not a plan over [{rungs.replace('+', ', ')}] as this recipe's "
                          f"profile.rungs: {fix}")
    if plan.groups != prof.groups:
        made = f"grouped ({plan.groups})" if plan.groups else "free"
        fix = (f"{profile_cmd} --groups {prof.groups} --output DIR" if prof.groups and not prof.ladder
               else "a run of this recipe without profile.plan" if prof.groups
               else f"profile.groups {plan.groups} trains it as planned")
        raise RecipeError(f"{where} was planned {made}, not with profile.groups {prof.groups or 'null'}: {fix}")
    try:
        _check_same_model(plan.source, plan.data, model_path,
                          fix=f"profile the model this run trains: {profile_cmd} --output DIR")
    except ValueError as e:
        raise RecipeError(f"profile.plan: {e}") from None
    return plan


def saved_plan_policy(recipe: Recipe, model, model_path: str) -> tuple[Any, dict[str, Any]]:
    """``profile.plan``: train with a saved plan (:func:`check_saved_plan`) as it is, profiling nothing. The plan's
    linears are put on their rungs (a ladder plan: ``prepare_dual_path(..., rungs=...)``) and run on them at every
    step (``StaticPolicy``); ``{output_dir}/profile.json`` records the same plan, in the schema the run would have
    written (the plan's profile with the run's record, or the ladder's ``rungs`` file), so that the exports, eval
    and ``load_planned`` read it as before.

    Returns:
        ``(policy, plan_record)``.
    """
    import torch

    import gnmr_hf
    from gnmr_hf.planning.passes import _units
    from gnmr_hf.planning.results import SensitivityProfile

    plan = check_saved_plan(recipe, model_path)
    prof_args, args, script = recipe.profile, recipe.training, recipe.script
    dtype = getattr(torch, script.compute_dtype)
    chosen = dict(plan.rungs)
    linears = {m for u in _units(model, "linears") for m in u.modules}
    missing = sorted(set(chosen) - linears)
    if missing:
        raise RecipeError(f"profile.plan {plan.source} plans {len(missing)} linear(s) this model's dual path does not "
                          f"hold, e.g. {missing[0]}")
    if prof_args.ladder:  # the recovery path of every planned linear on its rung (INT8: Linear8bitLt)
        gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=recipe.gnmr.storage, dtype=dtype,
                                  units="linears", rungs=chosen)
    units = _units(model, "linears")
    indices = [i for i, u in enumerate(units) if any(m in chosen for m in u.modules)]
    unit_bytes = [sum(m._gnmr_source.weight_bytes(m) for m in u.dual) for u in units]
    policy = gnmr_hf.StaticPolicy(len(units), indices, max_active=max(1, len(indices)), unit_bytes=unit_bytes)
    prices = _unit_prices(units, prof_args.rungs, script.bnb_4bit_use_double_quant)
    price = sum(prices[i][chosen[m]] for i in indices for m in units[i].modules if m in chosen)
    from gnmr_hf.planning import over_low_prices

    nf4 = over_low_prices(model_path, sorted(linears), "nf4", script.bnb_4bit_use_double_quant)["low_model_bytes"]
    currency = {"budget": plan.budget, "budget_bytes": plan.budget_bytes, "nf4_model_bytes": nf4}
    modules = [m for i in indices for m in units[i].modules if m in chosen]
    record = {"rungs": chosen, "indices": indices, "modules": modules, "names": [units[i].name for i in indices],
              "skip_modules": sorted(n for n, r in chosen.items() if r == "bf16") if prof_args.ladder
              else plan.skip_modules(), "criterion": plan.chosen_by.get("criterion"), "policy": "static",
              **_currency_record(currency, price, policy.set_bytes), "groups": plan.groups,
              "stored_bytes_per_bf16_byte": torch.finfo(dtype).bits / 16, "profile_seconds": 0.0,
              "plan_file": str(plan.source), "planned_by": plan.chosen_by.get("writer"), "low": plan.low}
    if prof_args.ladder:
        record["rung_counts"] = {r: sum(1 for v in chosen.values() if v == r) for r in prof_args.rungs}
    if args.process_index == 0:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        data = plan.data
        if prof_args.ladder:
            from gnmr_hf.planning.profiler import model_identity

            saved = {"rungs": chosen, "plan": record, "model_identity": plan.model_identity or model_identity(model_path)}
            units_json = data.get("units") if "rungs" in data else None
            if isinstance(units_json, list) and all(isinstance(u, dict) and "numel" in u for u in units_json):
                saved["units"] = units_json  # a ladder run's own per-linear gains and prices
            tmp = out / ".profile.json.tmp"
            tmp.write_text(json.dumps(saved, indent=1) + "\n")
            os.replace(tmp, out / "profile.json")
        elif "units" in data and "losses" in data:  # a profile with its plan: the profile, the run's record
            SensitivityProfile.from_dict(data).to_json(out / "profile.json", plan=record,
                                                       skip_modules=plan.skip_modules())
        else:
            plan.save(out / "profile.json", plan=record)
        print(f"profile.plan {plan.source}: {plan.describe()}, {len(chosen)} planned linear(s), used as saved (nothing "
              f"profiled); {price / 2**20:.2f} MiB served over the NF4 model")
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
    # the budget in the one currency, and a budget that buys no rung refused, before the profile's own load
    pre = _units(model, "linears")
    currency = _served_budget(recipe, model_path, pre, _unit_prices(pre, prof_args.rungs, script.bnb_4bit_use_double_quant))
    layout = _serving_layout(recipe, model, pre)  # profile.groups: one rung per serving group (None: free)
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
    if sorted(u.name for u in ladder_units) != sorted(m for u in pre for m in u.modules):
        raise RecipeError(f"the ladder profiled {len(ladder_units)} linears, the model's units hold "
                          f"{sum(len(u.modules) for u in pre)}")
    over_low = memory_budget(prof_args.budget, model_path, [u.name for u in ladder_units], "nf4",
                             double_quant=script.bnb_4bit_use_double_quant)
    if over_low["over_low_bytes"] != currency["budget_bytes"]:
        raise RecipeError(f"profile.budget {prof_args.budget}: {over_low['over_low_bytes']} B over NF4 from the "
                          f"checkpoint's config, {currency['budget_bytes']} B from the loaded model")
    chosen = choose_rungs(ladder_units, over_low["over_low_bytes"], prof_args.rungs, groups=layout)
    if not chosen:  # as the BF16 planner refuses a budget that buys nothing: no plain NF4 run called planned
        raise RecipeError(f"profile.budget {prof_args.budget} = {over_low['over_low_bytes']} B over the NF4 model buys "
                          f"nothing on the ladder [{', '.join(prof_args.rungs)}]: no linear that fits has a positive "
                          f"first-order gain on the {prof_args.batches} profiled batch(es) (give a larger budget or "
                          "other data, or plan without one: precision nf4)")
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
              **_currency_record(currency, price, policy.set_bytes), "policy": "static", "criterion": "first_order",
              "stored_bytes_per_bf16_byte": torch.finfo(dtype).bits / 16, "groups": prof_args.groups, "low": "nf4",
              "profile_seconds": round(time.time() - t0, 2)}
    if args.process_index == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        from gnmr_hf.planning.profiler import model_identity

        # the checkpoint the plan was made on: load_planned checks it
        saved = {"rungs": chosen, "plan": record, "model_identity": model_identity(model_path),
                 "units": [{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                           for u in ladder_units]}
        tmp = Path(args.output_dir) / ".profile.json.tmp"
        tmp.write_text(json.dumps(saved, indent=1) + "\n")
        os.replace(tmp, Path(args.output_dir) / "profile.json")
        print(f"the precision ladder at {prof_args.budget}: {', '.join(f'{v} {k}' for k, v in counts.items())} "
              f"of {len(ladder_units)} linears, +{100 * record['memory_over_nf4']:.1f} % memory over the NF4 model "
              f"({price / 2**20:.2f} MiB served), first-order gain {gain:.4g}; its recovery path holds "
              f"{record['held_bytes'] / 2**20:.2f} MiB in {script.compute_dtype} while training")
        print("profile.json: serve the mixed model with gnmr_hf.load_planned(model_path, 'profile.json') "
              "(no stock loader mixes 4- and 8-bit linears)")
    return policy, record


def run(recipe: Recipe, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Train one LoRA adapter as ``recipe`` says; returns the run.json record (written on rank 0).

    Args:
        recipe: the configuration from :func:`load_config`.
        extra_callbacks: more ``TrainerCallback`` objects (bench/gpu/gpu_13b_shape.py times steps with one).
    """
    import torch
    from transformers import set_seed  # trainer_utils, loaded by load_config

    recipe = validate(recipe)  # before anything is loaded or written
    script, args = recipe.script, recipe.training
    start = time.time()
    # bitsandbytes warns on every INT8 matmul that it casts BF16 inputs to FP16; once is enough
    warnings.filterwarnings("once", message="MatMul8bitLt: inputs will be cast")
    if sharded_run(args):
        prepare_sharding(recipe)  # before the model is loaded (its 4-bit storage) and the Trainer built
    if args.process_index == 0:
        Path(args.output_dir, "run.json").unlink(missing_ok=True)  # a stale one would mark this run done
    set_seed(args.seed)
    model_path = resolve_model_path(script.model)
    refuse_prequantised(model_path)  # before the data is built and the model loaded
    # the Trainer's modules only now: a run refused above (a bad model name or folder) ends without them
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # one process writes the generated data and the tokenised cache, the others then read them
    with args.main_process_first(desc="dataset"):
        train_ds, text_summary = training_rows(script, tokenizer, args.output_dir)

    callbacks = list(extra_callbacks or [])
    if recipe.profile.enabled:
        # the callback needs the plan: built after the model is loaded and profiled; the data checked now (a
        # saved plan, profile.plan, profiles nothing)
        bs = args.per_device_train_batch_size
        if recipe.profile.plan is None and len(train_ds) < recipe.profile.batches * bs:
            raise RecipeError(f"profile.batches {recipe.profile.batches} (set {recipe.profile.given.get('batches', 'by default')})"
                              f" x batch size {bs} is more than the {len(train_ds)} training examples")
    elif script.precision in GNMR_PRECISIONS or recipe.gnmr.monitor:
        import gnmr_hf

        try:  # before the model: the callback's own argument checks end the run with one line
            callbacks.append(gnmr_hf.GNMRCallback(recipe.gnmr.config, init_fraction=recipe.gnmr.init_fraction))
        except (TypeError, ValueError) as e:
            raise RecipeError(f"gnmr: {e}") from None

    if recipe.profile.enabled and recipe.profile.plan is not None:
        check_saved_plan(recipe, model_path)  # a plan that does not fit this run: one line, before the model loads
    model = load_model(recipe, model_path)
    if args.process_index == 0:
        model.print_trainable_parameters()
    planned = None
    if recipe.profile.enabled:
        policy, planned = planned_policy(recipe, model, train_ds, tokenizer, model_path)
        planned["ranks_agreed"] = same_plan_on_every_rank(planned)  # every rank profiled: the same plan, checked
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

    calibrated = None
    if recipe.lora.lora_init == "calibrated":
        # after the plan, as LoftQ: the linears it keeps off NF4 keep the default init; calibrated on the first
        # profile.batches training batches (the profile's own batches when the recipe plans)
        from gnmr_hf.calibrated_init import calibrated_lora_init

        bs = args.per_device_train_batch_size
        n = min(recipe.profile.batches, max(1, len(train_ds) // bs))
        collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        calib = [collate([train_ds[j] for j in range(i * bs, min((i + 1) * bs, len(train_ds)))]) for i in range(n)]
        skip = list((planned or {}).get("modules") or [])
        from gnmr_hf.backends.base import active_units, set_active_units

        before = active_units(model) if planned else None
        if planned:  # calibrated on the inputs of the model it trains: the planned linears on their rungs
            set_active_units(model, planned["indices"])
        try:
            summary = calibrated_lora_init(model, calib, model_path, skip=skip,
                                           progress=args.process_index == 0 and not args.disable_tqdm)
        except ValueError as e:
            raise RecipeError(f"lora_init: calibrated: {e}") from None
        finally:
            if planned:
                set_active_units(model, before)
        calibrated = {k: summary[k] for k in ("seconds", "linears", "skipped", "tokens", "damp", "output_error")}
        if args.process_index == 0:
            err = summary["output_error"]
            print(f"lora_init: calibrated ({summary['seconds']:.1f} s; {summary['linears']} LoRA pairs on "
                  f"{summary['tokens']} tokens, {summary['skipped']} planned linears keep the default init; output "
                  f"error {err['calibrated'] / max(err['zero'], 1e-30):.3f} of NF4's, LoftQ's would be "
                  f"{err['loftq'] / max(err['zero'], 1e-30):.3f})")

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

    if sharded_run(args):
        save_sharded_adapter(trainer, args.output_dir)
    else:
        trainer.save_model(args.output_dir)  # a PeftModel saves just the adapter
    trainer.save_state()  # trainer_state.json: the loss log the demo plots
    record: dict[str, Any] = {}
    if trainer.is_world_process_zero():
        from gnmr_hf.export_folder import model_name

        tokenizer.save_pretrained(args.output_dir)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        record = {
            "status": "complete",
            # the model by its name (gnmr_hf.export_folder.model_name), not this machine's folder: run.json
            # travels with the adapter
            "config": {"script": {**dataclasses.asdict(script), "model": model_name(script.model)},
                       "lora": dataclasses.asdict(recipe.lora),
                       "gnmr": recipe.gnmr.to_dict(), "training": json.loads(args.to_json_string())},
            "config_file": recipe.config_file,
            "model": model_name(model_path),
            "versions": package_versions(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "world_size": args.world_size,
            "sharded": "fsdp2" if sharded_run(args) else None,
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
        if calibrated is not None:
            record["calibrated_init"] = calibrated
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
