"""Step-time overhead of GNMRCallback on a real SmolLM2-135M LoRA run (CPU).

Arms, all the same LoRA fine-tune (r=8, the seven projections, batch of random tokens) in one process:

- ``plain``:        BF16 base, no callback
- ``monitor``:      BF16 base, GNMRCallback monitor-only (no dual-path layers)
- ``int8``:         INT8 base with dual-path layers, no callback (every layer on INT8)
- ``gnmr``:         INT8 base with dual-path layers, GNMRCallback actuating (BF16 recovery from host)

The arms run round-robin (``--rounds`` rounds of ``--steps`` optimizer steps each) so that load
changes on a shared machine hit all arms alike; the first step of every round is dropped (warm-up).
Step time is measured from ``on_step_begin`` to ``on_step_end`` (forward, backward, clip, callbacks,
optimizer). The callback's own share is measured inside the step, which is the precise figure when
the machine's noise is larger than the overhead: the time in its hooks (controller, switching, trace,
logs), plus what its answer to the Trainer's clip call costs beyond the Trainer's own norm pass (the
same call timed in the arm without the callback: ``plain`` for ``monitor``, ``int8`` for ``gnmr``).
Figures: median and minimum over the timed steps, and the share of the arm's median step time.

    OMP_NUM_THREADS=1 python bench/cost/overhead.py --rounds 3 --steps 5 --components
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
    """A GNMRCallback whose own work is timed per optimizer step: its hooks (controller, switching,
    trace, logs) in ``hook_times`` and its answer to the Trainer's clip call (the one norm pass, which
    replaces the Trainer's own) in ``clip_times``."""
    from gnmr_hf.trainer.callback import GNMRCallback

    class Timed(GNMRCallback):
        def __init__(self, **k):
            super().__init__(**k)
            self.hook_times: list[float] = []
            self.clip_times: list[float] = []
            self._acc = 0.0

        def _timed(self, fn, *a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self._acc += time.perf_counter() - t0
            return out

        def on_step_begin(self, *a, **k):
            self._acc = 0.0
            return self._timed(super().on_step_begin, *a, **k)

        def on_substep_end(self, *a, **k):
            return self._timed(super().on_substep_end, *a, **k)

        def on_pre_optimizer_step(self, *a, **k):
            return self._timed(super().on_pre_optimizer_step, *a, **k)

        def on_optimizer_step(self, *a, **k):
            return self._timed(super().on_optimizer_step, *a, **k)

        def on_step_end(self, *a, **k):
            out = self._timed(super().on_step_end, *a, **k)
            self.hook_times.append(self._acc)
            return out

        def on_log(self, *a, **k):
            t0 = time.perf_counter()
            out = super().on_log(*a, **k)
            if self.hook_times:  # the step's logs come after its on_step_end
                self.hook_times[-1] += time.perf_counter() - t0
            return out

        def clip_grad_norm_(self, parameters, max_norm):
            t0 = time.perf_counter()
            out = super().clip_grad_norm_(parameters, max_norm)
            self.clip_times.append(time.perf_counter() - t0)
            return out

    return Timed(**kw)


def time_trainer_clip(trainer) -> list[float]:
    """Time the Trainer's own norm pass (``accelerator.clip_grad_norm_``) in an arm without GNMR."""
    times: list[float] = []
    original = trainer.accelerator.clip_grad_norm_

    def clip_grad_norm_(*a, **k):
        t0 = time.perf_counter()
        out = original(*a, **k)
        times.append(time.perf_counter() - t0)
        return out

    trainer.accelerator.clip_grad_norm_ = clip_grad_norm_
    return times


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
    from gnmr_hf.trainer.grad_norms import UnitGradNorms
    from gnmr_hf.units import resolve_units

    model(**batch).loss.backward()
    units = UnitGradNorms(resolve_units(model))
    ctrl = GNMRController(units.num_units, GNMRConfig())
    params = list(model.parameters())
    norms = units.clip_(params, float("inf"))[1].sqrt().cpu()

    def ms(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return {
        # the Trainer's own pass (what a run without the callback does at every step) ...
        "torch clip_grad_norm_(params, 1e9)": ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
        # ... and the callback's replacement of it, which also yields the per-unit norms
        "UnitGradNorms.clip_(params, 1e9) + host copy": ms(lambda: units.clip_(params, 1e9)[1].sqrt().cpu()),
        "controller.step + record": ms(lambda: (ctrl.step(norms), ctrl.last_record)),
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
            # monitor-only: max_active 0 (a model without dual-path layers; GNMRCallback refuses more)
            max_active = a.max_active if arm == "gnmr" else 0
            cb = timed_gnmr_callback(config={"max_active": max_active, "alpha": 1.1, "alpha_init": 1.5, "beta": 1.5})
            callbacks.append(cb)
        args = TrainingArguments(
            output_dir=os.path.join(out, arm), max_steps=a.steps, per_device_train_batch_size=a.batch_size,
            learning_rate=2e-4, lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1,
            save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0, bf16=False,
        )
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
        clip = time_trainer_clip(trainer) if cb is None else None
        runs[arm] = {"trainer": trainer, "timer": timer, "cb": cb, "clip_src": clip, "kept": [], "hook": [], "clip": []}

    for r in range(a.rounds):
        for arm in arms:
            run = runs[arm]
            run["timer"].per_round.append([])
            if run["cb"] is not None:
                run["cb"].hook_times, run["cb"].clip_times = [], []
            else:
                run["clip_src"].clear()
            run["trainer"].train()
            run["kept"] += run["timer"].per_round[-1][1:]  # the first step of a round is warm-up
            if run["cb"] is not None:
                run["hook"] += run["cb"].hook_times[1:]
                run["clip"] += run["cb"].clip_times[1:]
            else:
                run["clip"] += run["clip_src"][1:]
            print(f"round {r + 1}/{a.rounds} {arm:8s} median step {statistics.median(run['timer'].per_round[-1][1:]):.3f} s",
                  flush=True)

    print(f"\nSmolLM2-135M LoRA r=8, batch {a.batch_size} x {a.seq_len} tokens, CPU threads {torch.get_num_threads()}, "
          f"{a.rounds} rounds x {a.steps - 1} timed steps per arm")
    med = {arm: statistics.median(runs[arm]["kept"]) for arm in arms}
    for arm in arms:
        run = runs[arm]
        print(f"  {arm:8s} step median {med[arm]:.4f} s, min {min(run['kept']):.4f} s (n={len(run['kept'])}); "
              f"clip call median {statistics.median(run['clip']) * 1e3:.2f} ms")
    for arm, base in (("monitor", "plain"), ("gnmr", "int8")):
        if arm not in runs or base not in runs:
            continue
        run = runs[arm]
        hook_med, hook_min = statistics.median(run["hook"]), min(run["hook"])
        extra_clip = statistics.median(run["clip"]) - statistics.median(runs[base]["clip"])
        own_med, own_min = hook_med + max(extra_clip, 0.0), hook_min + max(extra_clip, 0.0)
        print(f"  {arm}: callback hooks median {hook_med * 1e3:.2f} ms (min {hook_min * 1e3:.2f}); clip call "
              f"{extra_clip * 1e3:+.2f} ms vs the Trainer's own ({base}); own share of the step: median "
              f"{own_med / med[arm] * 100:.3f}%, min {own_min / med[arm] * 100:.3f}%")
        if arm == "gnmr":
            s = run["cb"].controller.summary()
            print(f"  gnmr: promotion ratio {s['promotion_ratio']:.3f}, switches {s['switches']}")
    if a.components and "monitor" in runs:
        batch = {"input_ids": torch.tensor(ids[: a.batch_size]), "labels": torch.tensor(ids[: a.batch_size])}
        print("  monitor-only per-step pieces (median ms):")
        for name, v in components(runs["monitor"]["trainer"].model, batch).items():
            print(f"    {name:46s} {v:8.2f} ms = {v / 1e3 / med['monitor'] * 100:.3f}% of the monitor step")
    for arm, base in (("monitor", "plain"), ("gnmr", "int8"), ("gnmr", "plain")):
        if arm in med and base in med:
            print(f"  {arm} / {base} step time = {med[arm] / med[base]:.4f}")


if __name__ == "__main__":
    main()
