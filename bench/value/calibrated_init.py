"""Forward-only probe of LoRA initialisations before any training: the held-out loss of the served model
(NF4, plus a precision-ladder plan's linears on their INT8 / BF16 rungs) with the adapter at each init, and the
share of the NF4-to-BF16 gap it closes, gap closed = (L_NF4 - L) / (L_NF4 - L_BF16) on the held-out blocks.

Inits: ``zero`` (PEFT's default, B = 0: the base itself), ``loftq`` (the rank-r SVD of each NF4 linear's weight
error, gnmr_hf.loftq) and ``calibrated`` (the closed-form output-error init on the profile's batches,
gnmr_hf.calibrated_init, CLoQ / QERA-exact). A plan's linears (on INT8 / BF16) keep the zero init. Budgets:
``0`` (all NF4) and the ladder plans (``lad``) at +5 / +10 % memory over NF4 from the folder's
profile_ladder.json. Run on a bench folder that holds a setting and its ladder profile
(bench/value/qlora_budget.py plan made it)::

    python bench/value/calibrated_init.py --out bench/results/qlora_smollm2_pydocs --blocks 16 \\
        --json bench/results/calibrated_init/smollm2_pydocs.json

Prints a table (init x budget) and one JSON object; ``--json F`` also writes it to F. ``--merged`` also scores
the same adapter on the all-BF16 base (the merged route).
"""

# ruff: noqa: B023  (served/merged/reset close over the budget loop's model and plan and run within that iteration)
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "recipes")]

INITS = ("zero", "loftq", "calibrated")
#: named explicitly (``--inits ...,calibrated-rp``): the calibrated init with the adapter's rank where the error
#: is (gnmr_hf.calibrated_init.allocate_ranks), at the uniform adapter's parameters; scored on a model built with
#: twice the rank whose unused terms stay zero (the forward of PEFT's rank_pattern adapter)
RANKED = "calibrated-rp"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a bench/value/qlora_budget.py results folder (setting.json, "
                    "profile_ladder.json)")
    ap.add_argument("--blocks", type=int, default=16, help="held-out blocks scored")
    ap.add_argument("--budgets", default="0,5,10", help="%% memory over NF4 (0: all NF4; else the ladder plan)")
    ap.add_argument("--inits", default=",".join(INITS))
    ap.add_argument("--calib-batches", type=int, default=0,
                    help="training batches to calibrate on (0: profile_ladder.json's, the profile's own batches)")
    ap.add_argument("--damp", type=float, default=None, help="H's damping (default gnmr_hf.calibrated_init's)")
    ap.add_argument("--min-rank", type=int, default=1, help=f"{RANKED}: the least rank a linear keeps")
    ap.add_argument("--merged", action="store_true", help="also score each adapter on the all-BF16 base")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    command = "python bench/value/calibrated_init.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    import torch

    torch.set_num_threads(args.threads)
    import tempfile

    import qlora_budget as qb

    import gnmr_hf
    from gnmr_hf.backends.base import set_active_units
    from gnmr_hf.calibrated_init import DEFAULT_DAMP, allocate_ranks, calibrated_lora_init, error_spectra
    from gnmr_hf.loftq import replace_lora_weights_loftq
    from gnmr_hf.units import resolve_units, short_name

    root = Path(args.out)
    setting = qb.read_setting(root)
    ladder = json.loads(qb.ladder_path(root).read_text())
    n_calib = args.calib_batches or int(ladder["batches"])
    damp = DEFAULT_DAMP if args.damp is None else args.damp
    inits = [i for i in args.inits.split(",") if i]
    budgets = [int(b) for b in args.budgets.split(",") if b != ""]
    scratch = Path(tempfile.mkdtemp(prefix="calibrated_init_"))  # the recipe copy build() writes; not a result

    res: dict = {"out": str(root), "setting": setting, "blocks": args.blocks, "calib_batches": n_calib,
                 "damp": damp, "command": command, "rows": []}
    test = calib = None
    ref: dict[str, float] = {}
    for pct in budgets:
        rungs = qb.ladder_plan("lad", pct, ladder) if pct else None
        model, tok, recipe, path = build(qb, scratch, root, rungs, setting, RANKED in inits, args.min_rank)
        model.eval()
        units = resolve_units(model)
        everything = list(range(len(units)))
        if test is None:
            test = qb.heldout_set(recipe, tok, root / "data", args.blocks)
            calib = qb.profile_batches(recipe, tok, scratch, n_calib)
            res["calib_tokens"] = int(sum(int(b["attention_mask"].sum()) for b in calib))
            half = 2 if RANKED in inits else 1  # the recipe's rank (build doubled it for the ranked init)
            res["lora"] = {"r": recipe.lora.lora_r // half, "alpha": recipe.lora.lora_alpha / half}
        plain = qb._plain_names(qb._meta_model(model), units)
        planned = [i for i, n in enumerate(plain) if rungs and n in rungs]
        skip = [units[u][0] for u in planned]
        int8 = {n: r for n, r in (rungs or {}).items() if r == "int8"}

        def served() -> float:
            set_active_units(model, planned, units)
            return qb.heldout_loss(model, tok, test, recipe.script)

        def merged() -> float:
            if int8:
                gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host", units="linears",
                                          dtype=torch.float32, rungs=None)
            set_active_units(model, everything, units)
            loss = qb.heldout_loss(model, tok, test, recipe.script)
            if int8:
                gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host", units="linears",
                                          dtype=torch.float32, rungs=rungs)
            set_active_units(model, planned, units)
            return loss

        pairs = {n: (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
                 for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}

        def reset() -> None:
            with torch.no_grad():
                for n, m in model.named_modules():
                    if n in pairs:
                        m.lora_A["default"].weight.copy_(pairs[n][0])
                        m.lora_B["default"].weight.copy_(pairs[n][1])

        if pct == 0 and not ref:
            set_active_units(model, [], units)
            ref["nf4"] = qb.heldout_loss(model, tok, test, recipe.script)
            set_active_units(model, everything, units)
            ref["bf16"] = qb.heldout_loss(model, tok, test, recipe.script)
            set_active_units(model, [], units)
            res["loss_nf4"], res["loss_bf16"] = ref["nf4"], ref["bf16"]
            print(f"L_NF4 {ref['nf4']:.4f}, L_BF16 {ref['bf16']:.4f}", file=sys.stderr, flush=True)
        for init in inits:
            reset()
            t0 = time.perf_counter()
            row: dict = {"budget_pct": pct, "init": init, "rungs": {r: sum(1 for v in (rungs or {}).values() if v == r)
                                                                    for r in ("int8", "bf16")}}
            if init == "loftq":
                replace_lora_weights_loftq(model, path, skip=skip, progress=False)
            elif init in ("calibrated", RANKED):
                set_active_units(model, planned, units)  # calibrated on the served model's inputs
                ranks = None
                if RANKED in inits:  # the model holds 2r per pair: the uniform init uses r of them
                    r = recipe.lora.lora_r // 2
                    if init == RANKED:
                        spec = error_spectra(model, calib, path, skip=skip, damp=damp)
                        ranks = allocate_ranks(spec["spectra"], spec["shapes"], r, min_rank=args.min_rank)
                        row["ranks"] = {"min": min(ranks.values()), "max": max(ranks.values()),
                                        "params": sum(k * sum(spec["shapes"][n]) for n, k in ranks.items()),
                                        "uniform_params": sum(r * sum(v) for v in spec["shapes"].values())}
                    else:
                        ranks = {short_name(n): r for n, m in model.named_modules() if hasattr(m, "lora_A")}
                summary = calibrated_lora_init(model, calib, path, skip=skip, damp=damp, ranks=ranks)
                row["output_error"] = summary["output_error"]
                row["linears"] = summary["linears"]
            row["init_seconds"] = round(time.perf_counter() - t0, 1)
            row["loss_served"] = served()
            if args.merged:
                row["loss_merged"] = merged()
            print(json.dumps({k: v for k, v in row.items() if k != "output_error"}), file=sys.stderr, flush=True)
            res["rows"].append(row)
        model = None  # free this budget's model before the next loads
    if ref:
        gap = ref["nf4"] - ref["bf16"]
        for row in res["rows"]:
            row["gap_closed_served"] = (ref["nf4"] - row["loss_served"]) / gap
            if "loss_merged" in row:
                row["gap_closed_merged"] = (ref["nf4"] - row["loss_merged"]) / gap
    print(table(res))
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def build(qb, scratch: Path, root: Path, rungs, setting, double_rank: bool, min_rank: int):
    """``qb.build``'s model; with ``double_rank`` the LoRA pairs hold twice the recipe's rank (alpha twice too,
    so the scaling is the recipe's), for the ranked init to move rank between linears."""
    if not double_rank:
        return qb.build(scratch, 0, 30, root / "data", rungs=rungs, setting=setting)
    import finetune
    import torch

    import gnmr_hf

    recipe, tokenizer, path = qb.load_recipe(scratch, 0, 30, root / "data", "float32", setting)
    if min_rank > recipe.lora.lora_r:
        raise SystemExit(f"--min-rank {min_rank} above the recipe's rank {recipe.lora.lora_r}")
    recipe.lora.lora_r *= 2
    recipe.lora.lora_alpha *= 2
    model = finetune.load_model(recipe, path)
    gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host", units="linears",
                              dtype=torch.float32, rungs=rungs)
    return model, tokenizer, recipe, path


def table(res: dict) -> str:
    """The init x budget table in markdown (held-out loss and gap closed, served; merged when scored)."""
    merged = any("loss_merged" in r for r in res["rows"])
    head = "| budget over NF4 | INT8 / BF16 linears | init | loss served | gap closed served |"
    head += " loss merged | gap closed merged |" if merged else ""
    lines = [f"`{res['command']}` (L_NF4 {res.get('loss_nf4', float('nan')):.4f}, "
             f"L_BF16 {res.get('loss_bf16', float('nan')):.4f}, {res['blocks']} held-out blocks, calibrated on "
             f"{res.get('calib_tokens', '?')} tokens)", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in res["rows"]:
        line = (f"| +{r['budget_pct']} % | {r['rungs']['int8']} / {r['rungs']['bf16']} | {r['init']} | "
                f"{r['loss_served']:.4f} | {r.get('gap_closed_served', float('nan')):.2f} |")
        if merged:
            line += f" {r.get('loss_merged', float('nan')):.4f} | {r.get('gap_closed_merged', float('nan')):.2f} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
