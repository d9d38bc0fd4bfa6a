"""LoftQ at initialisation, before any training: held-out loss on both routes for the stock QLoRA init,
PEFT's one-shot LoftQ (gnmr_hf.loftq) and LoftQ with PEFT's documented rollback callback (a linear's
replacement is kept only if the logits on a probe block move closer to the BF16 model's).

Run on a bench folder that holds a setting and its data (bench/value/qlora_budget.py plan made it)::

    python bench/value/loftq_init.py --out bench/results/qlora_gemma_pydocs --blocks 16

Prints one JSON object; ``--json F`` also writes it to F. The probe block is the held-out block after the
``--blocks`` scored ones, so the callback never sees a scored block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "recipes")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a bench/value/qlora_budget.py results folder (setting.json, data/)")
    ap.add_argument("--blocks", type=int, default=16, help="held-out blocks scored")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import tempfile

    import qlora_budget as qb

    from gnmr_hf.backends.base import set_active_units
    from gnmr_hf.loftq import replace_lora_weights_loftq
    from gnmr_hf.units import resolve_units

    root = Path(args.out)
    setting = qb.read_setting(root)
    scratch = Path(tempfile.mkdtemp(prefix="loftq_init_"))  # the recipe copy build() writes; not a result

    def fresh():
        model, tok, recipe, path = qb.build(scratch, 0, 30, root / "data", setting=setting)
        model.eval()
        return model, tok, recipe, path

    model, tok, recipe, path = fresh()
    units = resolve_units(model)  # re-resolved after every fresh(): units hold the model's own modules
    everything = list(range(len(units)))
    held = qb.heldout_set(recipe, tok, root / "data", args.blocks + 1)
    if len(held) <= args.blocks:
        raise SystemExit(f"{root} holds {len(held)} held-out blocks; --blocks must leave one for the probe")
    test, probe = held[:args.blocks], torch.tensor([held[args.blocks]["input_ids"]])

    def routes(tag: str) -> dict[str, float]:
        set_active_units(model, [], units)  # served: the all-NF4 base the adapter starts on
        served = qb.heldout_loss(model, tok, test, recipe.script)
        set_active_units(model, everything, units)  # merged: the same adapter on the BF16 base
        merged = qb.heldout_loss(model, tok, test, recipe.script)
        set_active_units(model, [], units)
        print(f"{tag}: served {served:.4f}, merged {merged:.4f}", file=sys.stderr, flush=True)
        return {f"{tag}_served": served, f"{tag}_merged": merged}

    res: dict[str, float | int | str] = {"out": str(root), "blocks": args.blocks}
    res.update(routes("stock"))
    replace_lora_weights_loftq(model, path, skip=[])
    res.update(routes("loftq"))

    model, tok, recipe, path = fresh()  # the callback's run starts from the stock init again
    units = resolve_units(model)
    with torch.no_grad():
        set_active_units(model, everything, units)
        ref = model(input_ids=probe).logits.float()
        set_active_units(model, [], units)

    def logits_error() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(input_ids=probe).logits.float(), ref))

    state = {"best": logits_error(), "kept": 0, "seen": 0}

    def keep_if_closer(_model, _name) -> bool:  # PEFT's callback signature
        err = logits_error()
        state["seen"] += 1
        if err < state["best"]:
            state["best"], state["kept"] = err, state["kept"] + 1
            return True
        return False  # PEFT rolls this linear's pair back

    replace_lora_weights_loftq(model, path, skip=[], callback=keep_if_closer)
    res.update(routes("loftq_callback"))
    res.update({"callback_kept": state["kept"], "callback_seen": state["seen"]})
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
