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
# building blocks: the model, its plan and its LoRA init live in the package (gnmr_hf.recipe_model,
# gnmr_hf.recipe_plan); re-exported, the tests and the benches use finetune.NAME
from gnmr_hf.recipe_model import (  # noqa: E402, F401
    calibrated_init,
    load_model,
    loftq_init,
    name_model,
    quantization_config,
    refuse_prequantised,
    resolve_model_path,
    sharded_run,
)
from gnmr_hf.recipe_plan import (  # noqa: E402, F401
    bf16_policy,
    check_saved_plan,
    ladder_policy,
    planned_policy,
    same_plan_on_every_rank,
    saved_plan_policy,
    stored_bytes_per_bf16_byte,
)

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
    # after the plan: its linears keep the default init (gnmr_hf.recipe_model)
    loftq = loftq_init(recipe, model, model_path, planned) if recipe.lora.lora_init == "loftq" else None
    calibrated = (calibrated_init(recipe, model, model_path, planned, train_ds, tokenizer)
                  if recipe.lora.lora_init == "calibrated" else None)

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
    return write_run_record(recipe, trainer, tokenizer, model_path, train_ds, result, train_seconds, text_summary,
                            planned, loftq, calibrated)


def write_run_record(recipe: Recipe, trainer, tokenizer, model_path: str, train_ds, result, train_seconds: float,
                     text_summary, planned, loftq, calibrated) -> dict[str, Any]:
    """run.json: the configuration, versions, wall time, peak memory, losses, the plan and the GNMR summary,
    written last on the main process (it marks a complete run); returns it ({} on the other ranks)."""
    import torch

    script, args = recipe.script, recipe.training
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
