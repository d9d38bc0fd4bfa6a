"""How much of each linear's NF4 error a rank-r LoRA could hold: the share of ``||W - W_nf4||_F^2`` in the
top ``r`` singular directions of the error, per projection type, and its median over the linears a
qlora_budget run kept off NF4 (its ``planned`` set, or a ladder run's ``rungs``).

A share near ``r / min(rows, cols)`` means the error is noise-like and the adapter of the same linear can hold
little of it in weight space; a share near 1, that LoRA on that linear could absorb it as training goes on.
``W_nf4`` is bitsandbytes' NF4 (block 64, no double quantisation) of the BF16 checkpoint, de-quantised.

    python bench/value/nf4_error_rank.py --model gemma3-270m --runs bench/results/qlora_gemma_pydocs_90
    python bench/value/nf4_error_rank.py --model smollm2-135m-instruct --runs bench/results/qlora_smollm2_pydocs_90
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def error_shares(model_path: str | Path, rank: int) -> dict[str, float]:
    """``{"layers.3.self_attn.v_proj": share}`` for every decoder projection of the checkpoint."""
    import bitsandbytes.functional as F
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if ".layers." not in k or not k.endswith("proj.weight"):
                    continue
                w = fh.get_tensor(k).to(torch.bfloat16)
                q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
                s = torch.linalg.svdvals(w.float() - F.dequantize_4bit(q, state).float()) ** 2
                out["layers." + k.split(".layers.", 1)[1][: -len(".weight")]] = float(s[:rank].sum() / s.sum())
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from gnmr_hf.offline.gguf_models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder or an offline alias (gemma3-270m, ...)")
    p.add_argument("--runs", help="a qlora_budget results folder: the kept sets of its seed-0 runs")
    p.add_argument("--rank", type=int, default=8, help="the LoRA rank (the recipes' lora_r)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shares = error_shares(resolve_model(args.model), args.rank)
    by_op: dict[str, list[float]] = {}
    for name, v in shares.items():
        by_op.setdefault(name.rsplit(".", 1)[1], []).append(v)
    print(f"share of the NF4 error's energy in its top {args.rank} singular directions, median over the linears")
    print("| set | linears | median share |\n|---|---|---|")
    print(f"| all | {len(shares)} | {statistics.median(shares.values()):.3f} |")
    for op, vals in sorted(by_op.items()):
        print(f"| every {op} | {len(vals)} | {statistics.median(vals):.3f} |")
    for path in sorted(Path(args.runs).glob("*/seed0/result.json")) if args.runs else []:
        r = json.loads(path.read_text())
        names = list(r["rungs"]) if r.get("rungs") else r.get("planned") or []
        vals = [shares["layers." + n.split("layers.", 1)[1]] for n in names]
        if vals and len(vals) < len(shares):
            print(f"| {r['method']} (seed 0) | {len(vals)} | {statistics.median(vals):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
