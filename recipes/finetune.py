"""LoRA fine-tuning of a causal LM in BF16, INT8, or INT8 with GNMR-controlled BF16 recovery.

Launch with accelerate (one process, CPU or GPU DDP; the config files are in recipes/accelerate/):

    accelerate launch [--config_file recipes/accelerate/cpu.yaml] recipes/finetune.py \\
        --config recipes/smollm2-135m/gnmr.yaml [--max_steps 3 --output_dir out/x ...]

The run, top to bottom: read the YAML config (every key below can be overridden with
``--key value``), load the base model for the chosen ``precision``

    bf16  the BF16 checkpoint + LoRA (the high-fidelity reference)
    int8  the checkpoint in bitsandbytes INT8 + LoRA (the fixed low-cost path)
    gnmr  INT8 + a BF16 recovery path per decoder layer (gnmr_hf.prepare_dual_path) + LoRA,
          with gnmr_hf.GNMRCallback switching up to ``gnmr_max_active`` layers to BF16

build the dataset (a prompt template over each record's fields; loss only on the answer tokens),
train with the Hugging Face Trainer, and write into ``output_dir``: the LoRA adapter (plain PEFT),
``trainer_state.json`` (the loss log), ``gnmr_trace.jsonl`` + ``gnmr_summary.json`` (gnmr runs), and
``run.json`` (config, package versions, wall time, peak memory, final loss, GNMR summary).

Errors in the config or the inputs end the run with a one-line message and exit code 2.
"""

from __future__ import annotations

import difflib
import json
import os
import resource
import string
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Every key the recipe knows, with its default. The YAML files set the ones that matter for a run;
# the type of each default (or of the YAML's value where the default is None) is the type that a
# command-line override is converted to.
DEFAULTS: dict[str, Any] = {
    # --- run ---
    "output_dir": "out/finetune",
    "seed": 42,
    "precision": "gnmr",  # bf16 | int8 | gnmr
    # --- model ---
    # a local folder, a hub id, or "smollm2-135m-instruct" (gnmr_hf.smollm2_checkpoint(), offline)
    "model": "smollm2-135m-instruct",
    # --- data ---
    # a hub id ("openai/gsm8k"), a local .json/.jsonl file or folder of them, or "generated-arithmetic"
    # (GSM8K-schema word problems from gnmr_hf.offline.gsm8k, written into data_dir)
    "dataset": "generated-arithmetic",
    "dataset_config": None,  # the hub dataset's config name ("main" for openai/gsm8k)
    "dataset_split": "train",
    "data_dir": None,  # where generated-arithmetic writes its files; None = {output_dir}/data
    "num_generated": 512,  # training problems for generated-arithmetic
    "data_seed": 0,
    "max_train_examples": None,  # keep only the first N records (None = all)
    # str.format templates over the record's fields; the loss covers the response only
    "prompt_template": "Question: {question}\nAnswer:",
    "response_template": " {answer}",
    "chat_template": False,  # wrap the prompt as a user turn with the tokenizer's chat template
    "max_seq_len": 512,
    # --- LoRA ---
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # --- optimisation (HF Trainer) ---
    "optim": "adamw_torch",
    "learning_rate": 2e-5,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.0,  # < 1: a fraction of the total steps
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 1.0,
    "max_steps": -1,  # > 0 overrides num_train_epochs
    "bf16_autocast": False,  # Trainer(bf16=True): autocast the LoRA/activations to BF16
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_strategy": "no",  # intermediate checkpoints ("steps" + save_steps); the adapter is always saved
    "save_steps": 500,
    "dataloader_num_workers": 0,
    # --- GNMR (precision: gnmr) --- paper symbols: maxO, T_lock, alpha_t, beta_t, delta
    "gnmr_max_active": 10,
    "gnmr_lock_steps": 1,
    "gnmr_alpha": 1.1,
    "gnmr_alpha_init": 1.5,  # alpha during the first gnmr_init_fraction of the steps
    "gnmr_beta": 1.5,
    "gnmr_beta_init": None,
    "gnmr_window": 5,
    "gnmr_init_fraction": 0.025,
    "gnmr_full_recovery_steps": 0,
    "gnmr_storage": "host",  # host | device | disk: where the BF16 recovery weights live
    "gnmr_monitor": False,  # bf16/int8: attach the callback monitor-only (a per-layer GNMR trace)
}
PRECISIONS = ("bf16", "int8", "gnmr")
GENERATED = "generated-arithmetic"
SMOLLM2 = "smollm2-135m-instruct"


class RecipeError(Exception):
    """A problem with the config or the inputs: reported as one line, exit code 2."""


# ----------------------------------------------------------------------------------------------
# config: YAML (PyYAML, never exec) + --key value overrides


def _coerce(key: str, value: Any, ref: Any) -> Any:
    """Convert ``value`` (a YAML value, or a command-line string) to the type of ``ref``."""
    if isinstance(value, str) and value.strip().lower() in ("null", "none", "~"):
        return None
    if ref is None or value is None:
        if isinstance(value, str):  # no type to go by: let YAML read it (numbers, lists, booleans)
            import yaml

            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
        return value
    kind = type(ref)
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise RecipeError(f"{key} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise RecipeError(f"{key} must be an integer, got {value!r}")
        try:
            return int(value) if not isinstance(value, str) else int(value.strip())
        except ValueError:
            raise RecipeError(f"{key} must be an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise RecipeError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)  # float("2e-5") works where YAML 1.1 reads "2e-5" as a string
        except ValueError:
            raise RecipeError(f"{key} must be a number, got {value!r}") from None
    if kind is list:
        if isinstance(value, list):
            return value
        text = str(value).strip()
        if text.startswith("["):
            import yaml

            return list(yaml.safe_load(text))
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind is str:
        if not isinstance(value, str):
            raise RecipeError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _unknown(keys: list[str], where: str) -> RecipeError:
    hints = []
    for k in keys:
        close = difflib.get_close_matches(k, DEFAULTS, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return RecipeError(f"unknown config key(s) {where}: {', '.join(hints)}")


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, str]]:
    """Split ``--config PATH --key value --key=value ...`` into the config path and raw overrides."""
    config_path, raw = None, {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise RecipeError(f"expected --key value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 >= len(args):
                raise RecipeError(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_path = value
        else:
            raw[key] = value
    return config_path, raw


def load_config(argv: list[str]) -> dict[str, Any]:
    """The run's config: DEFAULTS, then the YAML file given by ``--config``, then ``--key value`` overrides.

    Args:
        argv: the script's arguments (without the program name).

    Raises:
        RecipeError: unknown keys (named), values of the wrong type, an unknown precision.
    """
    import yaml

    config_path, raw = parse_overrides(argv)
    cfg = dict(DEFAULTS)
    types = dict(DEFAULTS)
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise RecipeError(f"config file {config_path} not found")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{config_path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise RecipeError(f"{config_path} must hold a mapping of key: value")
        unknown = sorted(set(loaded) - set(DEFAULTS))
        if unknown:
            raise _unknown(unknown, f"in {config_path}")
        for key, value in loaded.items():
            cfg[key] = _coerce(key, value, DEFAULTS[key])
            if types[key] is None and cfg[key] is not None:
                types[key] = cfg[key]  # a YAML value gives the type where the default is None
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise _unknown(unknown, "on the command line")
    for key, value in raw.items():
        cfg[key] = _coerce(key, value, types[key])
    if cfg["precision"] not in PRECISIONS:
        raise RecipeError(f"unknown precision {cfg['precision']!r}: this recipe knows {', '.join(PRECISIONS)}")
    cfg["_config_file"] = config_path
    return cfg


# ----------------------------------------------------------------------------------------------
# building blocks (importable: the tests and bench/gpu_13b_shape.py use them)


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: the SmolLM2 cache, a folder as given, or a hub id (offline cache)."""
    if name == SMOLLM2:
        from gnmr_hf.offline.smollm2 import smollm2_checkpoint

        try:
            return str(smollm2_checkpoint())
        except (FileNotFoundError, ImportError) as e:
            raise RecipeError(str(e)) from None
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise RecipeError(f"model folder {name} has no config.json")
        return name
    if name.startswith((".", "/", "~")) or not _hub_like(name):
        raise RecipeError(f"model {name!r} not found (no such folder, and not a hub id)")
    from huggingface_hub import snapshot_download

    try:
        # a folder, so that the recovery path (gnmr) can read the original BF16 safetensors
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline without a cached copy, gated repo, typo in the id ...
        raise RecipeError(f"model {name!r} not found: not a folder, and the hub gave {type(e).__name__}: {e}") from None


def _hub_like(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts)


def training_arguments(cfg: dict[str, Any]):
    """The ``transformers.TrainingArguments`` for ``cfg`` (no model is loaded)."""
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=cfg["output_dir"],
        seed=cfg["seed"],
        optim=cfg["optim"],
        learning_rate=cfg["learning_rate"],
        weight_decay=cfg["weight_decay"],
        max_grad_norm=cfg["max_grad_norm"],
        lr_scheduler_type=cfg["lr_scheduler_type"],
        warmup_steps=cfg["warmup_steps"],
        per_device_train_batch_size=cfg["per_device_train_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        num_train_epochs=cfg["num_train_epochs"],
        max_steps=cfg["max_steps"],
        bf16=cfg["bf16_autocast"],
        activation_checkpointing=cfg["gradient_checkpointing"],
        logging_steps=cfg["logging_steps"],
        save_strategy=cfg["save_strategy"],
        save_steps=cfg["save_steps"],
        dataloader_num_workers=cfg["dataloader_num_workers"],
        # without CUDA, use_cpu makes accelerate's multi-process launch a gloo DDP run
        use_cpu=not torch.cuda.is_available(),
        # LoRA leaves some parameters of a DDP replica without gradients only if a layer is unused
        ddp_find_unused_parameters=False,
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=False,
    )


def gnmr_config(cfg: dict[str, Any]):
    """The ``gnmr_hf.GNMRConfig`` for ``cfg`` (init_steps comes from gnmr_init_fraction in the callback)."""
    import gnmr_hf

    try:
        return gnmr_hf.GNMRConfig(
            max_active=cfg["gnmr_max_active"],
            lock_steps=cfg["gnmr_lock_steps"],
            alpha=cfg["gnmr_alpha"],
            alpha_init=cfg["gnmr_alpha_init"],
            beta=cfg["gnmr_beta"],
            beta_init=cfg["gnmr_beta_init"],
            window=cfg["gnmr_window"],
            full_recovery_steps=cfg["gnmr_full_recovery_steps"],
        )
    except ValueError as e:
        raise RecipeError(f"GNMR config: {e}") from None


def load_model(cfg: dict[str, Any], model_path: str):
    """The base model for ``cfg['precision']`` with LoRA applied (a ``peft.PeftModel``)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    # under DDP on GPUs each process holds a whole replica on its own device
    device_map = None
    if torch.cuda.is_available():
        device_map = {"": int(os.environ.get("LOCAL_RANK", 0))}
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": device_map}
    if cfg["precision"] in ("int8", "gnmr"):
        from gnmr_hf._import_utils import require

        require("bitsandbytes", f"precision: {cfg['precision']}")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except OSError as e:
        raise RecipeError(f"could not load the model from {model_path}: {e}") from None
    if cfg["precision"] == "gnmr":
        import gnmr_hf

        # before LoRA: the dual-path layers replace the 8-bit linears that LoRA then wraps
        model = gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=cfg["gnmr_storage"])
    if cfg["gradient_checkpointing"]:
        model.enable_input_require_grads()  # the frozen embeddings would cut the checkpointed graph
    lora = peft.LoraConfig(
        r=cfg["lora_r"],
        lora_alpha=cfg["lora_alpha"],
        lora_dropout=cfg["lora_dropout"],
        target_modules=cfg["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as e:  # e.g. target modules the model does not have
        raise RecipeError(f"LoRA: {e}") from None


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


def load_records(cfg: dict[str, Any]):
    """The raw training records as a ``datasets.Dataset``."""
    import datasets

    name = cfg["dataset"]
    if name == GENERATED:
        from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl

        data_dir = cfg["data_dir"] or os.path.join(cfg["output_dir"], "data")
        folder = write_gsm8k_jsonl(data_dir, n_train=cfg["num_generated"], seed=cfg["data_seed"])
        files = [str(folder / "train.jsonl")]
        ds = datasets.load_dataset("json", data_files=files, split="train")
    elif os.path.exists(name):
        if os.path.isdir(name):
            files = sorted(str(p) for p in Path(name).iterdir() if p.suffix in (".json", ".jsonl"))
            if not files:
                raise RecipeError(f"dataset folder {name} holds no .json/.jsonl files")
        else:
            files = [name]
        try:
            ds = datasets.load_dataset("json", data_files=files, split="train")
        except Exception as e:
            raise RecipeError(f"could not read {name} as JSON lines: {e}") from None
    else:
        try:
            ds = datasets.load_dataset(name, cfg["dataset_config"], split=cfg["dataset_split"])
        except Exception as e:
            raise RecipeError(f"dataset {name!r} not found (not a local file, and datasets gave "
                              f"{type(e).__name__}: {e})") from None
    if cfg["max_train_examples"] is not None:
        ds = ds.select(range(min(cfg["max_train_examples"], len(ds))))
    return ds


def tokenize_dataset(cfg: dict[str, Any], records, tokenizer):
    """Token ids and labels: the prompt's labels are -100, so the loss covers only the response."""
    fields = template_fields(cfg["prompt_template"], cfg["response_template"])
    missing = [f for f in fields if f not in records.column_names]
    if missing:
        raise RecipeError(
            f"the dataset has no field(s) {', '.join(map(repr, missing))} used by the prompt/response "
            f"template; its fields are {', '.join(records.column_names)}"
        )
    max_len = cfg["max_seq_len"]

    def encode(row: dict[str, Any]) -> dict[str, list[int]]:
        prompt = cfg["prompt_template"].format(**row)
        response = cfg["response_template"].format(**row)
        if cfg["chat_template"]:
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


def run(cfg: dict[str, Any], extra_callbacks: list | None = None) -> dict[str, Any]:
    """Train one LoRA adapter as ``cfg`` says; returns the run.json record (written on rank 0).

    Args:
        cfg: the config from :func:`load_config`.
        extra_callbacks: more ``TrainerCallback`` objects (bench/gpu_13b_shape.py times steps with one).
    """
    import torch
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, set_seed

    start = time.time()
    # bitsandbytes warns on every INT8 matmul that it casts BF16 inputs to FP16; once is enough
    warnings.filterwarnings("once", message="MatMul8bitLt: inputs will be cast")
    args = training_arguments(cfg)
    if args.process_index == 0:
        Path(cfg["output_dir"], "run.json").unlink(missing_ok=True)  # a stale one would mark this run done
    set_seed(cfg["seed"])
    model_path = resolve_model_path(cfg["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # one process writes the generated data and the tokenised cache, the others then read them
    with args.main_process_first(desc="dataset"):
        train_ds = tokenize_dataset(cfg, load_records(cfg), tokenizer)

    model = load_model(cfg, model_path)
    if args.process_index == 0:
        model.print_trainable_parameters()

    callbacks = list(extra_callbacks or [])
    if cfg["precision"] == "gnmr" or cfg["gnmr_monitor"]:
        import gnmr_hf

        callbacks.append(gnmr_hf.GNMRCallback(gnmr_config(cfg), init_fraction=cfg["gnmr_init_fraction"]))

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=callbacks,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    train_seconds = time.time() - start

    trainer.save_model(cfg["output_dir"])  # a PeftModel saves just the adapter
    trainer.save_state()  # trainer_state.json: the loss log the demo plots
    record: dict[str, Any] = {}
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(cfg["output_dir"])
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        record = {
            "status": "complete",
            "config": {k: v for k, v in cfg.items() if not k.startswith("_")},
            "config_file": cfg["_config_file"],
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
        summary = Path(cfg["output_dir"]) / "gnmr_summary.json"
        if summary.is_file():
            record["gnmr_summary"] = json.loads(summary.read_text())
        tmp = Path(cfg["output_dir"]) / ".run.json.tmp"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, Path(cfg["output_dir"]) / "run.json")  # run.json last: it marks a complete run
        print(f"run.json: final loss {record['final_loss']}, wall time {record['wall_time_s']} s, "
              f"peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB ({record['peak_memory_kind']})")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("config keys and defaults:")
        for key, value in DEFAULTS.items():
            print(f"  --{key} {value!r}")
        return 0
    try:
        cfg = load_config(argv)
        run(cfg)
    except RecipeError as e:
        print(f"finetune.py: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # gnmr_hf's require() names the extra to install
        print(f"finetune.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
