"""Forward and backward time of one SmolLM2-135M LoRA step on the NF4 dual-path model, per compute dtype.

Why ``bench/nf4_bench.py`` computes in FP32 on a CPU: on one without BF16 matrix instructions a BF16
step is an order of magnitude slower. Loads the ``gnmr-nf4`` recipe's model (NF4 base, a recovery
path per decoder layer, LoRA r=8 on the seven projections) with ``bnb_4bit_compute_dtype`` and the
recovery weights in ``--dtype``, then times forward and backward of a batch of 4 x 110 random tokens
with every layer on NF4 and with every layer on BF16::

    OMP_NUM_THREADS=1 python bench/nf4_step.py --dtype float32
    OMP_NUM_THREADS=1 python bench/nf4_step.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import gnmr_hf
    from gnmr_hf.backends.base import set_active_units
    from gnmr_hf.units import resolve_units

    dtype = getattr(torch, args.dtype)
    path = str(gnmr_hf.smollm2_checkpoint())
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host", dtype=dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
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
