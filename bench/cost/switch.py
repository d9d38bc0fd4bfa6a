"""Time to promote / demote one decoder layer of the dual path (INT8 or 4-bit low path), and peak recovery bytes.

Run on a CPU machine (SmolLM2-135M-Instruct by default) or a CUDA machine (the model is placed on
GPU 0; promotion copies go through the side stream, and the script reports both the time the call
takes and the time until the copy has landed, with ``torch.cuda.synchronize``, plus device memory)::

    python bench/cost/switch.py                       # SmolLM2, INT8, all storages, layer 15, 20 repetitions
    python bench/cost/switch.py --quant nf4 --storage host --reps 50 --model /path/to/ckpt

On CPU the copy runs on torch's intra-op threads: ``--threads`` defaults to 1 there, so on a shared
machine the figure is the copy itself and not thread contention (pass more to measure threading).
Figures are printed, never asserted; minimum and median are reported.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import gnmr_hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(times: list[float]) -> str:
    return f"{1e3 * min(times):.2f} / {1e3 * statistics.median(times):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or offline alias (default: smollm2-135m-instruct)")
    p.add_argument("--storage", nargs="+", default=["host", "device", "disk"])
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quant", choices=["int8", "nf4", "fp4"], default="int8", help="the low path the model is loaded in")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU; torch's default on CUDA)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is available")
    args = p.parse_args()
    # bitsandbytes logs "inputs will be cast ... to float16" at every INT8 forward of a BF16 input
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.offline.gguf_models import resolve_model

    path = resolve_model(args.model or "smollm2-135m-instruct")
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.quant == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16,
        **({"device_map": {"": 0}} if device.type == "cuda" else {}),
    ).eval()
    load_s = time.perf_counter() - t0
    # resolved once and passed in, as the callback does, so the timings leave out unit discovery
    units = gnmr_hf.find_decoder_layers(model)
    n_layers = len(units)
    print(f"model {path}: {n_layers} decoder layers, {args.quant.upper()} load {load_s:.1f} s, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, layer {args.layer}, {args.reps} reps")
    header = (f"{'storage':8} {'prepare s':>9} {'promote ms min/med':>18} {'ready ms min/med':>16} "
              f"{'demote ms min/med':>17} {'layer MiB':>9} {'peak rec MiB':>12}")
    if device.type == "cuda":
        header += f" {'dev alloc +MiB':>14}"
    print(header)
    ids = torch.randint(0, 100, (1, 8), device=device)
    for storage in args.storage:
        _sync(device)
        t0 = time.perf_counter()
        gnmr_hf.prepare_dual_path(model, path, storage=storage)
        prep_s = time.perf_counter() - t0
        gnmr_hf.set_active_units(model, [], units)
        with torch.no_grad():
            model(ids)  # warm up both paths (allocator, kernels) before timing
            gnmr_hf.set_active_units(model, [args.layer], units)
            model(ids)
            gnmr_hf.set_active_units(model, [], units)
        _sync(device)
        promote, ready, demote, peak, alloc = [], [], [], 0, 0
        for _ in range(args.reps):
            base_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            gnmr_hf.set_active_units(model, [args.layer], units)
            t1 = time.perf_counter()
            _sync(device)  # the copy has landed: what a forward waiting on the event would see
            t2 = time.perf_counter()
            peak = max(peak, gnmr_hf.recovery_device_bytes(model))
            if device.type == "cuda":
                alloc = max(alloc, torch.cuda.memory_allocated(device) - base_alloc)
            t3 = time.perf_counter()
            gnmr_hf.set_active_units(model, [], units)
            _sync(device)
            t4 = time.perf_counter()
            promote.append(t1 - t0)
            ready.append(t2 - t0)
            demote.append(t4 - t3)
        layer_bytes = sum(
            m.recovery_device_bytes() if storage == "device" else 2 * m.in_features * m.out_features
            for m in units[args.layer][1].modules()
            if hasattr(m, "recovery_key")
        )
        row = (f"{storage:8} {prep_s:9.2f} {_ms(promote):>18} {_ms(ready):>16} {_ms(demote):>17} "
               f"{layer_bytes / 2**20:9.2f} {peak / 2**20:12.2f}")
        if device.type == "cuda":
            row += f" {alloc / 2**20:14.2f}"
        print(row)
    print("promote = the set_active_units call; ready = until the copy is complete (GPU: synchronize); "
          "peak rec = max recovery_device_bytes over the repetitions (\"device\": all layers resident)")


if __name__ == "__main__":
    main()
