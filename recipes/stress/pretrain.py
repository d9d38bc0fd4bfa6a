"""Activation-quantisation stress bench: pre-train a LLaMA-style model from a config (paper section 5.1).

Weights and optimizer state stay in BF16; the saved input activations of the attention and SwiGLU
projections (7 operator units per layer) are quantised token-wise for the backward pass:

    method   saved activations                               trigger
    bf16     unquantised                                      -
    fixed8   8-bit everywhere                                 -
    fixed4   4-bit everywhere                                 -
    gnmr     4-bit, up to max_active units at 8-bit           GNMR + Delta-GNMR (the controller)
    adapt    BF16 warm-up, then a fixed top-25 % at 8-bit     ADAPT-style static profile
    gsnr     4-bit, max_active lowest-GSNR units at 8-bit     gradient signal-to-noise ranking
    random   4-bit, max_active random units at 8-bit          seeded random ranking
    random_budget  4-bit, random units at 8-bit, on average   seeded random draw at a given budget
             baselines.random_mean_active per step            (GNMR's measured mean active units)

Every dynamic method runs through ``GNMRCallback(policy=...)``, the same callback and actuator
(``set_active_units``) the INT8/BF16 LoRA path uses.

With ``--low mxfp4`` (or ``mxfp6``, ``mxfp8``, or a full name such as ``mxfp8_e5m2``) the low path is
instead an OCP MX format for every linear of every decoder layer (weights, activations and gradients,
``gnmr_hf.backends.mx.prepare_mx``; 8 units = the decoder layers, not operators) and the recovery
path is BF16 (float32 GEMMs on BF16-rounded operands, fast on CPUs without BF16 matrix units):

    method   decoder layers                                      trigger
    bf16     all on the BF16 path                                -
    fixed    all on the MX path                                  -
    gnmr / random / gsnr   MX, up to max_active layers in BF16   as above
    adapt    BF16 warm-up, then a fixed top-25 % in BF16         ADAPT-style static profile

``fixed4`` / ``fixed8`` belong to the activation path and ``fixed`` to the MX path. The validation
loss is the mean cross-entropy per token (``final_eval_loss``), evaluated on the path in effect.

Usage:
    python recipes/stress/pretrain.py --config recipes/stress/configs/cpu_bench.yaml --method gnmr \
        --output_dir runs/stress/gnmr [--low mxfp4] [train.max_steps=600 gnmr.max_active=4 ...]

Writes ``<output_dir>/metrics.jsonl`` (per-step time, loss, saved-activation bytes, active units, eval
loss) and ``<output_dir>/result.json`` (final validation perplexity, the policy summary, step time and
memory), which ``recipes/stress/report.py`` turns into the paper's tables.

FSDP2 (docs/fsdp2.md): on GPUs launch with ``accelerate launch --config_file recipes/accelerate/fsdp2.yaml
recipes/stress/pretrain.py ...`` (or ``torchrun --nproc_per_node N ... --fsdp2``); ``--fsdp2`` sets the
Trainer's ``fsdp`` arguments itself (version 2, one ``fully_shard`` per decoder layer, sharded
checkpoints). accelerate applies FSDP on GPUs only, so on a CPU ``--fsdp2`` also applies
:func:`accelerate_fsdp_on_cpu` (two gloo processes under ``torchrun --nproc_per_node 2``), which the
tests use. Only the main process writes metrics, trace and result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = ("bf16", "fixed8", "fixed4", "fixed", "gnmr", "adapt", "gsnr", "random")
# methods that need a setting from another run: random_budget draws baselines.random_mean_active units per step
# on average (GNMR's measured mean, bench/gpu/gpu_paper.sh); not in METHODS, which the bench runs one after the other
BUDGET_METHODS = ("random_budget",)
# short names for the MX element formats of --low
MX_ALIASES = {"mxfp4": "mxfp4_e2m1", "mxfp6": "mxfp6_e2m3", "mxfp8": "mxfp8_e4m3"}
DYNAMIC = ("gnmr", "adapt", "gsnr", "random", "random_budget")
HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"


# ---------------------------------------------------------------- config
def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> dict:
    """Read the YAML config and apply ``section.key=value`` overrides (values parsed as YAML)."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):
            try:  # YAML 1.1 reads "5e-3" (no dot) as a string
                parsed = float(parsed)
            except ValueError:
                pass
        node[leaf] = parsed
    return cfg


# ---------------------------------------------------------------- data
def corpus_files(corpus_dir: str | os.PathLike) -> list[Path]:
    """All text files under ``corpus_dir`` (``*.txt``, ``*.rst``), sorted by relative path."""
    root = Path(corpus_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus folder {root} does not exist (for the Python documentation corpus: "
            "apt-get install -y python3.11-doc)"
        )
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".rst"))
    if not files:
        raise FileNotFoundError(f"no .txt/.rst files under {root}")
    return files


def split_files(files: list[Path], val_every: int) -> tuple[list[Path], list[Path]]:
    """Every ``val_every``-th file (by sorted path) is held out for validation: whole documents, no overlap."""
    val = files[val_every - 1 :: val_every]
    held = set(val)
    return [f for f in files if f not in held], val


def _fingerprint(files: list[Path], *extra) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f).encode())
        h.update(str(f.stat().st_size).encode())
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def build_tokenizer(train_files: list[Path], vocab_size: int, cache_dir: Path):
    """A byte-level BPE tokenizer trained on the training split (cached), as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache_dir / f"bpe-{vocab_size}-{_fingerprint(train_files)}.json"
    if not path.is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([str(f) for f in train_files], trainer)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS)


def tokenize_files(tokenizer, files: list[Path], cache_dir: Path, tag: str) -> torch.Tensor:
    """Concatenate the files' token ids, an EOS after each document (cached as int32)."""
    path = cache_dir / f"ids-{tag}-{_fingerprint(files, tokenizer.vocab_size)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)  # a cached int32 tensor: nothing in it may run code
    from gnmr_hf.offline.text_data import read_text_file

    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(read_text_file(f))["input_ids"])  # strict UTF-8: a bad file is named, not replaced
        ids.append(tokenizer.eos_token_id)
    out = torch.tensor(ids, dtype=torch.int32)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(out, tmp)
    os.replace(tmp, path)
    return out


class BlockDataset(torch.utils.data.Dataset):
    """Non-overlapping ``seq_len`` blocks of a token stream; labels are the inputs (the model shifts)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, max_blocks: int | None = None) -> None:
        n = ids.numel() // seq_len
        if max_blocks is not None:
            n = min(n, max_blocks)
        if n == 0:
            raise ValueError(f"a token stream of {ids.numel()} tokens has no block of {seq_len}")
        self.blocks = ids[: n * seq_len].view(n, seq_len).long()

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict:
        x = self.blocks[i]
        return {"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}


def build_data(cfg: dict, cache_dir: Path):
    d = cfg["data"]
    corpus = d["corpus_dir"]
    if not os.path.isabs(corpus) and not os.path.isdir(corpus):
        corpus = HERE / corpus  # configs may name the shipped sample relative to this folder
    files = corpus_files(corpus)
    train_files, val_files = split_files(files, d["val_every"])
    tokenizer = build_tokenizer(train_files, d["vocab_size"], cache_dir)
    train_ids = tokenize_files(tokenizer, train_files, cache_dir, "train")
    val_ids = tokenize_files(tokenizer, val_files, cache_dir, "val")
    train = BlockDataset(train_ids, d["seq_len"])
    val = BlockDataset(val_ids, d["seq_len"], d.get("eval_blocks"))
    info = {"corpus_dir": str(corpus), "files": len(files), "train_files": len(train_files),
            "val_files": len(val_files), "train_tokens": int(train_ids.numel()), "val_tokens": int(val_ids.numel()),
            "train_blocks": len(train), "val_blocks": len(val), "vocab_size": len(tokenizer)}
    return tokenizer, train, val, info


# ---------------------------------------------------------------- model
def build_model(cfg: dict, vocab_size: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg["model"]
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m.get("num_key_value_heads", m["num_attention_heads"]),
        max_position_embeddings=cfg["data"]["seq_len"],
        tie_word_embeddings=m.get("tie_word_embeddings", False),
    )
    torch.manual_seed(cfg["train"]["seed"])  # same initial weights for every method
    return LlamaForCausalLM(config).to(dtype)


def resolve_low(low: str) -> str:
    """``"act"`` (saved-activation quantisation) or the full name of an MX element format."""
    from gnmr_hf.backends.mx import MX_FORMATS

    if low == "act":
        return low
    name = MX_ALIASES.get(low, low)
    if name not in MX_FORMATS:
        raise ValueError(f"--low must be 'act', one of {sorted(MX_ALIASES)} or one of {sorted(MX_FORMATS)}, got {low!r}")
    return name


def apply_method(model, method: str, cfg: dict, low: str = "act"):
    """Convert the projections for ``method`` on the ``low`` path; returns the units."""
    if low != "act":
        if method in ("fixed4", "fixed8"):
            raise ValueError(f"method {method!r} is for the activation path; with --low {low} use 'fixed'")
        from gnmr_hf.backends.mx import prepare_mx
        from gnmr_hf.units import resolve_units

        mx = cfg.get("mx", {})
        prepare_mx(model, fmt=low, block_size=mx.get("block_size", 32), quantize_norms=mx.get("quantize_norms", False),
                   emulate_bf16=mx.get("emulate_bf16", True))
        return resolve_units(model)  # the decoder layers
    if method == "fixed":
        raise ValueError("method 'fixed' needs an MX low path (--low mxfp4, ...); use fixed4 or fixed8 here")
    from gnmr_hf.backends.act_quant import prepare_act_quant

    q = cfg["quant"]
    low_bits = {"bf16": None, "fixed8": q["high_bits"], "fixed4": q["low_bits"]}.get(method, q["low_bits"])
    return prepare_act_quant(model, low_bits=low_bits, high_bits=q["high_bits"], units="operators")


def build_policy(method: str, cfg: dict, num_units: int, max_steps: int, max_active: int | None = None,
                 units: list[int] | None = None):
    from gnmr_hf.core.controller import GNMRConfig, init_steps_from_fraction
    from gnmr_hf.core.policies import make_policy

    g = dict(cfg["gnmr"])
    if max_active is not None:
        g["max_active"] = max_active
    g["init_steps"] = init_steps_from_fraction(g.pop("init_fraction", 0.0), max_steps)
    gcfg = GNMRConfig(**g)
    b = cfg.get("baselines", {})
    return make_policy(method, num_units, gcfg, warmup_steps=b.get("adapt_warmup_steps"),
                       fraction=b.get("adapt_fraction", 0.25), seed=b.get("random_seed", 0), units=units,
                       mean_active=b.get("random_mean_active")), gcfg


# ---------------------------------------------------------------- bookkeeping callbacks
def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _Callbacks:
    """Built lazily so that importing this file (tests, report) does not import transformers."""

    @staticmethod
    def full_precision_warmup(model, steps: int):
        from gnmr_hf.backends.act_quant import set_full_precision

        class FullPrecisionWarmup(_trainer_callback_base()):
            """ADAPT-style baseline: steps 1..W save unquantised (BF16) activations, then the paths apply."""

            def on_step_begin(self, args, state, control, **kwargs):
                # global_step is t-1 at the beginning of step t
                set_full_precision(model, state.global_step < steps)

        return FullPrecisionWarmup()

    @staticmethod
    def recovery_warmup(model, units, steps: int):
        from gnmr_hf.backends.base import set_active_units

        class RecoveryWarmup(_trainer_callback_base()):
            """ADAPT-style baseline on the MX path: steps 1..W run every unit on the recovery (BF16) path.

            The policy returns an empty set during its profile, so the GNMR callback leaves the modules
            alone until the profile ends and its fixed set replaces this one."""

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step < steps:  # global_step is t-1 at the beginning of step t
                    set_active_units(model, range(len(units)), units)

        return RecoveryWarmup()

    @staticmethod
    def metrics(model, units, out_path: Path, policy=None):
        from gnmr_hf.backends.act_quant import saved_activation_bytes
        from gnmr_hf.backends.base import active_units

        class StressMetrics(_trainer_callback_base()):
            """Per-step wall time, loss, saved-activation bytes, active units and eval loss to JSONL."""

            def __init__(self):
                self.f = open(out_path, "a") if out_path is not None else None  # None: not the main process
                self.t0 = None
                self.step_times: list[float] = []
                self.peak_saved = 0
                self.evals: list[tuple[int, float]] = []
                self.last_loss = None

            def on_step_begin(self, args, state, control, **kwargs):
                self.t0 = time.perf_counter()
                self.saved_this_step = 0
                self.active = active_units(model, units)

            def on_substep_end(self, args, state, control, **kwargs):
                self.peak_saved = max(self.peak_saved, saved_activation_bytes(model))

            def on_step_end(self, args, state, control, **kwargs):
                dt = time.perf_counter() - self.t0
                self.step_times.append(dt)
                # the last micro-batch's forward is still recorded in the modules at this point
                self.peak_saved = max(self.peak_saved, saved_activation_bytes(model))
                rec = {"step": state.global_step, "step_time": dt, "active": self.active,
                       "saved_act_bytes": saved_activation_bytes(model)}
                if policy is not None and getattr(policy, "last_record", None):
                    r = policy.last_record
                    rec.update(over_gnmr=r["over_gnmr"], over_delta=r["over_delta"], hit_max=bool(r["hit_max"]))
                self._write(rec)

            def on_log(self, args, state, control, logs=None, **kwargs):
                logs = logs or {}
                if "loss" in logs:
                    self.last_loss = logs["loss"]
                    self._write({"step": state.global_step, "train_loss": logs["loss"], "lr": logs.get("learning_rate")})
                if "eval_loss" in logs:
                    self.evals.append((state.global_step, logs["eval_loss"]))
                    self._write({"step": state.global_step, "eval_loss": logs["eval_loss"]})

            def _write(self, rec: dict) -> None:
                if self.f is not None:
                    self.f.write(json.dumps(rec) + "\n")
                    self.f.flush()

        return StressMetrics()


# ---------------------------------------------------------------- FSDP2
FSDP2_CONFIG = {
    "version": 2,
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "state_dict_type": "SHARDED_STATE_DICT",
    "reshard_after_forward": True,
}


def accelerate_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin take effect in CPU processes (gloo), for tests and CPU dry runs.

    accelerate 1.15 turns the FSDP plugin on only for GPU-type distributed runs: CPU processes keep
    ``DistributedType.MULTI_CPU`` and the plugin is dropped without a word (plain data parallelism, the
    whole model on every rank). After this patch an ``AcceleratorState`` given an FSDP plugin in CPU
    processes becomes ``DistributedType.FSDP`` with that plugin, so the Trainer takes its FSDP2 path
    unchanged: ``fsdp2_prepare_model`` (``fully_shard`` per decoder layer on a CPU mesh), accelerate's
    FSDP clip branch and the sharded checkpoints. Idempotent; GPU runs never need it.
    """
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    if getattr(init, "gnmr_fsdp_on_cpu", False):
        return

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate does

    __init__.gnmr_fsdp_on_cpu = True
    state.AcceleratorState.__init__ = __init__


def is_main_process() -> bool:
    """Rank 0 of a ``torchrun`` / ``accelerate launch`` job (or a single process)."""
    return int(os.environ.get("RANK", "0")) == 0


# ---------------------------------------------------------------- main
def run(cfg: dict, method: str, output_dir: str | os.PathLike, resume: bool = False, low: str = "act",
        fsdp2: bool = False, extra_callbacks: list | tuple = ()) -> dict:
    """Pre-train one method; returns (and writes) the result record.

    Args:
        cfg (`dict`): the loaded config (:func:`load_config`).
        method (`str`): one of ``METHODS``.
        output_dir: where metrics, checkpoints and ``result.json`` go.
        resume (`bool`): continue from the latest checkpoint in ``output_dir``.
        low (`str`): ``"act"`` (saved-activation quantisation) or an MX format (``"mxfp4"``, ...).
        fsdp2 (`bool`): shard with FSDP2 (:data:`FSDP2_CONFIG`; on a CPU through :func:`accelerate_fsdp_on_cpu`);
            the projections are converted before the Trainer shards the model.
        extra_callbacks: more ``TrainerCallback`` s for the Trainer (tests).
    """
    from transformers import Trainer, TrainingArguments, default_data_collator

    if method not in METHODS + BUDGET_METHODS:
        raise ValueError(f"method must be one of {METHODS + BUDGET_METHODS}, got {method!r}")
    if method == "random_budget" and cfg.get("baselines", {}).get("random_mean_active") is None:
        raise ValueError("method 'random_budget' needs baselines.random_mean_active (e.g. a GNMR run's "
                         "policy_summary mean_active)")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tr = cfg["train"]
    torch.set_num_threads(int(tr.get("threads", torch.get_num_threads())))
    cache_dir = Path(cfg["data"].get("cache_dir") or out.parent / ".cache")
    tokenizer, train_ds, val_ds, data_info = build_data(cfg, cache_dir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[tr.get("dtype", "bfloat16")]
    model = build_model(cfg, len(tokenizer), dtype)
    low = resolve_low(low)
    units = apply_method(model, method, cfg, low)
    max_steps = tr["max_steps"]

    from gnmr_hf.trainer.callback import GNMRCallback

    # every trigger, the controller included, goes through the same policy slot and actuator. The fixed
    # methods get the controller with max_active = 0: a pure monitor (their Table 3 figures), never
    # promoting anything, and the same per-step callback cost as the dynamic methods.
    # On the MX path the BF16 method keeps every layer on the recovery path through a static set (the
    # callback would otherwise put the monitor's empty set in place).
    if low != "act" and method == "bf16":
        policy, _ = build_policy("static_set", cfg, len(units), max_steps, max_active=len(units),
                                 units=list(range(len(units))))
    else:
        policy, _ = build_policy(method if method in DYNAMIC else "gnmr", cfg, len(units), max_steps,
                                 max_active=None if method in DYNAMIC else 0)
    callbacks: list = [GNMRCallback(units=[name for name, _ in units], policy=policy, trace=str(out / "gnmr_trace.jsonl"))]
    if method == "adapt":
        warmup = cfg["baselines"]["adapt_warmup_steps"]
        callbacks.append(_Callbacks.full_precision_warmup(model, warmup) if low == "act"
                         else _Callbacks.recovery_warmup(model, units, warmup))
    main = is_main_process()
    metrics_path = out / "metrics.jsonl"
    if not resume and metrics_path.exists() and main:
        metrics_path.unlink()
    metrics = _Callbacks.metrics(model, units, metrics_path if main else None, policy)
    callbacks.append(metrics)
    callbacks.extend(extra_callbacks)
    fsdp_args = {}
    if fsdp2:
        if not torch.cuda.is_available():
            accelerate_fsdp_on_cpu()
        fsdp_args = {"fsdp": True, "fsdp_config": dict(FSDP2_CONFIG)}

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=tr["batch_size"],
        per_device_eval_batch_size=tr.get("eval_batch_size", tr["batch_size"]),
        gradient_accumulation_steps=tr["gradient_accumulation_steps"],
        learning_rate=tr["learning_rate"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": tr.get("min_lr_rate", 0.1)},
        warmup_steps=max(1, round(tr.get("warmup_ratio", 0.1) * max_steps)),
        weight_decay=tr.get("weight_decay", 0.0),
        adam_beta2=tr.get("adam_beta2", 0.95),
        max_grad_norm=tr.get("max_grad_norm", 1.0),
        eval_strategy="steps",
        eval_steps=tr["eval_steps"],
        logging_steps=tr.get("logging_steps", 10),
        save_strategy="steps" if tr.get("save_steps") else "no",
        save_steps=tr.get("save_steps") or 500,
        save_total_limit=tr.get("save_total_limit", 1),
        seed=tr["seed"],
        data_seed=tr["seed"],
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        restore_callback_states_from_checkpoint=True,
        **fsdp_args,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=val_ds,
                      data_collator=default_data_collator, callbacks=callbacks)
    has_ckpt = resume and any(out.glob("checkpoint-*"))
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if has_ckpt else None)
    wall = time.perf_counter() - t0
    final = trainer.evaluate()
    if tr.get("save_final", True):
        trainer.save_model(str(out / "final"))  # for diagnostics (bench/stress/stress_grad_error.py)
    final_loss = float(final["eval_loss"])
    times = metrics.step_times[1:] or metrics.step_times  # the first step includes warm-up costs
    result = {
        "method": method,
        "low": low,
        "final_eval_loss": final_loss,
        "final_ppl": math.exp(final_loss) if final_loss < 50 else float("inf"),
        "eval_curve": metrics.evals + [(max_steps, final_loss)],
        "step_time_s": sum(times) / len(times) if times else None,
        "peak_saved_act_MB": metrics.peak_saved / 2**20,
        "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_MB": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "wall_s": wall,
        "tokens": max_steps * tr["batch_size"] * tr["gradient_accumulation_steps"] * args.world_size
        * cfg["data"]["seq_len"],
        "world_size": args.world_size,
        "fsdp2": bool(trainer.is_fsdp_enabled),
        "num_units": len(units),
        "max_active": cfg["gnmr"]["max_active"],
        "policy_summary": policy.summary(),
        "monitor_only": method not in DYNAMIC,
        "data": data_info,
        "config": cfg,
    }
    if main:
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--method", required=True, choices=METHODS + BUDGET_METHODS)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--low", default="act",
                   help="the low path: 'act' (saved-activation quantisation) or an MX format (mxfp4, mxfp6, mxfp8, ...)")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard with FSDP2 (under torchrun / accelerate launch; on a CPU through gloo, see docs/fsdp2.md)")
    p.add_argument("overrides", nargs="*", help="section.key=value (YAML values)")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    res = run(cfg, a.method, a.output_dir, resume=a.resume, low=a.low, fsdp2=a.fsdp2)
    if not is_main_process():
        return None
    print(json.dumps({k: res[k] for k in ("method", "low", "final_eval_loss", "final_ppl", "step_time_s", "peak_saved_act_MB", "wall_s")}))
    print(json.dumps(res["policy_summary"]))


if __name__ == "__main__":
    sys.exit(main())
