"""What a stock bitsandbytes NF4 model computes on a CPU with AVX512-BF16 against one without, and what gnmr_hf's.

On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit`` repacks its weight at the first eval-mode forward under
``no_grad`` (block scales rounded to BF16, a BF16 kernel); gnmr_hf keeps every 4-bit layer it loads or trains on
the reference layout (de-quantise + matmul: ``gnmr_hf.backends.bnb_4bit.keep_reference_layout``), which is what
every CPU without these instructions runs. This script loads the model in NF4 twice, the stock way and with the
reference layout kept, and prints per layout the held-out NLL on text blocks, the largest logit difference
between the two and the time of one forward (1 thread by default). On a CPU without AVX512-BF16 the two layouts
are one and the script says so::

    python bench/cost/bnb_cpu_layout.py                        # SmolLM2-135M-Instruct, the shipped corpus sample
    python bench/cost/bnb_cpu_layout.py --model gemma3-270m --compute-dtype float32 --blocks 8

Figures are printed, never asserted; the median of ``--reps`` timed forwards is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="an offline alias or a BF16 checkpoint folder")
    ap.add_argument("--source", default=str(ROOT / "recipes" / "stress" / "corpus_sample"), help="text folder")
    ap.add_argument("--blocks", type=int, default=8, help="held-out blocks scored")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=5, help="timed forwards of one block per layout")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from gnmr_hf.backends.bnb_4bit import is_repacked, keep_reference_layout
    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.offline.text_data import blocks, text_files, token_stream

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    ids = blocks(token_stream(text_files(args.source), tok), args.block_size)[: args.blocks]
    if not ids:
        raise SystemExit(f"{args.source}: fewer than one block of {args.block_size} tokens")
    batch = torch.tensor([b["input_ids"] for b in ids])
    dtype = getattr(torch, args.compute_dtype)
    repacks = bool(bnb.functional.has_avx512bf16())
    print(f"model {args.model}, {len(ids)} blocks of {args.block_size} tokens, compute {args.compute_dtype}, "
          f"{args.threads} thread(s); bitsandbytes repacks 4-bit weights on this CPU: {repacks}")

    def load(reference: bool):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=q).eval()
        if reference:
            keep_reference_layout(model)
        return model

    rows, logits = {}, {}
    for name, reference in (("stock (as from_pretrained)", False), ("reference (gnmr_hf)", True)):
        model = load(reference)
        nll, n = 0.0, 0
        with torch.no_grad():
            outs = []
            for i in range(len(ids)):
                out = model(batch[i : i + 1], labels=batch[i : i + 1])
                nll += out.loss.item() * (batch.shape[1] - 1)
                n += batch.shape[1] - 1
                outs.append(out.logits.float())
            logits[name] = torch.cat(outs)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                model(batch[:1])
                times.append(time.perf_counter() - t0)
        four = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        rows[name] = (nll / n, statistics.median(times), sum(is_repacked(m) for m in four), len(four))
        del model
    a, b = logits.values()
    print(f"\n| layout | held-out NLL | forward of one block, s (median of {args.reps}) | 4-bit layers repacked |")
    print("|---|---|---|---|")
    for name, (nll, t, rep, total) in rows.items():
        print(f"| {name} | {nll:.4f} | {t:.3f} | {rep} / {total} |")
    print(f"\nlargest |logit difference| stock vs reference: {(a - b).abs().max().item():.4g}; "
          f"NLL difference {rows['stock (as from_pretrained)'][0] - rows['reference (gnmr_hf)'][0]:+.4f}")


if __name__ == "__main__":
    main()
