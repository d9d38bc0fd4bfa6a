"""What a registered criterion costs on the ladder's rungs (SmolLM2-135M-Instruct, NF4, INT8 + BF16 rungs).

``make_plan(model, batches, budget, ("int8", "bf16"), criterion=C)`` runs criterion ``C`` once per rung, the
rung's weight standing in for the high path (gnmr_hf/planning/rung_criteria.py); the default (no criterion) is
the ladder's first-order rung gains on a stock-loaded NF4 model. This times :func:`gnmr_hf.planning.make.plan_gains`
for each criterion asked for on the same batches (the ``nf4`` SmolLM2 recipe's training data, as ``gnmr-hf
profile`` reads it), counts the decoder forwards it ran, and records the plan each chooses at ``--budget``
(how many linears on INT8 and on BF16, and how many rungs it shares with the default plan).

The model: NF4 with FP32 compute, one dual-path unit per linear (210), recovery path the checkpoint's BF16 values
in FP32, as ``gnmr-hf profile`` loads it. Resumable: each criterion's row is kept in ``--out`` and skipped when
present. One torch thread (a shared 2-core machine)::

    OMP_NUM_THREADS=1 python bench/cost/rung_criteria.py --out bench/results/rung_criteria/smollm2.json \\
        --criteria default output weight_error loss --batches 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def load(batches: int):
    import torch
    from transformers import AutoTokenizer

    from gnmr_hf.offline.smollm2 import smollm2_checkpoint
    from gnmr_hf.planning import cli as P
    from gnmr_hf.planning.profile_run import load_dual

    path = Path(smollm2_checkpoint())
    model = load_dual(argparse.Namespace(low="nf4", storage="host"), path, torch.float32).eval()
    work = Path(tempfile.mkdtemp(prefix="rung_criteria_"))  # the generated data files, not results
    recipe = P._load_recipe(argparse.Namespace(recipe=None, low="nf4", data=None, max_seq_len=None,
                                                    model="smollm2-135m-instruct"), work, work)
    tok = AutoTokenizer.from_pretrained(path)
    data = P._record_batches(recipe, tok, batches, recipe.training.per_device_train_batch_size, work)
    return model, data, path


def measure(model, data, path, criterion: str | None, budget: str) -> dict:
    import torch

    from gnmr_hf.planning.make import make_plan, plan_gains, plan_prices
    from gnmr_hf.units import unwrap_model

    prices = plan_prices(model, ("int8", "bf16"), "nf4", path)
    forwards = [0]
    handle = unwrap_model(model).get_decoder().register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        gains = plan_gains(model, data, prices, criterion, model_path=path, dtype=torch.float32)
    finally:
        handle.remove()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    plan = make_plan(model, data, budget, ("int8", "bf16"), prices=prices, gains=gains)
    return {"criterion": criterion or "default (first_order rung gains)", "cpu_seconds": cpu, "wall_seconds": wall,
            "model_forwards": forwards[0], "batches": len(data), "tokens": gains.tokens, "budget": budget,
            "int8": sum(r == "int8" for r in plan.rungs.values()), "bf16": sum(r == "bf16" for r in plan.rungs.values()),
            "rungs": plan.rungs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="the results file (JSON; rows kept and skipped on resume)")
    ap.add_argument("--criteria", nargs="+", default=["default", "output", "weight_error", "loss"],
                    help="criteria to time ('default': the ladder's first-order rung gains)")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--budget", default="+10%nf4")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = json.loads(args.out.read_text()) if args.out.exists() else {}
    todo = [c for c in args.criteria if c not in rows]
    if todo:
        model, data, path = load(args.batches)
        for c in todo:
            rows[c] = measure(model, data, path, None if c == "default" else c, args.budget)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
            print(json.dumps({k: v for k, v in rows[c].items() if k != "rungs"}), flush=True)
    default = rows.get("default", {}).get("rungs")
    print("| criterion | batches | CPU s | wall s | model forwards | INT8 | BF16 | rungs shared with the default |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        shared = "-" if default is None else sum(default.get(n) == v for n, v in r["rungs"].items())
        print(f"| {r['criterion']} | {r['batches']} | {r['cpu_seconds']:.1f} | {r['wall_seconds']:.1f} | "
              f"{r['model_forwards']} | {r['int8']} | {r['bf16']} | {shared} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
