"""Plans for a GGUF file profiled against the GGUF quantisers themselves (``gnmr-hf profile --serve gguf``'s
planner, :mod:`gnmr_hf.planning.gguf_plan`), written for bench/serve/gguf_llamacpp.py to export and score.

On the same profile blocks as bench/value/serve_bench.py (``--profile-blocks`` training blocks of Debian's
python3.11-doc sources spaced evenly, 256 tokens, ``gnmr_hf.offline.text_data.text_task``): each decoder
linear's first-order gain on Q8_0 and BF16 against the uniform ``--low`` file (:func:`gguf_rung_gains`, the
gradient at the uniform low point, FP32, one thread), the budget ``--over`` (+10 %) of the uniform low file's
tensor bytes (:func:`gguf_model_bytes`), and ``choose_rungs(..., fill=True)`` linear by linear (llama.cpp fuses
nothing); ``random-S`` rows draw the same rungs at random within the same budget (bench/value/serve_bench.py's
``random_rungs``, seeds ``--seeds``). Writes ``--out`` (JSON): ``{"rungs": {"gguf-planned": ..., "gguf-random-0":
...}, "budget_bytes", "uniform_tensor_bytes", "predicted_gain", "price_bytes", "units", "setting", "command"}``,
the shape ``gguf_llamacpp.py export --serve-plans`` reads; an existing file is kept (delete it to plan again).

    python bench/serve/gguf_plan.py --model smollm2-135m-instruct --out bench/results/gguf/smollm2_gguf_plans.json
    python bench/serve/gguf_llamacpp.py export --model smollm2-135m-instruct --work /tmp/gguf_bench \\
        --uniform Q4_0 --serve-plans bench/results/gguf/smollm2_gguf_plans.json
    python bench/serve/gguf_llamacpp.py score --model smollm2-135m-instruct --work /tmp/gguf_bench \\
        --out bench/results/gguf/smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "value"))

import serve_bench  # noqa: E402  (bench/value/serve_bench.py: spaced, batches, random_rungs, write_json)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="offline alias or BF16 model folder")
    p.add_argument("--low", default="q4_0", help="the GGUF low (q4_0, q4_1, q5_0, q5_1)")
    p.add_argument("--over", type=float, default=0.10, help="the budget: this fraction over the uniform low file")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--profile-blocks", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--source", default=serve_bench.PYDOCS)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.is_file():
        serve_bench.log(f"{out}: there already (delete it to plan again)")
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.offline.text_data import text_task
    from gnmr_hf.planning.gguf_plan import GGUF_LOWS, gguf_model_bytes, gguf_rung_gains
    from gnmr_hf.planning.groups import decoder_linears
    from gnmr_hf.planning.ladder import choose_rungs, plan_gain

    if args.low not in GGUF_LOWS:
        p.error(f"--low {args.low}: one of {', '.join(GGUF_LOWS)}")
    torch.set_num_threads(args.threads)
    base = Path(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(base)
    train, _, _ = text_task(args.source, tok, serve_bench.BLOCK)
    prof_blocks = serve_bench.spaced(train, args.profile_blocks)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    linears = decoder_linears(model)
    uniform = gguf_model_bytes(model, linears, {}, args.low)
    budget = int(args.over * uniform)
    serve_bench.log(f"{args.model}: gains against {GGUF_LOWS[args.low]} on {len(prof_blocks)} blocks")
    t0 = time.time()
    units = gguf_rung_gains(model, list(serve_bench.batches(prof_blocks, args.batch_size)), args.low, linears)
    seconds = time.time() - t0
    rungs = {"gguf-planned": choose_rungs(units, budget, ("int8", "bf16"), fill=True)}
    for s in args.seeds:
        rungs[f"gguf-random-{s}"] = serve_bench.random_rungs(units, budget, s)
    by = {u.name: u for u in units}
    doc = {"setting": {"model": Path(args.model).name, "low": args.low, "over": args.over,
                       "profile_blocks": args.profile_blocks, "block": serve_bench.BLOCK, "source": str(args.source),
                       "seeds": args.seeds},
           "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
           "budget_bytes": budget, "uniform_tensor_bytes": uniform, "gains_seconds": round(seconds),
           "rungs": rungs,
           "price_bytes": {k: sum(by[n].prices[r] for n, r in v.items()) for k, v in rungs.items()},
           "predicted_gain": {k: plan_gain(units, v)[0] for k, v in rungs.items()},
           "units": [{"name": u.name, "gains": u.gains, "prices": u.prices} for u in units]}
    out.parent.mkdir(parents=True, exist_ok=True)
    serve_bench.write_json(out, doc)
    for k, v in rungs.items():
        counts = {r: sum(x == r for x in v.values()) for r in ("int8", "bf16")}
        serve_bench.log(f"{k}: {counts}, {doc['price_bytes'][k]:,} B over {budget:,} budget, predicted gain "
                        f"{doc['predicted_gain'][k]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
