"""Forward and backward time of one SmolLM2-135M LoRA step on the NF4 dual-path model, per compute dtype.

Why ``bench/value/nf4_bench.py`` computes in FP32 on a CPU: on one without BF16 matrix instructions a BF16
step is an order of magnitude slower. Loads the ``gnmr-nf4`` recipe's model through
``recipes/finetune.py`` (NF4 base, a recovery path per decoder layer, LoRA r=8 on the seven
projections) with ``compute_dtype`` = ``--dtype``, then times forward and backward of a batch of
4 x 110 random tokens with every layer on NF4 and with every layer on BF16::

    OMP_NUM_THREADS=1 python bench/cost/nf4_step.py --dtype float32
    OMP_NUM_THREADS=1 python bench/cost/nf4_step.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    from gnmr_hf.backends.base import set_active_units
    from gnmr_hf.units import resolve_units

    recipe = finetune.load_config(["--config", str(ROOT / "recipes" / "smollm2-135m" / "gnmr-nf4.yaml"),
                                   "--compute_dtype", args.dtype])
    model = finetune.load_model(recipe, finetune.resolve_model_path(recipe.script.model))
    model.eval()  # no LoRA dropout in the timed passes
    units = resolve_units(model)
    x = torch.randint(0, 1000, (4, 110), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, compute {args.dtype}, {torch.get_num_threads()} thread(s)")
    for idx, name in (([], "every layer NF4"), (list(range(len(units))), "every layer BF16")):
        set_active_units(model, idx, units)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = model(input_ids=x, labels=x)
            t1 = time.perf_counter()
            out.loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            print(f"{name}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
