"""Which INT4 settings a W4A16 folder can take, and what each costs and keeps: group 32 / 64 / 128, symmetric or
asymmetric, every decoder linear quantised by compressed-tensors' own steps (``calculate_qparams`` on each group's
min / max, then ``fake_quantize``: the weights a folder of that scheme serves), scored on held-out text.

Rows, per model: BF16; for each group size and symmetry, the uniform W4A16 model's held-out NLL, the share of the
W4A16-to-BF16 gap it closes from the coarsest symmetric group that fits (g128, vLLM's preset; g64 where 128
does not divide every input), and the bytes its decoder linears take in the folder (4-bit codes
packed in int32, one BF16 scale per group, and for the asymmetric scheme one 4-bit zero point per group, packed as
compressed-tensors' pack-quantized format stores it; checked against a compressed folder of a tiny model), over
that reference's. Held-out: ``--heldout-blocks``
blocks of 256 tokens of the held-out files of Debian's python3.11-doc sources (every 20th file,
``gnmr_hf.offline.text_data.text_task``, as bench/value/serve_bench.py), FP32, one thread. Rows are written to
``--out`` as they finish and skipped on a rerun.

    python bench/serve/int4_settings.py --model smollm2-135m-instruct --out bench/results/int4_settings/smollm2.json
    python bench/serve/int4_settings.py --model gemma3-270m --out bench/results/int4_settings/gemma3.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "value"))

import serve_bench  # noqa: E402  (bench/value/serve_bench.py: spaced, heldout_loss, write_json, log)

SETTINGS = [(g, sym) for g in (128, 64, 32) for sym in (True, False)]


def linear_bytes(out_f: int, in_f: int, group: int, symmetric: bool) -> int:
    """A W4A16 linear's bytes in the folder: int32-packed codes, BF16 scales (out x groups), the asymmetric
    scheme's 4-bit zero points (out x groups, packed), the int64 weight_shape."""
    groups = in_f // group
    return out_f * in_f // 2 + 2 * out_f * groups + (0 if symmetric else out_f * groups // 2) + 16


def fake_quantize_linears(model, linears, originals, group: int, symmetric: bool) -> None:
    """Each decoder linear set to compressed-tensors' quantise-dequantise of its BF16 weight at this scheme."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for n in linears:
            w = originals[n]  # BF16
            rows, cols = w.shape
            x = w.reshape(rows, cols // group, group)
            scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
            mods[n].weight.copy_(fake_quantize(w, scale, zero, args).to(mods[n].weight.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--heldout-blocks", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--source", default=serve_bench.PYDOCS)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.offline.text_data import text_task
    from gnmr_hf.planning.groups import decoder_linears

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    doc["setting"] = {"model": Path(args.model).name, "heldout_blocks": args.heldout_blocks,
                      "block": serve_bench.BLOCK, "source": str(args.source)}
    doc["command"] = "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])
    base = Path(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(base)
    _, held, _ = text_task(args.source, tok, serve_bench.BLOCK)
    blocks = serve_bench.spaced(held, args.heldout_blocks)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    linears = decoder_linears(model)
    mods = dict(model.named_modules())
    originals = {n: mods[n].weight.detach().to(torch.bfloat16).clone() for n in linears}
    if "bf16" not in doc["rows"]:
        doc["rows"]["bf16"] = {"nll": serve_bench.heldout_loss(model, blocks, args.batch_size),
                               "linear_bytes": sum(2 * w.numel() for w in originals.values())}
        serve_bench.write_json(out, doc)
    for group, sym in SETTINGS:
        name = f"w4a16-g{group}-{'sym' if sym else 'asym'}"
        if name in doc["rows"]:
            continue
        if any(w.shape[1] % group for w in originals.values()):
            doc["rows"][name] = {"skipped": f"group {group} does not divide every decoder linear's input"}
            continue
        t0 = time.time()
        fake_quantize_linears(model, linears, originals, group, sym)
        nll = serve_bench.heldout_loss(model, blocks, args.batch_size)
        doc["rows"][name] = {"group": group, "symmetric": sym, "nll": nll, "seconds": round(time.time() - t0, 1),
                             "linear_bytes": sum(linear_bytes(*originals[n].shape, group, sym) for n in linears)}
        serve_bench.write_json(out, doc)
        serve_bench.log(f"{name}: NLL {nll:.4f}, decoder linears {doc['rows'][name]['linear_bytes']:,} B")
    # the reference: the coarsest symmetric group that fits (g128, vLLM's preset; g64 on SmolLM2's 576 inputs)
    ref_name = next(n for n in (f"w4a16-g{g}-sym" for g, _ in SETTINGS) if "nll" in doc["rows"].get(n, {}))
    ref, high = doc["rows"][ref_name], doc["rows"]["bf16"]
    doc["reference"] = ref_name
    for r in doc["rows"].values():
        if "nll" in r and ref["nll"] != high["nll"]:
            r["gap_closed"] = (ref["nll"] - r["nll"]) / (ref["nll"] - high["nll"])
            r["over_reference"] = r["linear_bytes"] / ref["linear_bytes"] - 1
    serve_bench.write_json(out, doc)
    print(table(doc))
    return 0


def table(doc) -> str:
    ref = doc.get("reference", "the reference")
    lines = [f"`{doc['command']}`", "", f"| setting | held-out NLL | gap closed (from {ref}) | decoder linears, bytes "
             f"| over {ref} |", "|---|---|---|---|---|"]
    for name, r in doc["rows"].items():
        if "nll" not in r:
            lines.append(f"| {name} | {r.get('skipped')} | | | |")
            continue
        lines.append(f"| {name} | {r['nll']:.4f} | {r.get('gap_closed', float('nan')):.3f} | {r['linear_bytes']:,} | "
                     f"{100 * r.get('over_reference', float('nan')):+.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
