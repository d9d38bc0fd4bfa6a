"""Peak memory of one training step, dense against SparseLinear (gnmr_hf.sparse), on the CPU.

What :mod:`bench.cost.sparse_memory` counts is the state held between steps (weights, gradients, optimizer
state). A :class:`~gnmr_hf.sparse.SparseLinear` also *forms* a dense ``out x in`` weight in its forward, and
in its backward the dense weight again and the dense weight gradient (``g^T x``) before gathering it to the
active blocks; these are transient, one layer at a time. This script measures what that costs at the peak.

The model is a stack of ``--layers`` square linears of ``--width`` (ReLU between), float32, trained on
``--tokens`` random rows with a mean-square loss: dense with ``torch.optim.AdamW``, sparse with
``SparseAdamW`` (every linear sparse at each ``--densities``, block 1). Each configuration runs in a fresh
process (one torch thread): build, one step (the optimizer state appears), then the peak of a second step.
Figures (MiB):

- ``held``: weights + gradients + optimizer state after a step (tensor bytes, exact);
- ``transient``: how far the second step's peak resident memory (``VmHWM``, reset just before the step
  through ``/proc/self/clear_refs``) rises above the resident memory before it: activations, and the sparse
  layers' dense weight and weight gradient (glibc's mmap threshold is fixed at 64 KiB, so every tensor of
  that size or more is mapped on allocation and unmapped on free, and the resident size follows the tensors);
- ``peak``: ``held + transient``, the step's peak of tensor memory (the gradients are zeroed, not freed,
  between steps, so they are held throughout).

Usage:
    python bench/cost/sparse_peak.py [--width 1024] [--layers 8] [--tokens 512] [--densities 0.1 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _child(width: int, layers: int, tokens: int, density: float | None) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if density is None:
        mods = [torch.nn.Linear(width, width) for _ in range(layers)]
    else:
        from gnmr_hf.sparse import SparseLinear

        mods = [SparseLinear(width, width, density=density, generator=torch.Generator().manual_seed(i))
                for i in range(layers)]
    model = torch.nn.Sequential(*[m for lin in mods for m in (lin, torch.nn.ReLU())][:-1])
    if density is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        from gnmr_hf.sparse import SparseAdamW

        opt = SparseAdamW.from_model(model, lr=1e-3)
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors += list(model.buffers())
    held = sum(t.numel() * t.element_size() for t in tensors)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    step()
    transient = _status("VmHWM") - before
    return {"density": density, "held": held, "transient": transient, "peak": held + transient}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3])
    ap.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        d = None if args.child == "dense" else float(args.child)
        print(json.dumps(_child(args.width, args.layers, args.tokens, d)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for d in [None, *args.densities]:
        cmd = [sys.executable, __file__, "--width", str(args.width), "--layers", str(args.layers),
               "--tokens", str(args.tokens), "--child", "dense" if d is None else str(d)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    dense_w = args.width * args.width * 4
    print(f"{args.layers} linears {args.width}x{args.width} float32 ({args.layers * dense_w / MIB:.0f} MiB of dense "
          f"weights, {dense_w / MIB:.0f} MiB a layer), {args.tokens} tokens; MiB")
    print("| model | held | transient | peak | held vs dense | peak vs dense |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = "dense AdamW" if r["density"] is None else f"SparseLinear d={r['density']:g} + SparseAdamW"
        print(f"| {name} | {r['held'] / MIB:.1f} | {r['transient'] / MIB:.1f} | {r['peak'] / MIB:.1f} | "
              f"{r['held'] / rows[0]['held']:.3f} | {r['peak'] / rows[0]['peak']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
