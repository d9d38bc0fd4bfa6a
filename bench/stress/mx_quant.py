"""Cost of the MX low path on CPU: one linear's forward + backward, and one fake-quantisation call.

Arms (the same ``nn.Linear(width, width)``, input ``[batch, width]``, one torch thread):

- ``fp32``:          plain ``nn.Linear`` in float32
- ``mx <fmt>``:      :class:`gnmr_hf.backends.mx.MXLinear` on its low path (six fake-quantised GEMM
  operands: two forward, four backward)
- ``bf16 recovery``: the same ``MXLinear`` on its recovery path (native BF16 GEMMs)
- ``bf16 emulated``: the recovery path with ``emulate_bf16=True`` (FP32 GEMMs on BF16-rounded values)

The arms run round-robin (``--rounds`` rounds of ``--iters`` timed calls each) so that load changes
on a shared machine hit them alike; minimum and median per call are printed, and the ratio of
medians to ``fp32``. The clock is the calling thread's CPU time by default (``--clock thread``):
with one torch thread all the work runs in that thread, and time spent preempted by other processes
on a shared machine is not counted; ``--clock wall`` uses wall time. With ``--quant`` it also times ``mx_fake_quantize`` on a ``[batch, width]``
tensor for each format, beside torchao's ``MXTensor.to_mx(...).dequantize()`` when torchao is
installed.

    OMP_NUM_THREADS=1 python bench/stress/mx_quant.py --width 256 --batch 512 --quant
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from gnmr_hf.backends.mx import MX_FORMATS, MXLinear, mx_fake_quantize


def fwd_bwd(module: nn.Module, x: torch.Tensor):
    def run():
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    return run


def time_round_robin(arms: dict[str, callable], rounds: int, iters: int, clock=time.thread_time) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in arms.items():
            for _ in range(iters):
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
    return times


def print_table(times: dict[str, list[float]], ref: str) -> None:
    ref_med = statistics.median(times[ref])
    print(f"{'arm':24s} {'min ms':>8s} {'median ms':>10s} {'x ' + ref:>10s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:24s} {min(ts) * 1e3:8.3f} {med * 1e3:10.3f} {med / ref_med:10.2f}")


def torchao_quantizers() -> dict[str, callable]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except Exception:  # noqa: BLE001 - torchao is optional; any import failure means "not available"
        return {}
    elem = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": DTYPE_FP6_E3M2,
        "mxfp6_e2m3": DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }
    return {f: (lambda x, d=d: MXTensor.to_mx(x, d, 32).dequantize(x.dtype)) for f, d in elem.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--formats", default="mxfp8_e4m3,mxfp4_e2m1", help="comma-separated MX formats")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="thread: CPU time of this thread (needs --threads 1); wall: wall-clock time")
    p.add_argument("--quant", action="store_true", help="also time one fake-quantisation call per format")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread measures only the calling thread; use --clock wall with --threads > 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in MX_FORMATS:
            p.error(f"--formats: unknown MX format {f!r}; expected some of {sorted(MX_FORMATS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), width {args.width}, "
          f"batch {args.batch}, clock {args.clock}")

    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width)
    arms = {"fp32": fwd_bwd(nn.Linear(args.width, args.width), x)}
    for f in formats:
        arms[f"mx {f}"] = fwd_bwd(MXLinear.convert(nn.Linear(args.width, args.width), fmt=f), x)
    rec = MXLinear.convert(nn.Linear(args.width, args.width))
    rec.set_recovery(True)
    arms["bf16 recovery"] = fwd_bwd(rec, x)
    emu = MXLinear.convert(nn.Linear(args.width, args.width), emulate_bf16=True)
    emu.set_recovery(True)
    arms["bf16 emulated"] = fwd_bwd(emu, x)
    print("\none linear, forward + backward:")
    print_table(time_round_robin(arms, args.rounds, args.iters, clock), "fp32")

    if args.quant:
        ao = torchao_quantizers()
        qarms = {}
        for f in formats:
            qarms[f"ours {f}"] = lambda f=f: mx_fake_quantize(x, f)
            if f in ao:
                qarms[f"torchao {f}"] = lambda f=f: ao[f](x)
        qarms["copy (reference)"] = lambda: x.clone()
        print(f"\none fake-quantisation of a [{args.batch}, {args.width}] float32 tensor:")
        print_table(time_round_robin(qarms, args.rounds, args.iters, clock), "copy (reference)")


if __name__ == "__main__":
    main()
