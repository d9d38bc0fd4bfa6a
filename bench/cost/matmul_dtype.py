"""BF16 against FP32 matmul time on this CPU, at the stress bench's projection shapes (docs/stress.md).

Run: OMP_NUM_THREADS=1 nice python bench/cost/matmul_dtype.py [--reps N] [--threads N]

The stress bench (``recipes/stress/configs/cpu_bench.yaml``) multiplies 1,024 tokens per micro-batch
(8 sequences x 128) by hidden 128 -> 128 (q/k/v/o), 128 -> 352 (gate/up) and 352 -> 128 (down). For
each shape this times one ``nn.Linear`` forward plus backward (input and weight gradient, the three
matmuls a training step does per projection) in FP32 and in BF16 and prints min and median over
``--reps`` repetitions after a warm-up. On a CPU with AMX-BF16 (``amx_bf16`` in /proc/cpuinfo) BF16 is
expected to be faster; without it, slower. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

# (name, in_features, out_features) of the stress bench's projections
SHAPES = (("q/k/v/o 128->128", 128, 128), ("gate/up 128->352", 128, 352), ("down 352->128", 352, 128))


def cpu_flags() -> str:
    """The CPU model and whether it has AMX-BF16 / AVX512-BF16 (Linux only; empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return platform.processor()
    text = info.read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return f"{model}; amx_bf16={'amx_bf16' in flags}, avx512_bf16={'avx512_bf16' in flags}"


def time_linear(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, reps: int) -> list[float]:
    """Seconds of forward + backward of one Linear layer, ``reps`` times after 3 warm-up runs."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(d_in, d_out, bias=False).to(dtype)
    x = torch.randn(tokens, d_in, generator=gen).to(dtype).requires_grad_(True)
    grad = torch.randn(tokens, d_out, generator=gen).to(dtype)
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        layer(x).backward(grad)
        dt = time.perf_counter() - t0
        layer.weight.grad = None
        x.grad = None
        if i >= 3:
            times.append(dt)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200, help="timed repetitions per shape and dtype (default 200)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--tokens", type=int, default=1024, help="rows of the input (default 1024 = 8 x 128)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.threads < 1 or args.tokens < 1:
        p.error("--reps, --threads and --tokens must be positive")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {cpu_flags()}")
    print(f"{'shape':<18} {'fp32 min':>9} {'fp32 med':>9} {'bf16 min':>9} {'bf16 med':>9} {'fp32/bf16 med':>14}")
    total = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for name, d_in, d_out in SHAPES:
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            t = time_linear(args.tokens, d_in, d_out, dtype, args.reps)
            row[dtype] = (min(t), statistics.median(t))
            total[dtype] += statistics.median(t)
        f, b = row[torch.float32], row[torch.bfloat16]
        print(f"{name:<18} {f[0] * 1e3:8.3f}ms {f[1] * 1e3:8.3f}ms {b[0] * 1e3:8.3f}ms {b[1] * 1e3:8.3f}ms "
              f"{f[1] / b[1]:13.2f}x")
    print(f"{'sum of medians':<18} {'':>9} {total[torch.float32] * 1e3:8.3f}ms {'':>9} "
          f"{total[torch.bfloat16] * 1e3:8.3f}ms {total[torch.float32] / total[torch.bfloat16]:13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
