"""``gnmr-hf profile --low int4``: the ladder planned against the compressed-tensors export's own INT4 quantiser.

The BF16 model is loaded without a quantiser; :func:`gnmr_hf.planning.make.make_plan` chooses every plan (the
rungs' first-order gains against uniform W4A16, :func:`gnmr_hf.planning.int4.ct_rung_gains`, priced in the
folder's bytes over uniform W4A16, whole vLLM serving groups unless ``--groups none``), and every plan is
measured inside that one loaded model with the export's quantiser applied to its weights in torch (the served
weights, bit-exact): no plan reloads the model."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.planning.criteria import _criteria
from gnmr_hf.planning.groups import split_groups
from gnmr_hf.planning.int4 import _largest_group, int4_fake_quant, int8_fake_quant
from gnmr_hf.planning.ladder import _loss
from gnmr_hf.planning.make import layout_of, make_plan, plan_budget, plan_gains, plan_prices
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.profile_run import ProfileError, examples, noise_floor
from gnmr_hf.planning.profiler import model_identity

#: --low int4's price points: memory over the uniform W4A16 folder
INT4_POINTS = (0.05, 0.10, 0.25)


def _rungs(args: argparse.Namespace) -> tuple[str, ...]:
    """The rungs the plans may buy: ``--serve``'s target's (vllm-cpu: BF16 only), else INT8 and BF16."""
    return getattr(args, "serve_rungs", None) or ("int8", "bf16")


def _load_bf16(args: argparse.Namespace, model_path: Path, dtype, gs: int):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(f"[profile] loading {model_path} in {str(dtype).replace('torch.', '')} (no quantiser: the low path is the "
          f"compressed-tensors export's INT4, group {gs}, simulated in torch) ...", flush=True)
    bars = hf_logging.is_progress_bar_enabled()
    if args.quiet:
        hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar
    try:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    finally:
        if bars and args.quiet:
            hf_logging.enable_progress_bar()


class _Swapper:
    """Every plan measured inside the one loaded model: the decoder linears' weights set to what the folder a
    plan describes serves (BF16, the export's INT8 or its INT4), from one BF16 copy of the originals."""

    def __init__(self, model, linears: list[str], gs: int, batches, heldout):
        self.mods = dict(model.named_modules())
        self.model, self.linears, self.gs = model, linears, gs
        self.batches, self.heldout = batches, heldout
        self.originals = {n: self.mods[n].weight.detach().to(torch.bfloat16).clone() for n in linears}

    def loss(self, rungs: dict[str, str]) -> dict[str, float]:
        with torch.no_grad():
            for n in self.linears:
                r, w, o = rungs.get(n, "low"), self.mods[n].weight, self.originals[n]
                q = o if r == "bf16" else int8_fake_quant(o) if r == "int8" else int4_fake_quant(o, self.gs)
                w.copy_(q.to(w.dtype))
        out = {"profile": _loss(self.model, self.batches)}
        if self.heldout:
            out["heldout"] = _loss(self.model, self.heldout)
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for n in self.linears:
                self.mods[n].weight.copy_(self.originals[n].to(self.mods[n].weight.dtype))
        self.originals.clear()


def _check_group_size(model, linears: list[str], gs: int) -> None:
    mods = dict(model.named_modules())
    short = [n for n in linears if mods[n].in_features % gs]
    if short:
        g = _largest_group([mods[n].in_features for n in linears], gs)
        fix = f"use --group-size {g}" if g else "no power-of-two group of at least 16 divides them all"
        raise ProfileError(f"--group-size {gs} does not divide the input size of {short[0]} "
                           f"({mods[short[0]].in_features}): {fix}")


def _budget(args: argparse.Namespace, prices, layout) -> int:
    """``--budget`` in the folder's bytes over uniform W4A16, refused in one line before the profile."""
    all_bf16 = sum(p["bf16"] for p in prices.prices.values())
    try:
        return plan_budget(args.budget, prices, layout=layout)
    except PlanError as e:
        what = "serving group" if layout is not None else "linear"
        if "buys no unit" in str(e):
            raise ProfileError(f"--budget {args.budget} buys nothing: the cheapest {what} costs more on INT8 over "
                               f"uniform W4A16 ({e})") from None
        if "exceeds what there is to keep" in str(e):
            raise ProfileError(f"--budget {args.budget} is more than every decoder linear on BF16 costs over uniform "
                               f"W4A16 ({all_bf16} B): give a smaller budget") from None
        raise ProfileError(f"--budget {args.budget}: {e}") from None


def run_int4(args: argparse.Namespace, model_path: Path, batches, heldout, dtype, out: Path, started: float) -> int:
    """See the module docstring."""
    criteria = _criteria(getattr(args, "criterion", None) or "first_order")
    gs = 128 if args.group_size is None else args.group_size
    model = _load_bf16(args, model_path, dtype, gs)
    prices = plan_prices(model, ("int8", "bf16"), "int4", group_size=gs)
    _check_group_size(model, prices.linears, gs)
    want_groups = args.groups != "none"  # unset: vLLM's groups, the export's default target
    try:
        layout, no_layout = layout_of(model, "vllm", prices), None
    except PlanError as e:
        if want_groups:
            how = "--groups vllm" if args.groups else "--low int4 plans whole vLLM serving groups by default"
            raise ProfileError(f"{how}: {str(e).removeprefix('groups vllm: ')}; --groups none plans linear by linear "
                               "(export it with --target transformers)") from None
        layout, no_layout = None, str(e)
    budget = _budget(args, prices, layout if want_groups else None)
    device = next(model.parameters()).device

    def on(bs):
        return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in bs]

    profile_b, heldout_b = on(batches), on(heldout)
    t0 = time.time()
    # the first --criterion plans (first_order, the default: the rungs' first-order gains; another registered
    # criterion runs once per rung, the rung's weight as its high path: gnmr_hf.planning.rung_criteria)
    gains = plan_gains(model, profile_b, prices, criteria[0], progress=not args.quiet)
    print(f"[profile] rung gains ({gains.criterion}) against INT4 (group {gs}) on {len(batches)} batch(es) in "
          f"{time.time() - t0:.0f} s", flush=True)
    swap = _Swapper(model, prices.linears, gs, profile_b, heldout_b)
    try:
        rows, low, high = _rows(args, model, prices, gains, swap, budget, layout)
    finally:
        swap.restore()
    kind = "grouped" if layout is not None and want_groups else "free"
    main_row = next(r for r in rows if r["budget_bytes"] == budget and r["kind"] == kind)
    _print(rows, prices.low_model_bytes, gs, low, high, len(batches), layout, examples(batches)[1],
           examples(heldout)[1] if heldout else 0)
    if layout is None:
        print(f"\n[profile] no grouped plans: {no_layout}")
    _write(args, out, model_path, model, prices, gains, rows, main_row, kind, budget, low, high, batches, heldout,
           dtype, started)
    return 0


def _rows(args, model, prices, gains, swap: _Swapper, budget: int, layout) -> tuple[list[dict[str, Any]], dict, dict]:
    """Each budget's free and grouped plans (make_plan), measured by swapping weights in the one model."""
    from tqdm.auto import tqdm

    w4a16 = prices.low_model_bytes
    low, high = swap.loss({}), swap.loss(dict.fromkeys(prices.linears, "bf16"))
    budgets = sorted({budget} | {int(f * w4a16) for f in INT4_POINTS})
    kinds = ("free", "grouped") if layout is not None else ("free",)
    rows = []
    for b in tqdm([(b, k) for b in budgets for k in kinds], desc="plans", disable=args.quiet):
        b, kind = b
        try:
            plan = make_plan(model, swap.batches, b, _rungs(args), "vllm" if kind == "grouped" else None,
                             low="int4", group_size=prices.group_size, prices=prices, gains=gains, budget_text=args.budget
                             if b == budget else f"+{100 * b / w4a16:g}%int4")
        except PlanError:  # a price point that buys nothing or exceeds the total on this model
            continue
        chosen = plan.rungs
        loss = swap.loss(chosen)
        rows.append({"memory_over_w4a16": b / w4a16, "budget_bytes": b, "kind": kind,
                     "int8": sum(r == "int8" for r in chosen.values()), "bf16": sum(r == "bf16" for r in chosen.values()),
                     "price_bytes": plan.price_bytes, "predicted_gain": plan.chosen_by["predicted_gain"], "loss": loss,
                     "gap_closed": {k: (low[k] - v) / (low[k] - high[k]) if low[k] != high[k] else None
                                    for k, v in loss.items()},
                     "split_groups": len(split_groups(chosen, layout)) if layout is not None else None,
                     "rungs": chosen})
    return rows, low, high


def _print(rows, w4a16: int, gs: int, low, high, n_batches: int, layout, tokens: int, heldout_tokens: int) -> None:
    floors = {"profile": noise_floor(tokens), "heldout": noise_floor(heldout_tokens)}
    cols = [c for c in ("heldout", "profile") if c in low]
    label = {"heldout": "held-out", "profile": "profile, in-sample"}
    print(f"\nINT4 ladder (every decoder linear on the export's INT4, group {gs}, on INT8 or on BF16; prices in the "
          f"compressed-tensors folder's bytes over uniform W4A16, {w4a16 / 2**20:.2f} MiB; gap closed = (L_W4A16 - L) / "
          f"(L_W4A16 - L_BF16), held-out first, then in-sample on the {n_batches} profile batch(es): L_W4A16 "
          f"{low['profile']:.4f}, L_BF16 {high['profile']:.4f} in-sample"
          f"{'' if layout is None else '; grouped: whole vLLM serving groups, q/k/v and gate/up of a layer on one rung'}):")
    print("| memory over W4A16 | plan | INT8 linears | BF16 linears | price over W4A16 (MiB) | predicted gain | "
          + " | ".join(f"loss ({label[c]}) | gap closed ({label[c]})" for c in cols) + " |")
    print("|" + " --- |" * (6 + 2 * len(cols)))
    noisy = [c for c in cols if abs(low[c] - high[c]) < floors[c]]
    for r in rows:
        gaps = " | ".join(f"{r['loss'][c]:.4f} | " + ("noise" if c in noisy else "-" if r["gap_closed"][c] is None
                                                       else f"{r['gap_closed'][c]:.3f}") for c in cols)
        print(f"| +{100 * r['memory_over_w4a16']:.1f} % | {r['kind']}{' (vllm)' if r['kind'] == 'grouped' else ''} | "
              f"{r['int8']} | {r['bf16']} | {r['price_bytes'] / 2**20:.3f} | {r['predicted_gain']:.4f} | {gaps} |")
    if noisy:
        print(f"[profile] no gap closed printed on {', '.join(label[c] for c in noisy)}: L_W4A16 - L_BF16 within "
              "noise (below 1/sqrt(target tokens)): profile on more of the text the model will train on (--data FILE, "
              "more --batches / --heldout-batches)")


def _write(args, out: Path, model_path: Path, model, prices, gains, rows, main_row, kind, budget, low, high, batches,
           heldout, dtype, started) -> None:
    gs = prices.group_size
    w4a16 = prices.low_model_bytes
    chosen = main_row["rungs"]
    groups = "vllm" if kind == "grouped" else None
    plan = Plan(dict(chosen), low="int4", group_size=gs, groups=groups, rung_set=_rungs(args), budget=args.budget,
                budget_bytes=budget, price_bytes=main_row["price_bytes"], model_identity=model_identity(model_path),
                chosen_by={"writer": "gnmr-hf profile --low int4", "criterion": gains.criterion,
                           "batches": len(batches), "tokens": examples(batches)[1],
                           "currency": "compressed-tensors folder bytes over uniform W4A16",
                           "command": "gnmr-hf profile " + shlex.join(args.argv)},
                serve=getattr(args, "serve", None))
    record = {"w4a16_bytes": w4a16, "bf16_over_w4a16_bytes": sum(p["bf16"] for p in prices.prices.values()),
              "plan": {"rungs": chosen, "groups": groups, "budget_bytes": budget,
                       "price_bytes": main_row["price_bytes"], "predicted_gain": main_row["predicted_gain"],
                       "loss": main_row["loss"], "gap_closed": main_row["gap_closed"]},
              "model": type(model).__name__,
              "losses": {"low": low, "high": high}, "batches": len(batches), "heldout_batches": len(heldout),
              "tokens": examples(batches)[1], "dtype": str(dtype).replace("torch.", ""),
              "units": [{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                        for u in gains.units],
              "plans": [{k: v for k, v in r.items() if k != "rungs"} for r in rows],
              "command": "gnmr-hf profile " + shlex.join(args.argv)}
    out.mkdir(parents=True, exist_ok=True)
    path = plan.save(out / "profile.json", **record)
    print(f"\nthe plan written ({kind}, budget {args.budget} = {budget / 2**20:.3f} MiB over uniform W4A16): "
          f"{main_row['int8']} linear(s) on INT8, {main_row['bf16']} on BF16, {main_row['price_bytes']} B over W4A16 "
          f"(+{100 * main_row['price_bytes'] / w4a16:.2f} %)")
    serve = getattr(args, "serve", None)
    print(f"export it: gnmr-hf export --model {args.model} --plan {out} --format compressed-tensors --output DIR "
          f"[--adapter ADAPTER] (group {gs}{' and target ' + serve if serve else ''} read from the plan)")
    print(f"[profile] wrote {path} (no profile.png for --low int4) in {time.time() - started:.0f} s")
