"""Worker for ``tests/test_sharded_planned.py``: ``recipes/finetune.py`` itself, launched with one or two processes
(``accelerate launch --config_file recipes/accelerate/cpu-ddp.yaml`` for DDP, ``torchrun --nproc_per_node 2 ...
--fsdp full_shard --fsdp_config recipes/accelerate/fsdp2-qlora.json`` for FSDP2 on a CPU, plain ``python`` for the
one-process reference). The command line is the recipe's.

Beside what the recipe writes (rank 0), every rank writes ``{output_dir}/rank{r}.json``: the plan it made (the
recipe's plan record: indices, modules, rungs, ranks_agreed), the units on the recovery path at every step, how
many of its parameters are FSDP2 ``DTensor`` shards (all, 4-bit weights and the trainable ones) and a SHA-256 of
every 4-bit weight as the forward sees it (gathered in full under FSDP2), so the test can check that sharding
left the packed 4-bit bytes as they were. ``GNMR_KILL_AT=K`` in the environment SIGKILLs every rank after step K.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def weight_digests(model) -> dict[str, str]:
    """SHA-256 of every 4-bit weight's packed bytes (as uint8), the full tensor under FSDP2 (a collective)."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight
            w = w.full_tensor() if isinstance(w, DTensor) else w.data
            out[name.split("model.", 1)[-1]] = hashlib.sha256(
                w.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


class Recorder(TrainerCallback):
    def __init__(self, kill_at: int | None):
        self.kill_at, self.active, self.shards, self.digests = kill_at, [], None, None

    def on_train_begin(self, args, state, control, model=None, **kw):
        import bitsandbytes as bnb
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        four = [m.weight for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        self.shards = {"params": len(params), "dtensor": sum(isinstance(p, DTensor) for p in params),
                       "4bit": len(four), "4bit_dtensor": sum(isinstance(w, DTensor) for w in four),
                       "trainable": sum(p.requires_grad for p in params),
                       "trainable_dtensor": sum(p.requires_grad and isinstance(p, DTensor) for p in params)}
        self.digests = weight_digests(model)

    def on_step_end(self, args, state, control, model=None, **kw):
        import gnmr_hf

        self.active.append(gnmr_hf.active_units(model, units="linears"))
        if self.kill_at is not None and state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs


def main() -> None:
    kill_at = int(os.environ["GNMR_KILL_AT"]) if os.environ.get("GNMR_KILL_AT") else None
    torch.set_num_threads(1)
    plans = []
    inner = finetune.planned_policy

    def planned_policy(*args, **kwargs):
        policy, record = inner(*args, **kwargs)
        plans.append(record)
        return policy, record

    finetune.planned_policy = planned_policy
    recipe = finetune.load_config(sys.argv[1:])
    rec = Recorder(kill_at)
    finetune.run(recipe, extra_callbacks=[rec])
    plan = plans[0] if plans else {}
    with open(Path(recipe.training.output_dir) / f"rank{_rank()}.json", "w", encoding="utf-8") as f:
        json.dump({"world_size": recipe.training.world_size, "active": rec.active, "shards": rec.shards,
                   "digests": rec.digests, "plan": {k: plan.get(k) for k in ("indices", "modules", "rungs",
                                                                                 "ranks_agreed")}}, f)


if __name__ == "__main__":
    main()
