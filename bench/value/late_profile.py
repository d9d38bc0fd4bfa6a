"""Does the profile rank the linears differently once the adapter has trained? The first-order profile at
initialisation (a qlora_budget folder's ``profile.json``: LoRA's B = 0) against the same profile taken with a
trained QLoRA adapter in place (``--adapter``: the ``nf4`` method's adapter, saved by ``qlora_budget.py run
--save-adapter``), on the same batches (the first ``--batches`` training batches).

For the plan of each profile at ``--pct`` % of the BF16 bytes (the product's planner, greedy by score per
byte) it prints the overlap, the rank correlation of the two profiles, the first-order gain each plan
predicts at the trained point, and the held-out loss of the trained NF4 adapter with that plan's linears
switched to BF16 after training (no retraining: which set matters at the trained point), beside all-NF4
(the table's ``nf4`` served loss, as a check) and all-BF16 (its merged loss), and a random set of the same
bytes (``rand-op``'s of seed 0). Writes ``late_profile.json`` in ``--out``.

    python bench/value/qlora_budget.py run --method nf4 --seed 0 --steps 90 --out bench/results/late_profile_smollm2_pydocs/nf4-run \\
        --root bench/results/qlora_smollm2_pydocs_90 --data-dir bench/results/qlora_smollm2_pydocs_90/data \\
        --save-adapter bench/results/late_profile_smollm2_pydocs/adapter
    python bench/value/late_profile.py --root bench/results/qlora_smollm2_pydocs_90 \\
        --adapter bench/results/late_profile_smollm2_pydocs/adapter --out bench/results/late_profile_smollm2_pydocs \\
        --write-profile      # ROOT/profile_late.json: qlora_budget.py's late-op-10 trains with that plan from step 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qlora_budget as qb  # noqa: E402  (bench/ is scripts: the bench's model, data and held-out loss)


def ranks(values: list[float]) -> list[float]:
    """Average ranks (1 = smallest; ties share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the average ranks."""
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="the qlora_budget folder: setting.json, profile.json, data/")
    p.add_argument("--adapter", required=True, help="the trained nf4 adapter (PEFT files)")
    p.add_argument("--out", required=True)
    p.add_argument("--pct", type=int, default=10)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write-profile", action="store_true",
                   help="also write the trained-point profile to ROOT/profile_late.json (qlora_budget's late-op plans)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    import gnmr_hf
    from gnmr_hf.planning import DEFAULT_CRITERION
    from gnmr_hf.units import resolve_units

    root, out = Path(args.root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init = json.loads((root / "profile.json").read_text())
    model, tokenizer, recipe, _ = qb.build(out / "profile_run", seed=0, steps=1, data_dir=root / "data",
                                           setting=qb.read_setting(root))
    state = load_file(str(Path(args.adapter) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise SystemExit(f"{args.adapter}: {len(result.unexpected_keys)} adapter tensors fit no LoRA module of the model")
    nonzero_b = sum(int(t.abs().sum() > 0) for k, t in state.items() if "lora_B" in k)
    if not nonzero_b:
        raise SystemExit(f"{args.adapter}: every lora_B is zero: not a trained adapter")
    units = resolve_units(model)
    names = [gnmr_hf.units.short_name(n) for n, _ in units]
    if [u["name"] for u in init["units"]] != names:
        raise SystemExit(f"{root / 'profile.json'} names other units than this model's")
    data = qb.profile_batches(recipe, tokenizer, out / "profile_run", args.batches)
    t0 = time.perf_counter()
    prof = gnmr_hf.profile_sensitivity(model, data, criteria=(DEFAULT_CRITERION,))
    seconds = time.perf_counter() - t0
    late = [float(s) for s in prof.scores(DEFAULT_CRITERION)]
    early = [u["score"] for u in init["units"]]
    ub = qb.unit_bytes_of(units)
    sets = {"init plan": qb.static_set("prof-op", args.pct, ub, early, 0),
            "late plan": qb.static_set("prof-op", args.pct, ub, late, 0),
            "random": qb.static_set("rand-op", args.pct, ub, None, 0)}
    test = qb.heldout_set(recipe, tokenizer, root / "data", args.eval_problems)
    model.eval()
    rows: dict[str, Any] = {}
    for label, chosen in [("all NF4", []), *sets.items(), ("all BF16", list(range(len(units))))]:
        gnmr_hf.set_active_units(model, chosen, units)
        rows[label] = {"units": len(chosen), "bytes": sum(ub[i] for i in chosen),
                       "late_gain": sum(late[i] for i in chosen), "init_gain": sum(early[i] for i in chosen),
                       "heldout_loss": qb.heldout_loss(model, tokenizer, test, recipe.script)}
    lo, hi = rows["all NF4"]["heldout_loss"], rows["all BF16"]["heldout_loss"]
    for r in rows.values():
        r["gap_closed"] = (lo - r["heldout_loss"]) / (lo - hi) if lo != hi else None
    a, b = set(sets["init plan"]), set(sets["late plan"])
    record = {"root": str(root), "adapter": str(args.adapter), "pct": args.pct, "batches": args.batches,
              "profile_seconds": round(seconds, 1), "spearman": spearman(early, late),
              "overlap_units": len(a & b), "overlap_bytes_share": sum(ub[i] for i in a & b) / max(1, sum(ub[i] for i in a)),
              "late_losses": {k: prof.losses[k] for k in ("low", "high")}, "rows": rows,
              "sets": {k: [names[i] for i in v] for k, v in sets.items()},
              "late_scores": [{"name": n, "score": s} for n, s in zip(names, late)]}
    if args.write_profile:  # profile.json's layout, so that qlora_budget's late-op plans read it as prof-op reads that
        late_profile = {"criterion": DEFAULT_CRITERION, "batches": args.batches, "seconds": round(seconds, 1),
                        "adapter": str(args.adapter), "losses": record["late_losses"],
                        "units": [{"name": n, "bytes": int(b), "score": s} for n, b, s in zip(names, ub, late)]}
        tmp = root / ".profile_late.json.tmp"
        tmp.write_text(json.dumps(late_profile, indent=1) + "\n")
        os.replace(tmp, qb.late_path(root))
    tmp = out / ".late_profile.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, out / "late_profile.json")
    print(f"Spearman (init vs trained-point profile, {len(names)} linears): {record['spearman']:.3f}; the {args.pct} % "
          f"plans share {len(a & b)} of {len(a)} / {len(b)} linears ({100 * record['overlap_bytes_share']:.0f} % of the "
          f"init plan's bytes)")
    print("| set | linears | first-order gain at init | at the trained point | held-out loss | gap closed |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        gc = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.2f}"
        print(f"| {label} | {r['units']} | {r['init_gain']:.4f} | {r['late_gain']:.4f} | {r['heldout_loss']:.4f} | {gc} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
