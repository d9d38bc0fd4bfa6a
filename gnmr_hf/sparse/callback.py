"""``DSTCallback``: dynamic sparse training's topology updates inside a ``transformers.Trainer``.

Every ``update_every`` optimizer steps (ΔT; steps ΔT, 2ΔT, ... up to ``end_step``) it updates each
:class:`~gnmr_hf.sparse.layer.SparseLinear` after the optimizer step (``on_step_end``) and restarts the
moved slots' optimizer state (:meth:`~gnmr_hf.sparse.optim.SparseAdamW.reset_slots`); the next update of
those weights is step ``u + 1``. For RigL it collects the dense weight gradients of the update step
(summed over its micro-batches). The SET draw of layer ``i`` at step ``u`` comes from a generator seeded by
``(seed, u, i)``: the callback holds no state of its own, the topology lives in the layers' ``index``
buffers (the model checkpoint) and the ages in the optimizer state, so ``resume_from_checkpoint`` continues
the same run.

GNMR picks the units whose regrown weights get SMET's warm-up through ``GNMRCallback`` (the layers are
dual-path modules); this callback only moves the masks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers.trainer_callback import TrainerCallback

from gnmr_hf.sparse.layer import REGROW, _mix, sparse_linears
from gnmr_hf.sparse.optim import SparseAdamW


def find_sparse_optimizer(optimizer: Any) -> SparseAdamW:
    """The :class:`SparseAdamW` inside the Trainer's optimizer (accelerate wraps it)."""
    opt = optimizer
    for _ in range(4):
        if isinstance(opt, SparseAdamW):
            return opt
        opt = getattr(opt, "optimizer", None)
    raise TypeError(f"DSTCallback needs the Trainer to run a SparseAdamW (Trainer(optimizers=(opt, None))), "
                    f"got {type(optimizer).__name__}")


class DSTCallback(TrainerCallback):
    """Move the masks of the model's :class:`SparseLinear` layers every ``update_every`` steps.

    Args:
        update_every (`int`): ΔT, steps between topology updates.
        drop_fraction (`float`, defaults to 0.3): share of each layer's active blocks replaced per update.
        regrow (`str`, defaults to ``"set"``): ``"set"`` (random) or ``"rigl"`` (gradient magnitude).
        seed (`int`, defaults to 0): the SET draws' seed.
        end_step (`int`, *optional*): no update after this step (None: the whole run).
        log_path (`str`, *optional*): a JSONL file getting one line per update (step, per-layer moved count).
    """

    def __init__(self, update_every: int, drop_fraction: float = 0.3, regrow: str = "set", seed: int = 0,
                 end_step: int | None = None, log_path: str | None = None) -> None:
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"update_every must be a positive integer, got {update_every!r}")
        if not 0 <= drop_fraction <= 1:
            raise ValueError(f"drop_fraction must be in [0, 1], got {drop_fraction!r}")
        if regrow not in REGROW:
            raise ValueError(f"regrow must be one of {REGROW}, got {regrow!r}")
        self.update_every, self.drop_fraction, self.regrow = update_every, drop_fraction, regrow
        self.seed, self.end_step, self.log_path = seed, end_step, log_path
        self.updates: list[dict] = []  # this process's updates: {"step", "moved": [per layer]}

    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed run repeats the steps after its checkpoint: drop their lines from the log
        if self.log_path and state.global_step > 0 and state.is_world_process_zero and os.path.isfile(self.log_path):
            cut_jsonl(self.log_path, state.global_step)

    def is_update_step(self, step: int) -> bool:
        return step % self.update_every == 0 and (self.end_step is None or step <= self.end_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.regrow == "rigl" and self.is_update_step(state.global_step + 1):
            for _, layer in sparse_linears(model):
                layer.capture = torch.zeros(layer.out_features, layer.in_features, device=layer.values.device)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step
        if not self.is_update_step(step):
            return
        opt = find_sparse_optimizer(optimizer)
        moved = []
        for i, (_, layer) in enumerate(sparse_linears(model)):
            grad, layer.capture = layer.capture, None
            slots, _, _ = layer.update_topology(self.drop_fraction, self.regrow,
                                                torch.Generator().manual_seed(_mix(self.seed, step, i)), grad)
            opt.reset_slots(layer, slots)
            moved.append(len(slots))
        record = {"step": step, "moved": moved}
        self.updates.append(record)
        if self.log_path and state.is_world_process_zero:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def cut_jsonl(path: str, step: int) -> None:
    """Keep the lines of a JSONL log whose ``step`` is at most ``step``."""
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def topology(model) -> dict[str, torch.Tensor]:
    """Each :class:`SparseLinear`'s active block ids, sorted (for comparisons of two runs)."""
    return {name: layer.index.sort().values.clone() for name, layer in sparse_linears(model)}


__all__ = ["DSTCallback", "find_sparse_optimizer", "topology"]
