"""Step-time overhead of GNMRCallback on a real SmolLM2-135M LoRA run (CPU).

Arms, all the same LoRA fine-tune (r=8, the seven projections, batch of random tokens) in one process:

- ``plain``:        BF16 base, no callback
- ``monitor``:      BF16 base, GNMRCallback monitor-only (no dual-path layers)
- ``int8``:         INT8 base with dual-path layers, no callback (every layer on INT8)
- ``gnmr``:         INT8 base with dual-path layers, GNMRCallback actuating (BF16 recovery from host)

The arms run round-robin (``--rounds`` rounds of ``--steps`` optimizer steps each) so that load
changes on a shared machine hit all arms alike; the first step of every round is dropped (warm-up).
Step time is measured from ``on_step_begin`` to ``on_step_end`` (forward, backward, clip, callbacks,
optimizer); the callback's own time inside ``on_pre_optimizer_step`` is measured separately, which
is the precise figure when the machine's noise is larger than the overhead.

    python bench/overhead.py --rounds 3 --steps 5 --components
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import gnmr_hf

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepTimer:
    """Trainer callback: wall time of each optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer.times.append(time.perf_counter() - timer._t0)
                timer.per_round[-1].append(timer.times[-1])

        self.callback = _CB()
        self.times: list[float] = []
        self.per_round: list[list[float]] = []


def timed_gnmr_callback(**kw):
    """A GNMRCallback whose on_pre_optimizer_step time (norms, clip, controller, switching, trace) is recorded."""
    from gnmr_hf.trainer.callback import GNMRCallback

    class Timed(GNMRCallback):
        hook_times: list[float] = []

        def on_pre_optimizer_step(self, *a, **k):
            t0 = time.perf_counter()
            out = super().on_pre_optimizer_step(*a, **k)
            self.hook_times.append(time.perf_counter() - t0)
            return out

    cb = Timed(**kw)
    cb.hook_times = []
    return cb


def build(path: str, int8: bool, seed: int = 0):
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if int8:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
        )
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=LINEARS))


def components(model, batch, reps: int = 20) -> dict[str, float]:
    """Median milliseconds of the pieces of the callback's per-step work on real gradients of ``model``."""
    from gnmr_hf.core.controller import GNMRConfig, GNMRController
    from gnmr_hf.trainer.callback import _UnitParams
    from gnmr_hf.units import resolve_units

    model(**batch).loss.backward()
    units = _UnitParams(resolve_units(model))
    ctrl = GNMRController(units.num_units, GNMRConfig())
    norms = units.sq_norms(units.grads()).sqrt().cpu()

    def ms(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return {
        "fused per-unit norms (+ host copy)": ms(lambda: units.sq_norms(units.grads()).sqrt().cpu()),
        "controller.step + record": ms(lambda: (ctrl.step(norms), ctrl.last_record)),
        # what the takeover adds: the Trainer still runs this pass (max_norm=inf multiplies by 1.0) ...
        "Trainer norm pass, clip_grad_norm_(inf)": ms(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))),
        # ... and the callback's clip is the one the Trainer would have done anyway
        "the clip itself, clip_grad_norm_(1.0)": ms(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per arm per round (first one dropped)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is; 1 avoids oversubscription on a shared machine)")
    ap.add_argument("--arms", default="plain,monitor,int8,gnmr")
    ap.add_argument("--max-active", type=int, default=10)
    ap.add_argument("--components", action="store_true", help="also time the pieces of the callback's step work")
    a = ap.parse_args()

    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    if a.threads:
        torch.set_num_threads(a.threads)
    path = gnmr_hf.smollm2_checkpoint()
    g = torch.Generator().manual_seed(0)
    n = a.batch_size * a.steps * 2
    ids = torch.randint(0, 49152, (n, a.seq_len), generator=g).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    arms = a.arms.split(",")
    out = tempfile.mkdtemp(prefix="gnmr_overhead_")

    runs = {}
    for arm in arms:
        model = build(path, int8=arm in ("int8", "gnmr"))
        timer = StepTimer()
        callbacks = [timer.callback]
        cb = None
        if arm in ("monitor", "gnmr"):
            # thresholds of the paper's stress test; the trace is written as in a real run
            cb = timed_gnmr_callback(config={"max_active": a.max_active, "alpha": 1.1, "alpha_init": 1.5, "beta": 1.5})
            callbacks.append(cb)
        args = TrainingArguments(
            output_dir=os.path.join(out, arm), max_steps=a.steps, per_device_train_batch_size=a.batch_size,
            learning_rate=2e-4, lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1,
            save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0, bf16=False,
        )
        runs[arm] = {"trainer": Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks),
                     "timer": timer, "cb": cb, "kept": [], "hook": []}

    for r in range(a.rounds):
        for arm in arms:
            run = runs[arm]
            run["timer"].per_round.append([])
            if run["cb"] is not None:
                run["cb"].hook_times = []
            run["trainer"].train()
            run["kept"] += run["timer"].per_round[-1][1:]
            if run["cb"] is not None:
                run["hook"] += run["cb"].hook_times[1:]
            print(f"round {r + 1}/{a.rounds} {arm:8s} median step {statistics.median(run['timer'].per_round[-1][1:]):.3f} s",
                  flush=True)

    print(f"\nSmolLM2-135M LoRA r=8, batch {a.batch_size} x {a.seq_len} tokens, CPU threads {torch.get_num_threads()}, "
          f"{a.rounds} rounds x {a.steps - 1} timed steps per arm")
    med = {arm: statistics.median(runs[arm]["kept"]) for arm in arms}
    for arm in arms:
        line = f"  {arm:8s} median step {med[arm]:.4f} s  (min {min(runs[arm]['kept']):.4f}, n={len(runs[arm]['kept'])})"
        if runs[arm]["hook"]:
            hook = statistics.median(runs[arm]["hook"])
            line += f"; callback on_pre_optimizer_step median {hook * 1e3:.2f} ms = {hook / med[arm] * 100:.2f}% of the step"
        if arm == "gnmr" and runs[arm]["cb"] is not None:
            s = runs[arm]["cb"].controller.summary()
            line += f"; promotion ratio {s['promotion_ratio']:.3f}, switches {s['switches']}"
        print(line)
    if a.components and "monitor" in runs:
        batch = {"input_ids": torch.tensor(ids[: a.batch_size]), "labels": torch.tensor(ids[: a.batch_size])}
        print("  monitor-only per-step pieces (median ms):")
        for name, v in components(runs["monitor"]["trainer"].model, batch).items():
            print(f"    {name:42s} {v:8.2f} ms = {v / 1e3 / med['monitor'] * 100:.2f}% of the monitor step")
    if "plain" in med and "monitor" in med:
        print(f"  monitor / plain = {med['monitor'] / med['plain']:.4f}")
    if "int8" in med and "gnmr" in med:
        print(f"  gnmr / int8     = {med['gnmr'] / med['int8']:.4f}")
    if "plain" in med and "gnmr" in med:
        print(f"  gnmr / plain    = {med['gnmr'] / med['plain']:.4f}")


if __name__ == "__main__":
    main()
