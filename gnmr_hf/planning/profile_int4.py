"""``gnmr-hf profile --low int4`` and ``--serve gguf``: the ladder planned against an export's own quantiser.

``--low int4``: the compressed-tensors export's INT4 (W4A16; INT8 is W8A16), priced in the folder's bytes over
uniform W4A16, whole vLLM serving groups unless ``--groups none``. ``--serve gguf`` (``--low q4_0`` ...): the GGUF
file's ggml types as the ``gguf`` package quantises them (INT8 is Q8_0), priced in the file's tensor bytes over
the uniform low file, linear by linear (llama.cpp fuses nothing) unless ``--groups vllm``
(:mod:`gnmr_hf.planning.gguf_plan`). Either way the BF16 model is loaded without a quantiser;
:func:`gnmr_hf.planning.make.make_plan` chooses every plan (the rungs' first-order gains against the uniform low
point), and every plan is measured inside that one loaded model with the export's quantiser applied to its
weights in torch (the served weights, bit-exact): no plan reloads the model."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.planning.criteria import _criteria
from gnmr_hf.planning.gguf_plan import GGUF_LOWS, block, rung_fake_quant
from gnmr_hf.planning.groups import decoder_linears, split_groups
from gnmr_hf.planning.int4 import _largest_group, int8_fake_quant, low_fake_quant
from gnmr_hf.planning.int4_choice import choose
from gnmr_hf.planning.ladder import _loss
from gnmr_hf.planning.make import layout_of, make_plan, plan_budget, plan_gains, plan_prices
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.profile_run import ProfileError, examples, noise_floor
from gnmr_hf.planning.profiler import model_identity
from gnmr_hf.rungs import get_rung

#: --low int4's (and --serve gguf's) price points: memory over the uniform W4A16 folder (the uniform low file)
INT4_POINTS = (0.05, 0.10, 0.25)


@dataclass(frozen=True)
class _LowSpec:
    """The export a plan is profiled against: its low, how it is named, its currency, its served weights."""

    low: str  # "int4", "int4-asym" or a GGUF low ("q4_0")
    label: str  # the uniform low model's name ("W4A16", "W4A16_ASYM", "Q4_0")
    what: str  # the low path in words
    currency: str  # the plan's currency (chosen_by["currency"])
    group_size: int | None  # the INT4 group (None for GGUF: a type's block is fixed)
    quant: Callable  # (BF16 weight, rung) -> the served weight

    @property
    def gguf(self) -> bool:
        return self.low in GGUF_LOWS


def _spec(args: argparse.Namespace) -> _LowSpec:
    low = getattr(args, "low", None) or "int4"
    if low in GGUF_LOWS:
        t = GGUF_LOWS[low]
        return _LowSpec(low, t, f"the GGUF file's {t} (the gguf package's quantiser)",
                        f"GGUF tensor bytes over the uniform {t} file", None,
                        lambda w, rung: rung_fake_quant(w, rung, low))
    gs = 128 if args.group_size is None else args.group_size
    low_quant = low_fake_quant(low, gs)
    scheme = get_rung(low).exports["compressed-tensors"]  # W4A16, W4A16_ASYM

    def quant(w, rung):
        return w if rung == "bf16" else int8_fake_quant(w) if rung == "int8" else low_quant(w)

    return _LowSpec(low, scheme, f"the compressed-tensors export's INT4 ({scheme}), group {gs}",
                    f"compressed-tensors folder bytes over uniform {scheme}", gs, quant)


def _rungs(args: argparse.Namespace) -> tuple[str, ...]:
    """The rungs the plans may buy: ``--serve``'s target's (vllm-cpu: BF16 only), else INT8 and BF16."""
    return getattr(args, "serve_rungs", None) or ("int8", "bf16")


def _load_bf16(args: argparse.Namespace, model_path: Path, dtype, spec: _LowSpec):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(f"[profile] loading {model_path} in {str(dtype).replace('torch.', '')} (no quantiser: the low path is "
          f"{spec.what}, simulated in torch) ...", flush=True)
    bars = hf_logging.is_progress_bar_enabled()
    if args.quiet:
        hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar
    try:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    finally:
        if bars and args.quiet:
            hf_logging.enable_progress_bar()


class _Swapper:
    """Every plan measured inside the one loaded model: the decoder linears' weights set to what the export a
    plan describes serves (BF16, its INT8 or its low), from one BF16 copy of the originals; each linear's served
    weight on a rung is computed once."""

    def __init__(self, model, linears: list[str], spec: _LowSpec, batches, heldout):
        self.mods = dict(model.named_modules())
        self.model, self.linears, self.spec = model, linears, spec
        self.batches, self.heldout = batches, heldout
        self.originals = {n: self.mods[n].weight.detach().to(torch.bfloat16).clone() for n in linears}
        self.served: dict[tuple[str, str], torch.Tensor] = {}

    def _served(self, name: str, rung: str) -> torch.Tensor:
        if rung == "bf16":
            return self.originals[name]
        key = (name, rung)
        if key not in self.served:
            self.served[key] = self.spec.quant(self.originals[name], rung).to(torch.bfloat16)
        return self.served[key]

    def loss(self, rungs: dict[str, str]) -> dict[str, float]:
        with torch.no_grad():
            for n in self.linears:
                w = self.mods[n].weight
                w.copy_(self._served(n, rungs.get(n, "low")).to(w.dtype))
        out = {"profile": _loss(self.model, self.batches)}
        if self.heldout:
            out["heldout"] = _loss(self.model, self.heldout)
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for n in self.linears:
                self.mods[n].weight.copy_(self.originals[n].to(self.mods[n].weight.dtype))
        self.originals.clear()
        self.served.clear()


def _check_group_size(model, linears: list[str], spec: _LowSpec) -> None:
    mods = dict(model.named_modules())
    if spec.gguf:
        for t in (spec.label, "Q8_0"):
            short = [n for n in linears if mods[n].in_features % block(t)[0]]
            if short:
                raise ProfileError(f"{short[0]}: its rows hold {mods[short[0]].in_features} values, not whole {t} "
                                   f"blocks of {block(t)[0]}: this model cannot be written at {t} (--serve gguf)")
        return
    gs = spec.group_size
    short = [n for n in linears if mods[n].in_features % gs]
    if short:
        g = _largest_group([mods[n].in_features for n in linears], gs)
        fix = f"use --group-size {g}" if g else "no power-of-two group of at least 16 divides them all"
        raise ProfileError(f"--group-size {gs} does not divide the input size of {short[0]} "
                           f"({mods[short[0]].in_features}): {fix}")


def _budget(args: argparse.Namespace, prices, layout, spec: _LowSpec) -> int:
    """``--budget`` in the export's bytes over the uniform low model, refused in one line before the profile."""
    all_bf16 = sum(p["bf16"] for p in prices.prices.values())
    try:
        return plan_budget(args.budget, prices, layout=layout)
    except PlanError as e:
        what = "serving group" if layout is not None else "linear"
        if "buys no unit" in str(e):
            raise ProfileError(f"--budget {args.budget} buys nothing: the cheapest {what} costs more on INT8 over "
                               f"uniform {spec.label} ({e})") from None
        if "exceeds what there is to keep" in str(e):
            raise ProfileError(f"--budget {args.budget} is more than every decoder linear on BF16 costs over uniform "
                               f"{spec.label} ({all_bf16} B): give a smaller budget") from None
        raise ProfileError(f"--budget {args.budget}: {e}") from None


def run_int4(args: argparse.Namespace, model_path: Path, batches, heldout, dtype, out: Path, started: float) -> int:
    """See the module docstring."""
    criteria = _criteria(getattr(args, "criterion", None) or "first_order")
    spec = _spec(args)
    model = _load_bf16(args, model_path, dtype, spec)
    device = next(model.parameters()).device

    def on(bs):
        return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in bs]

    profile_b, heldout_b = on(batches), on(heldout)
    chosen = None  # --choose-int4: the winner's prices and gains, measured while choosing
    if getattr(args, "choose_int4", False):  # the INT4 setting first, measured at the same folder bytes
        spec, chosen = _choose_int4(args, model, profile_b, heldout_b, criteria[0])
    prices = chosen[0] if chosen else plan_prices(model, ("int8", "bf16"), spec.low, group_size=spec.group_size)
    _check_group_size(model, prices.linears, spec)
    # --low int4: vLLM's groups unless --groups none (the export's default target); GGUF: free unless --groups vllm
    want_groups = args.groups == "vllm" if spec.gguf else args.groups != "none"
    try:
        layout, no_layout = layout_of(model, "vllm", prices), None
    except PlanError as e:
        if want_groups:
            how = "--groups vllm" if args.groups else "--low int4 plans whole vLLM serving groups by default"
            raise ProfileError(f"{how}: {str(e).removeprefix('groups vllm: ')}; --groups none plans linear by linear "
                               "(export it with --target transformers)") from None
        layout, no_layout = None, str(e)
    budget = _budget(args, prices, layout if want_groups else None, spec)
    t0 = time.time()
    # the first --criterion plans (first_order, the default: the rungs' first-order gains; another registered
    # criterion runs once per rung, the rung's weight as its high path: gnmr_hf.planning.rung_criteria)
    gains = chosen[1] if chosen else plan_gains(model, profile_b, prices, criteria[0], progress=not args.quiet)
    print(f"[profile] rung gains ({gains.criterion}) against {spec.what} on {len(batches)} batch(es) "
          + ("(measured while choosing the setting)" if chosen else f"in {time.time() - t0:.0f} s"), flush=True)
    swap = _Swapper(model, prices.linears, spec, profile_b, heldout_b)
    try:
        rows, low, high = _rows(args, model, prices, gains, swap, budget, layout, spec)
    finally:
        swap.restore()
    kind = "grouped" if layout is not None and want_groups else "free"
    main_row = next(r for r in rows if r["budget_bytes"] == budget and r["kind"] == kind)
    _print(rows, prices.low_model_bytes, spec, low, high, len(batches), layout, examples(batches)[1],
           examples(heldout)[1] if heldout else 0)
    if layout is None:
        print(f"\n[profile] no grouped plans: {no_layout}")
    _write(args, out, model_path, model, prices, gains, rows, main_row, kind, budget, low, high, batches, heldout,
           dtype, started, spec)
    return 0


def _choose_int4(args: argparse.Namespace, model, profile_b, heldout_b, criterion: str) -> tuple[_LowSpec, tuple]:
    """``--choose-int4`` (:mod:`gnmr_hf.planning.int4_choice`): ``args`` set to the chosen setting (its low, its
    group, the budget over its uniform folder that gives the same bytes); returns its spec and its (prices,
    gains), which the run plans with."""
    linears = decoder_linears(model)
    low, group, budget, rows, measured = choose(args, model, profile_b, heldout_b,
                                                lambda ns, pb, hb: _Swapper(model, linears, _spec(ns), pb, hb),
                                                _rungs(args), args.groups != "none", criterion)
    args.int4_settings = {"requested_budget": args.budget, "rows": rows}
    args.low, args.group_size, args.budget = low, group, budget
    print(f"[profile] --choose-int4: planning over {get_rung(low).exports['compressed-tensors']} group {group} "
          f"(budget {budget} over its uniform folder: the same bytes as {args.int4_settings['requested_budget']} "
          "over uniform W4A16)", flush=True)
    return _spec(args), measured


def _rows(args, model, prices, gains, swap: _Swapper, budget: int, layout, spec: _LowSpec
          ) -> tuple[list[dict[str, Any]], dict, dict]:
    """Each budget's free and grouped plans (make_plan), measured by swapping weights in the one model."""
    from tqdm.auto import tqdm

    base = prices.low_model_bytes
    low, high = swap.loss({}), swap.loss(dict.fromkeys(prices.linears, "bf16"))
    budgets = sorted({budget} | {int(f * base) for f in INT4_POINTS})
    kinds = ("free", "grouped") if layout is not None else ("free",)
    rows = []
    for b in tqdm([(b, k) for b in budgets for k in kinds], desc="plans", disable=args.quiet):
        b, kind = b
        try:
            plan = make_plan(model, swap.batches, b, _rungs(args), "vllm" if kind == "grouped" else None,
                             low=spec.low, group_size=prices.group_size, prices=prices, gains=gains,
                             budget_text=args.budget if b == budget else f"+{100 * b / base:g}%{spec.low}")
        except PlanError:  # a price point that buys nothing or exceeds the total on this model
            continue
        chosen = plan.rungs
        loss = swap.loss(chosen)
        rows.append({"memory_over_low": b / base, "budget_bytes": b, "kind": kind,
                     "int8": sum(r == "int8" for r in chosen.values()), "bf16": sum(r == "bf16" for r in chosen.values()),
                     "price_bytes": plan.price_bytes, "predicted_gain": plan.chosen_by["predicted_gain"], "loss": loss,
                     "gap_closed": {k: (low[k] - v) / (low[k] - high[k]) if low[k] != high[k] else None
                                    for k, v in loss.items()},
                     "split_groups": len(split_groups(chosen, layout)) if layout is not None else None,
                     "rungs": chosen})
        if not spec.gguf:
            rows[-1]["memory_over_w4a16"] = rows[-1]["memory_over_low"]  # the name --low int4 files carry
    return rows, low, high


def _print(rows, base: int, spec: _LowSpec, low, high, n_batches: int, layout, tokens: int,
           heldout_tokens: int) -> None:
    floors = {"profile": noise_floor(tokens), "heldout": noise_floor(heldout_tokens)}
    cols = [c for c in ("heldout", "profile") if c in low]
    label = {"heldout": "held-out", "profile": "profile, in-sample"}
    lo = spec.label
    where = "the GGUF file's tensor" if spec.gguf else "the compressed-tensors folder's"
    name = f"{lo} ladder" if spec.gguf else "INT4 ladder"
    print(f"\n{name} (every decoder linear on {spec.what}, on INT8{' (Q8_0)' if spec.gguf else ''} or on BF16; prices "
          f"in {where} bytes over uniform "
          f"{lo}, {base / 2**20:.2f} MiB; gap closed = (L_{lo} - L) / (L_{lo} - L_BF16), held-out first, then "
          f"in-sample on the {n_batches} profile batch(es): L_{lo} {low['profile']:.4f}, L_BF16 "
          f"{high['profile']:.4f} in-sample"
          f"{'' if layout is None else '; grouped: whole vLLM serving groups, q/k/v and gate/up of a layer on one rung'}):")
    print(f"| memory over {lo} | plan | INT8 linears | BF16 linears | price over {lo} (MiB) | predicted gain | "
          + " | ".join(f"loss ({label[c]}) | gap closed ({label[c]})" for c in cols) + " |")
    print("|" + " --- |" * (6 + 2 * len(cols)))
    noisy = [c for c in cols if abs(low[c] - high[c]) < floors[c]]
    for r in rows:
        gaps = " | ".join(f"{r['loss'][c]:.4f} | " + ("noise" if c in noisy else "-" if r["gap_closed"][c] is None
                                                       else f"{r['gap_closed'][c]:.3f}") for c in cols)
        print(f"| +{100 * r['memory_over_low']:.1f} % | {r['kind']}{' (vllm)' if r['kind'] == 'grouped' else ''} | "
              f"{r['int8']} | {r['bf16']} | {r['price_bytes'] / 2**20:.3f} | {r['predicted_gain']:.4f} | {gaps} |")
    if noisy:
        print(f"[profile] no gap closed printed on {', '.join(label[c] for c in noisy)}: L_{lo} - L_BF16 within "
              "noise (below 1/sqrt(target tokens)): profile on more of the text the model will train on (--data FILE, "
              "more --batches / --heldout-batches)")


def _write(args, out: Path, model_path: Path, model, prices, gains, rows, main_row, kind, budget, low, high, batches,
           heldout, dtype, started, spec: _LowSpec) -> None:
    gs = prices.group_size
    base = prices.low_model_bytes
    chosen = main_row["rungs"]
    groups = "vllm" if kind == "grouped" else None
    writer = "gnmr-hf profile --serve gguf" if spec.gguf else f"gnmr-hf profile --low {spec.low}"
    plan = Plan(dict(chosen), low=spec.low, group_size=gs, groups=groups, rung_set=_rungs(args), budget=args.budget,
                budget_bytes=budget, price_bytes=main_row["price_bytes"], model_identity=model_identity(model_path),
                chosen_by={"writer": writer, "criterion": gains.criterion,
                           "batches": len(batches), "tokens": examples(batches)[1],
                           "currency": spec.currency, "command": "gnmr-hf profile " + shlex.join(args.argv)},
                serve=getattr(args, "serve", None))
    record = {"low_model_bytes": base, "bf16_over_low_bytes": sum(p["bf16"] for p in prices.prices.values()),
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
    if not spec.gguf:  # the names --low int4 files have carried since they were first written
        record["w4a16_bytes"], record["bf16_over_w4a16_bytes"] = base, record["bf16_over_low_bytes"]
    if getattr(args, "int4_settings", None):  # --choose-int4: every setting tried, at the same bytes
        record["int4_settings"] = args.int4_settings
    out.mkdir(parents=True, exist_ok=True)
    path = plan.save(out / "profile.json", **record)
    print(f"\nthe plan written ({kind}, budget {args.budget} = {budget / 2**20:.3f} MiB over uniform {spec.label}): "
          f"{main_row['int8']} linear(s) on INT8{' (Q8_0)' if spec.gguf else ''}, {main_row['bf16']} on BF16, "
          f"{main_row['price_bytes']} B over {spec.label} (+{100 * main_row['price_bytes'] / base:.2f} %)")
    serve = getattr(args, "serve", None)
    if spec.gguf:
        print(f"export it: gnmr-hf export --model {args.model} --plan {out} --format gguf --output FILE.gguf "
              f"[--adapter ADAPTER] (the low type, {spec.label}, read from the plan)")
    else:
        print(f"export it: gnmr-hf export --model {args.model} --plan {out} --format compressed-tensors --output DIR "
              f"[--adapter ADAPTER] (group {gs}{' and target ' + serve if serve else ''} read from the plan)")
    print(f"[profile] wrote {path} (no profile.png for --low {spec.low}) in {time.time() - started:.0f} s")
