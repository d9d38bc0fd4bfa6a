"""DDP worker for ``tests/test_callback.py::test_ddp_two_processes_agree``.

Run as ``accelerate launch --multi_gpu --num_processes 2 tests/ddp_worker.py --model DIR --out DIR``
(two gloo processes on a CPU machine). Each rank trains the tiny dual-path INT8/BF16 + LoRA model with
GNMRCallback, records the decision it took and the layers its model reports on the recovery path at
every step, then runs a second short training in which rank 1's policy flips one unit at step 3, and
records the error that must follow. Writes ``{out}/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import peft
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback, TrainingArguments

import gnmr_hf
from gnmr_hf.core.controller import GNMRConfig, GNMRController
from gnmr_hf.trainer.callback import GNMRCallback

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SWITCHY = {"max_active": 2, "lock_steps": 1, "alpha": 1.05, "alpha_init": None, "beta": 1.05, "window": 3}


class Recorder(TrainerCallback):
    def __init__(self, cb):
        self.cb, self.decisions, self.model_active = cb, [], []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.decisions.append(self.cb.active)
        self.model_active.append(gnmr_hf.active_units(model))


class FlipAt:
    """GNMRController whose decision for ``flip_at`` has unit 0 flipped (a rank gone astray)."""

    def __init__(self, inner: GNMRController, flip_at: int | None):
        self.inner, self.flip_at = inner, flip_at

    def step(self, norms):
        mask = self.inner.step(norms)
        if self.inner.t == self.flip_at:
            mask = mask.clone()
            mask[0] = ~mask[0]
        return mask

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)

    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float32, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
    )
    model = gnmr_hf.prepare_dual_path(model, recovery_source=a.model, storage="host")
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (64, 16), generator=g).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})

    def targs(sub: str, steps: int) -> TrainingArguments:
        return TrainingArguments(
            output_dir=os.path.join(a.out, sub), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
            lr_scheduler_type="constant", report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
            seed=0, use_cpu=True,
        )

    cb = GNMRCallback(SWITCHY)
    rec = Recorder(cb)
    trainer = Trainer(model=model, args=targs("run", 8), train_dataset=ds, callbacks=[cb, rec])
    trainer.train()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    flip_at = 3 if rank == 1 else None
    forced = GNMRCallback(
        policy=lambda n, recoverable: FlipAt(GNMRController(n, GNMRConfig(**SWITCHY), recoverable), flip_at), trace=False
    )
    error = ""
    try:
        Trainer(model=model, args=targs("forced", 6), train_dataset=ds, callbacks=[forced]).train()
    except RuntimeError as e:
        error = str(e)

    with open(os.path.join(a.out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"world_size": world, "decisions": rec.decisions, "model_active": rec.model_active,
                   "trace_written": cb.trace_path is not None, "forced_error": error}, f)


if __name__ == "__main__":
    main()
