"""Wall time of one GNMRController.step() (min and median) for U = 40, 1,000 and 10,000 units.

Run: OMP_NUM_THREADS=1 nice python bench/cost/controller.py [--reps N] [--threads N]

Targets: a median of at most 50 us at U = 40 and 2 ms at U = 10,000 on one thread.

The norms are float32 (as a callback gathers them) and drawn so that a realistic share of units
is risky: most steps have a few candidates, and every 10th step has a burst of spikes larger than
max_active, which exercises the top-K cut. Printed per U: the median and min wall time, the median
thread CPU time (less sensitive to other processes on a shared machine than wall time), and the
median of step() plus building ``last_record`` (the per-unit lists a callback logs), which step()
defers to first access.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from gnmr_hf.core.controller import GNMRConfig, GNMRController


def make_norms(num_units: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(num_units, generator=gen) + 0.5  # per-unit typical norm
    rows = []
    for i in range(steps):
        noise = 1.0 + 0.1 * torch.randn(num_units, generator=gen)
        spikes = torch.rand(num_units, generator=gen) < (0.05 if i % 10 == 0 else 0.002)
        rows.append((scale * noise.abs() * torch.where(spikes, 3.0, 1.0)).float())
    return rows


def time_steps(num_units: int, reps: int, warmup: int, with_record: bool) -> tuple[float, float, float]:
    """Median and min wall time and median thread CPU time of one step, in seconds."""
    ctrl = GNMRController(num_units, GNMRConfig(max_active=10, init_steps=20))
    rows = make_norms(num_units, warmup + reps)
    for row in rows[:warmup]:
        ctrl.step(row)
    times, cpu = [], []
    for row in rows[warmup:]:
        start, start_cpu = time.perf_counter(), time.thread_time()
        ctrl.step(row)
        if with_record:
            ctrl.last_record  # noqa: B018 (the access builds the record)
        cpu.append(time.thread_time() - start_cpu)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}")
    print(f"{'U':>7}  {'step() median':>14}  {'step() min':>11}  {'step() CPU median':>18}  "
          f"{'+last_record median':>20}")
    for num_units in (40, 1_000, 10_000):
        reps = args.reps if num_units <= 1_000 else max(args.reps // 4, 50)
        med, best, cpu = time_steps(num_units, reps, args.warmup, with_record=False)
        med_rec, _, _ = time_steps(num_units, reps, args.warmup, with_record=True)
        print(f"{num_units:>7}  {med * 1e6:>11.1f} us  {best * 1e6:>8.1f} us  {cpu * 1e6:>15.1f} us  "
              f"{med_rec * 1e6:>17.1f} us")


if __name__ == "__main__":
    main()
