"""FSDP2 worker for ``tests/test_fsdp2.py``: two CPU processes (gloo) under ``torchrun --nproc_per_node 2``.

accelerate runs FSDP on GPUs only; :func:`recipes/stress/pretrain.accelerate_fsdp_on_cpu` lets its FSDP plugin
take effect in CPU processes, so every run here goes through the Trainer's own FSDP2 path (accelerate's
``fsdp2_prepare_model``: ``fully_shard`` per decoder layer and on the root, on a CPU mesh).

Modes (``--mode``):

- ``trainer``: a tiny float32 LLaMA whose projections carry a dual path (act-quant modules with both paths
  unquantised, so the gradients do not depend on rounding), one unit per decoder layer. Three FSDP2 runs on
  the same data: ``gnmr`` (a switching GNMRConfig), ``monitor`` (max_active 0) and ``plain`` (no callback);
  then a bitsandbytes INT8 dual-path model handed to an FSDP2 Trainer, whose error is recorded. Writes
  ``{out}/rank{r}.json`` (per-step norms and decisions seen on the rank, the logged grad norms, the error)
  and, on rank 0, ``{out}/{monitor,plain}_weights.pt`` (the full trained weights).
  :func:`single_process` is the one-process reference on the same global batches.
- ``stress``: the stress recipe (``recipes/stress/pretrain.py``) with ``fsdp2=True`` for each ``--job
  [NAME=]METHOD:LOW[:MAX_STEPS]`` (in ``{out}/NAME``; MAX_STEPS also saves every 2 steps); ``--kill-at K`` SIGKILLs the last run's processes after its step K, ``--resume``
  continues the last run from its newest checkpoint. Writes ``{out}/{run}/rank{r}.json`` (per-step
  decisions and controller state hashes seen on the rank, the GNMR state it started from).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gnmr_hf.backends.act_quant import prepare_act_quant  # noqa: E402
from gnmr_hf.trainer import wiring  # noqa: E402
from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402

SWITCHY = {"max_active": 2, "lock_steps": 1, "alpha": 1.05, "alpha_init": None, "beta": 1.05, "window": 3}
MONITOR = dict(SWITCHY, max_active=0)
PER_DEVICE = 2
STEPS = 8


def load_pretrain():
    spec = importlib.util.spec_from_file_location("stress_pretrain", REPO / "recipes" / "stress" / "pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_model(seed: int = 0) -> tuple[torch.nn.Module, list]:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # a dual path in every projection, both paths exact: decisions switch, gradients stay rounding-free
    units = prepare_act_quant(model, low_bits=None, high_bits=None, units="layers")
    return model, units


def dataset(n: int = 64, seq: int = 12):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def targs(out: str, fsdp2: bool, batch: int = PER_DEVICE, steps: int = STEPS) -> TrainingArguments:
    kw = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}} if fsdp2 else {}
    return TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
        lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, max_grad_norm=0.5, train_sampling_strategy="sequential", **kw,
    )


def gnmr_of(trainer) -> GNMRCallback | None:
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GNMRCallback)), None)


class Recorder(TrainerCallback):
    """Per step on this rank: the GNMR decision, its per-unit norms and a hash of the controller state; at train
    begin the state the GNMR callback starts from (after a resume: the restored one)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.grad_norms: list[float] = []
        self.begin: dict | None = None
        self.gnmr: GNMRCallback | None = None
        self.sharded = False

    def on_train_begin(self, args, state, control, model=None, **kw):
        trainer = wiring.find_trainer(self)
        self.gnmr = gnmr_of(trainer) if trainer is not None else None
        if self.gnmr is not None:
            self.begin = {"step": state.global_step, "active": self.gnmr.active, "controller": state_hash(self.gnmr)}
        self.sharded = all(type(p).__name__ == "DTensor" for p in model.parameters() if p.requires_grad)

    def on_step_end(self, args, state, control, **kw):
        if self.gnmr is not None:
            self.steps.append({"step": state.global_step, "active": self.gnmr.active,
                               "controller": state_hash(self.gnmr)})

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "grad_norm" in logs:
            self.grad_norms.append(float(logs["grad_norm"]))


def state_hash(cb: GNMRCallback) -> str:
    return hashlib.sha256(json.dumps(cb._run_state(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def trace_norms(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [{"step": r["step"], "norms": r["norms"], "active": r["active"]} for r in map(json.loads, f)]


def train_one(out: str, config: dict | None, fsdp2: bool, batch: int = PER_DEVICE) -> tuple[Trainer, Recorder]:
    model, _ = tiny_model()
    rec = Recorder()
    callbacks = ([GNMRCallback(config)] if config is not None else []) + [rec]
    trainer = Trainer(model=model, args=targs(out, fsdp2, batch), train_dataset=dataset(), callbacks=callbacks)
    trainer.train()
    return trainer, rec


def single_process(out: str) -> dict:
    """The one-process reference: the switching run on the global batch (2 x the per-device batch)."""
    trainer, rec = train_one(os.path.join(out, "single"), SWITCHY, fsdp2=False, batch=2 * PER_DEVICE)
    return {"trace": trace_norms(os.path.join(out, "single", "gnmr_trace.jsonl")), "steps": rec.steps}


def mode_trainer(out: str) -> None:
    load_pretrain().accelerate_fsdp_on_cpu()
    result: dict = {}
    trainer, rec = train_one(os.path.join(out, "gnmr"), SWITCHY, fsdp2=True)
    rank = torch.distributed.get_rank()
    result.update(world_size=torch.distributed.get_world_size(), fsdp2=bool(trainer.accelerator.is_fsdp2),
                  sharded=rec.sharded, steps=rec.steps, trace_written=gnmr_of(trainer).trace_path is not None)
    for name, config in (("monitor", MONITOR), ("plain", None)):
        trainer, rec = train_one(os.path.join(out, name), config, fsdp2=True)
        result[f"{name}_grad_norms"] = rec.grad_norms
        weights = full_weights(trainer.model)  # collective: every rank takes part
        if rank == 0:
            torch.save(weights, os.path.join(out, f"{name}_weights.pt"))
    result["bnb_error"] = bnb_under_fsdp2(out)
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def bnb_under_fsdp2(out: str) -> str:
    """A bitsandbytes INT8 dual-path model handed to an FSDP2 Trainer: the error the callback raises."""
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import gnmr_hf
    from tests.conftest import make_tiny_llama

    path = os.path.join(out, "tiny_bnb")
    if torch.distributed.get_rank() == 0:
        make_tiny_llama(path, num_layers=2, hidden=32)
    torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    try:
        Trainer(model=model, args=targs(os.path.join(out, "bnb"), fsdp2=True), train_dataset=dataset(),
                callbacks=[GNMRCallback(SWITCHY)])
    except ValueError as e:
        return str(e)
    return ""


class Kill(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs


def mode_stress(out: str, runs: list[str], kill_at: int | None, resume: bool) -> None:
    pretrain = load_pretrain()
    base = Path(out)
    for i, spec in enumerate(runs):
        name, _, spec = spec.rpartition("=")
        method, low, *rest = spec.split(":")
        name = name or spec.replace(":", "_")
        overrides = [f"data.cache_dir={base / 'cache'}", "train.save_final=false"]
        if rest:
            steps = int(rest[0])
            overrides += [f"train.max_steps={steps}", "train.save_steps=2", "train.eval_steps=100",
                          "train.warmup_ratio=0.125"]
        cfg = pretrain.load_config(REPO / "recipes" / "stress" / "configs" / "cpu_tiny.yaml", overrides)
        rec = Recorder()
        extra = [rec]
        last = i == len(runs) - 1
        if last and kill_at is not None:
            extra.append(Kill(kill_at))
        res = pretrain.run(cfg, method, base / name, resume=resume and last, low=low, fsdp2=True,
                           extra_callbacks=extra)
        rank = torch.distributed.get_rank()
        with open(base / name / f"rank{rank}.json", "w", encoding="utf-8") as f:
            json.dump({"world_size": torch.distributed.get_world_size(), "fsdp2": res["fsdp2"], "sharded": rec.sharded,
                       "begin": rec.begin, "steps": rec.steps, "final_eval_loss": res["final_eval_loss"]}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("trainer", "stress"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", action="append", default=[], help="[NAME=]METHOD:LOW[:MAX_STEPS] (stress mode)")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mode == "trainer":
        mode_trainer(a.out)
    else:
        mode_stress(a.out, a.job, a.kill_at, a.resume)


if __name__ == "__main__":
    main()
