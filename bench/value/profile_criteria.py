"""Which sensitivity criterion chooses the BF16 linears best, and what it costs (SmolLM2-135M-Instruct, NF4).

The model: SmolLM2-135M-Instruct in bitsandbytes NF4 with FP32 compute (``bnb_4bit_compute_dtype=float32``;
this CPU has no BF16 matrix units), every linear of the 30 decoder layers a dual-path unit
(``prepare_dual_path(..., units="linears", dtype=float32)``: 210 units, the recovery path the checkpoint's
BF16 weights upcast to FP32), with the recipes' LoRA (r=8, alpha 16, all seven projections; B = 0 at
initialisation, so it changes no loss) for the ``lora_grad`` criterion.

1. The profile text (the first 6,000 characters of ``recipes/stress/corpus_sample/introduction.rst.txt``,
   one sequence) is profiled under every criterion of :func:`gnmr_hf.profile_sensitivity` (``loss``, the
   reference; ``first_order``; ``output`` / ``output_rel``; ``lora_grad`` / ``lora_grad_rel``), each timed.
2. Spearman rank correlation of every score with the ``loss`` gains over the 210 units.
3. For each score and budget (5, 10, 25 % of the quantised weights' BF16 bytes), the greedy plan by score
   per byte (:func:`gnmr_hf.plan`; also ``loss`` by score alone), its gap closed
   ``(L_low - L_plan) / (L_low - L_high)`` measured on the profile text and on two held-out texts (the first
   6,000 characters of ``controlflow.rst.txt`` and ``datastructures.rst.txt``), against random sets of the
   same bytes (``--draws`` seeded draws).
4. The recipe's own data (the ``nf4`` SmolLM2 recipe: its generated problems, batches of 4): every criterion
   on one batch and ``first_order`` on two, their plans at 5/10/25 % measured on 4 held-out batches (and on
   the profile batch), random sets alike; and the cost of each criterion as a share of one training step
   of the recipe setting (LoRA r=8 on all seven projections, AdamW; median of 3 timed steps of forward +
   backward + optimizer step after one warm-up; process CPU time, the machine being shared).
5. Transfer: the text profile's plans measured on the held-out recipe batches, and the recipe profile's
   plans on the three texts.
6. Peak memory of the cheap criteria and of a training step on both kinds of data.

Resumable: each stage's result is kept in ``OUT/results.json`` (and the profile in ``OUT/profile.json``)
and skipped when present. One torch thread (a shared 2-core machine)::

    nohup python bench/value/profile_criteria.py --out bench/results/profile_criteria \\
        > bench/results/profile_criteria/log.txt 2>&1 &
    python bench/value/profile_criteria.py --out bench/results/profile_criteria --report --plot docs/profile_criteria.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "recipes" / "stress" / "corpus_sample"
PROFILE_TEXT = "introduction.rst.txt"
HELDOUT_TEXTS = ("controlflow.rst.txt", "datastructures.rst.txt")
CHARS = 6000
BUDGETS = (0.05, 0.10, 0.25)
# score -> how the plan picks (per byte, as gnmr_hf.plan; "loss (by score)" ranks by the gain alone)
PLANNED = ("loss", "first_order", "output", "output_rel", "lora_grad", "lora_grad_rel")


def rankdata(values: Any) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (as scipy.stats.rankdata)."""
    a = np.asarray(values, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    sorted_a = a[order]
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and sorted_a[j + 1] == sorted_a[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Any, y: Any) -> float:
    """Spearman's rank correlation: Pearson's correlation of the (tie-averaged) ranks."""
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den else math.nan


def by_score(scores: list[float], sizes: list[int], budget: int) -> list[int]:
    """Greedy by score alone (not per byte), skipping what no longer fits; non-positive scores never."""
    order = sorted((i for i, s in enumerate(scores) if math.isfinite(s) and s > 0), key=lambda i: (-scores[i], i))
    chosen, used = [], 0
    for i in order:
        if used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen)


# ------------------------------------------------------------------------------------------------ setup


def load_model(threads: int):
    import torch

    torch.set_num_threads(threads)
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    import gnmr_hf
    from gnmr_hf.backends.bnb_4bit import keep_reference_layout
    from gnmr_hf.offline.smollm2 import smollm2_checkpoint

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    keep_reference_layout(model)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=path, units="linears", dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return model.eval(), tok, path


def text_batch(tok, name: str) -> dict[str, Any]:
    import torch

    ids = tok((CORPUS / name).read_text()[:CHARS], return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def recipe_batches(tok, n: int, out: Path) -> tuple[list[dict[str, Any]], Any]:
    """``n`` batches of the nf4 recipe's training data, tokenised and collated as the recipe does."""
    import tempfile

    from gnmr_hf.planning import cli as P

    work = Path(tempfile.mkdtemp(prefix="profile_criteria_"))  # the generated data files, not results
    args = argparse.Namespace(recipe=None, low="nf4", data=None, max_seq_len=None, model="smollm2-135m-instruct")
    recipe = P._load_recipe(args, work, work)
    bs = recipe.training.per_device_train_batch_size
    return P._record_batches(recipe, tok, n, bs, work), recipe


# ------------------------------------------------------------------------------------------------ stages


def save(out: Path, results: dict[str, Any]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out / "results.json")


def stage_profile(model, texts, out: Path, results: dict[str, Any]):
    from gnmr_hf.planning import SensitivityProfile, profile_sensitivity

    path = out / "profile.json"
    if path.is_file():
        return SensitivityProfile.from_json(path)
    t0 = time.time()
    prof = profile_sensitivity(model, [texts[PROFILE_TEXT]], criteria="all", progress=True)
    prof.to_json(path, text=PROFILE_TEXT, chars=CHARS)
    results["profile_seconds"] = time.time() - t0
    save(out, results)
    return prof


def stage_references(model, texts, prof, results, out):
    from gnmr_hf.planning import measure_plan

    if "references" in results:
        return
    refs = {PROFILE_TEXT: {"loss_low": prof.losses["low"], "loss_high": prof.losses["high"],
                           "tokens": int(texts[PROFILE_TEXT]["input_ids"].shape[1])}}
    for name in HELDOUT_TEXTS:
        m = measure_plan(model, [], [texts[name]])
        refs[name] = {"loss_low": m["loss_low"], "loss_high": m["loss_high"],
                      "tokens": int(texts[name]["input_ids"].shape[1])}
        print(f"[bench] {name}: L_low {m['loss_low']:.4f} L_high {m['loss_high']:.4f}", flush=True)
    results["references"] = refs
    save(out, results)


def measure_all(model, texts, indices, refs) -> dict[str, float]:
    from gnmr_hf.planning import measure_plan

    out = {}
    for name, batch in texts.items():
        r = refs[name]
        out[name] = measure_plan(model, indices, [batch], reference=(r["loss_low"], r["loss_high"]))["gap_closed"]
    return out


def stage_plans(model, texts, prof, results, out, draws: int) -> None:
    from gnmr_hf.planning import greedy_select, random_sets

    refs = results["references"]
    sizes = [u.bytes for u in prof.units]
    rows = results.setdefault("plans", {})
    for frac in BUDGETS:
        budget = int(frac * prof.total_bytes)
        candidates = [(s, "per byte", greedy_select(prof.scores(s), sizes, budget)) for s in PLANNED
                      if s in prof.score_names]
        candidates.append(("loss", "by score", by_score(prof.scores("loss"), sizes, budget)))
        for score, how, chosen in candidates:
            key = f"{score}|{how}|{frac}"
            if key in rows:
                continue
            t0 = time.time()
            gaps = measure_all(model, texts, chosen, refs)
            rows[key] = {"score": score, "how": how, "budget": frac, "indices": chosen, "n": len(chosen),
                         "bytes": sum(sizes[i] for i in chosen), "gap_closed": gaps,
                         "predicted": sum(prof.units[i].scores["loss"] for i in chosen) / prof.gap}
            save(out, results)
            print(f"[bench] {frac:.0%} {score} ({how}): {len(chosen)} units, gap closed "
                  + ", ".join(f"{v:.3f}" for v in gaps.values()) + f"  ({time.time() - t0:.0f} s)", flush=True)
        for d, chosen in enumerate(random_sets(sizes, budget, draws, seed=int(frac * 1000))):
            key = f"random{d}|random|{frac}"
            if key in rows:
                continue
            gaps = measure_all(model, texts, chosen, refs)
            rows[key] = {"score": "random", "how": f"draw {d}", "budget": frac, "indices": chosen, "n": len(chosen),
                         "bytes": sum(sizes[i] for i in chosen), "gap_closed": gaps,
                         "predicted": sum(prof.units[i].scores["loss"] for i in chosen) / prof.gap}
            save(out, results)
            print(f"[bench] {frac:.0%} random draw {d}: {len(chosen)} units, gap closed "
                  + ", ".join(f"{v:.3f}" for v in gaps.values()), flush=True)


def stage_recipe(model, tok, results, out, draws: int) -> None:
    """The recipe's own data: every criterion on one batch of the nf4 recipe (4 generated problems) and
    first_order on two; plans measured on 4 held-out recipe batches; the cost against a training step."""
    import torch

    from gnmr_hf.planning import (
        SensitivityProfile,
        greedy_select,
        measure_plan,
        profile_sensitivity,
        random_sets,
    )

    batches, recipe = recipe_batches(tok, 6, out)
    profiled, heldout = batches[:2], batches[2:]
    profs = {}
    for key, subset, criteria in (("1 batch", profiled[:1], "all"), ("2 batches", profiled, ("first_order",))):
        path = out / f"recipe_profile_{key.replace(' ', '_')}.json"
        if path.is_file():
            profs[key] = SensitivityProfile.from_json(path)
        else:
            profs[key] = profile_sensitivity(model, subset, criteria=criteria, progress=True)
            profs[key].to_json(path, data="nf4 recipe batches", batches_used=key)
        print(f"[bench] recipe profile ({key}):\n{profs[key].cost_table()}", flush=True)
    if "step_costs" not in results:
        # the training step: LoRA on, dropout on, AdamW as the recipe (the LoRA weights are restored afterwards)
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params, lr=recipe.training.learning_rate, weight_decay=0.0)
        model.train()
        times, cpu = [], []
        for i in range(4):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(**profiled[i % 2]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        model.eval()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        step, step_cpu = statistics.median(times), statistics.median(cpu)
        one, two = profs["1 batch"].costs, profs["2 batches"].costs
        results["step_costs"] = {
            "batch": [list(b["input_ids"].shape) for b in profiled],
            "train_step_seconds": times, "train_step_median": step,
            "train_step_cpu_seconds": cpu, "train_step_cpu_median": step_cpu,
            "one_batch": dict(one), "two_batches": dict(two),
            "share_of_step": {k: v["cpu_seconds"] / step_cpu for k, v in one.items()},
            "two_batches_share": {k: v["cpu_seconds"] / step_cpu for k, v in two.items()},
        }
        save(out, results)
        print(f"[bench] training step {step_cpu:.2f} CPU s ({step:.2f} s wall); criterion cost in training steps "
              "(one batch): " + ", ".join(f"{k} {v:.2f}" for k, v in results["step_costs"]["share_of_step"].items()),
              flush=True)
    if "recipe_reference" not in results:
        ref = measure_plan(model, [], heldout)
        results["recipe_reference"] = {"loss_low": ref["loss_low"], "loss_high": ref["loss_high"],
                                       "batches": [list(b["input_ids"].shape) for b in heldout],
                                       "profile_batch": {k: p.losses for k, p in profs.items()}}
        save(out, results)
    ref = results["recipe_reference"]
    rows = results.setdefault("recipe_plans", {})
    prof = profs["1 batch"]
    sizes = [u.bytes for u in prof.units]
    for frac in BUDGETS:
        budget = int(frac * prof.total_bytes)
        candidates = [(f"{sc} (1 batch)", greedy_select(prof.scores(sc), sizes, budget)) for sc in PLANNED
                      if sc in prof.score_names]
        candidates.append(("first_order (2 batches)", greedy_select(profs["2 batches"].scores("first_order"), sizes,
                                                                    budget)))
        candidates += [(f"random{d}", c) for d, c in enumerate(random_sets(sizes, budget, draws, seed=int(frac * 1000)))]
        for name, chosen in candidates:
            key = f"{name}|{frac}"
            if key in rows:
                continue
            m = measure_plan(model, chosen, heldout, reference=(ref["loss_low"], ref["loss_high"]))
            own = measure_plan(model, chosen, profiled[:1], reference=(prof.losses["low"], prof.losses["high"]))
            rows[key] = {"name": name, "budget": frac, "n": len(chosen), "bytes": sum(sizes[i] for i in chosen),
                         "indices": chosen, "heldout_gap_closed": m["gap_closed"], "profile_batch_gap_closed":
                         own["gap_closed"]}
            save(out, results)
            print(f"[bench] recipe {frac:.0%} {name}: {len(chosen)} units, gap closed held-out {m['gap_closed']:.3f}, "
                  f"profile batch {own['gap_closed']:.3f}", flush=True)


def stage_transfer(model, tok, texts, results, out) -> None:
    """Plans chosen on one kind of data, measured on the other: the text profile's plans on the held-out
    recipe batches, the recipe profile's plans on the three texts."""
    from gnmr_hf.planning import SensitivityProfile, greedy_select, measure_plan

    rows = results.setdefault("transfer", {})
    text_prof = SensitivityProfile.from_json(out / "profile.json")
    recipe_prof = SensitivityProfile.from_json(out / "recipe_profile_1_batch.json")
    batches, _ = recipe_batches(tok, 6, out)
    heldout = batches[2:]
    rr, refs = results["recipe_reference"], results["references"]
    sizes = [u.bytes for u in text_prof.units]
    for frac in BUDGETS:
        budget = int(frac * text_prof.total_bytes)
        for score in ("loss", "first_order"):
            key = f"text->recipe|{score}|{frac}"
            if key not in rows:
                chosen = greedy_select(text_prof.scores(score), sizes, budget)
                m = measure_plan(model, chosen, heldout, reference=(rr["loss_low"], rr["loss_high"]))
                rows[key] = {"from": "profile text", "to": "recipe held-out", "score": score, "budget": frac,
                             "n": len(chosen), "gap_closed": {"recipe held-out": m["gap_closed"]}}
                save(out, results)
                print(f"[bench] transfer {key}: {m['gap_closed']:.3f}", flush=True)
            key = f"recipe->text|{score}|{frac}"
            if key not in rows:
                chosen = greedy_select(recipe_prof.scores(score), sizes, budget)
                gaps = measure_all(model, texts, chosen, refs)
                rows[key] = {"from": "recipe batch", "to": "texts", "score": score, "budget": frac,
                             "n": len(chosen), "gap_closed": gaps}
                save(out, results)
                print(f"[bench] transfer {key}: " + ", ".join(f"{v:.3f}" for v in gaps.values()), flush=True)


def stage_memory(model, tok, texts, results, out) -> None:
    """Peak memory of each cheap criterion (RSS growth after returning freed heap to the OS) on the profile
    text and on one recipe batch, and of a training step on that batch (the ``loss`` criterion is
    forward-only: the reference's memory plus its cache of decoder-layer outputs)."""
    import torch

    from gnmr_hf.planning import profile_sensitivity
    from gnmr_hf.planning.passes import _Meter

    if "memory" in results:
        return
    batches, recipe = recipe_batches(tok, 1, out)
    mem: dict[str, Any] = {}
    for where, data in (("profile text", [texts[PROFILE_TEXT]]), ("recipe batch", batches)):
        prof = profile_sensitivity(model, data, criteria=("output", "first_order", "lora_grad"))
        mem[where] = {k: v["peak_mem_bytes"] for k, v in prof.costs.items()}
        mem[where]["tokens"] = int(data[0]["input_ids"].numel())
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params, lr=recipe.training.learning_rate, weight_decay=0.0)
        model.train()
        with _Meter(torch.device("cpu")) as meter:
            model(**data[0]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)
        mem[where]["training step"] = meter.peak
        print(f"[bench] memory on the {where} (MiB): " + ", ".join(
            f"{k} {v / 2**20:.0f}" for k, v in mem[where].items() if k != "tokens"), flush=True)
    results["memory"] = mem
    save(out, results)


# ------------------------------------------------------------------------------------------------ report


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def report(out: Path) -> str:
    from gnmr_hf.planning import SensitivityProfile

    results = json.loads((out / "results.json").read_text())
    prof = SensitivityProfile.from_json(out / "profile.json")
    lines = [f"SmolLM2-135M-Instruct NF4 (FP32 compute), 210 linears; profile text {PROFILE_TEXT} "
             f"({prof.tokens + 1} tokens): L_low {prof.losses['low']:.4f}, L_high {prof.losses['high']:.4f}", ""]
    refs = results.get("references", {})
    for name, r in refs.items():
        lines.append(f"- {name}: {r['tokens']} tokens, L_low {r['loss_low']:.4f}, L_high {r['loss_high']:.4f}")
    loss = prof.scores("loss")
    lines += ["", f"single loss gains sum to {sum(loss) / prof.gap:.2f} x the gap; "
              f"{sum(v > 0 for v in loss)} of {len(loss)} units have a positive gain", ""]
    head = "| criterion | Spearman with loss | seconds | CPU seconds | forwards | backwards | peak MiB |"
    lines += [head, "|---|---|---|---|---|---|---|"]
    crit_of = {"loss": "loss", "first_order": "first_order", "output": "output", "output_rel": "output",
               "lora_grad": "lora_grad", "lora_grad_rel": "lora_grad"}
    for s in PLANNED:
        if s not in prof.score_names:
            continue
        c = prof.costs[crit_of[s]]
        mem = c.get("peak_mem_bytes")
        lines.append(f"| {s} | {spearman(prof.scores(s), loss):.3f} | {c['seconds']:.1f} | {c['cpu_seconds']:.1f} | "
                     f"{c['forwards']} | "
                     f"{c['backwards']} | {'-' if mem is None else f'{mem / 2**20:.0f}'} |")
    c = prof.costs["reference"]
    lines.append(f"| (L_low, L_high) | - | {c['seconds']:.1f} | {c['cpu_seconds']:.1f} | {c['forwards']} | 0 | - |")
    rows = results.get("plans", {})
    texts = [PROFILE_TEXT, *HELDOUT_TEXTS]
    lines += ["", "Gap closed (L_low - L_plan) / (L_low - L_high) by the plan's set on each text "
              "(random: mean [min, max] over draws)", "",
              "| budget | chosen by | units | MiB | predicted (sum of single loss gains) | "
              + " | ".join(texts) + " |", "|---|---|---|---|---|" + "---|" * len(texts)]
    for frac in BUDGETS:
        for s in [*PLANNED, "loss|by score"]:
            score, _, how = s.partition("|")
            key = f"{score}|{how or 'per byte'}|{frac}"
            if key not in rows:
                continue
            r = rows[key]
            label = f"{score} ({how})" if how else f"{score} (per byte)"
            lines.append(f"| {frac:.0%} | {label} | {r['n']} | {r['bytes'] / 2**20:.1f} | {r['predicted']:.2f} | "
                         + " | ".join(f"{r['gap_closed'][t]:.3f}" for t in texts) + " |")
        rnd = [r for r in rows.values() if r["score"] == "random" and r["budget"] == frac]
        if rnd:
            cells = []
            for t in texts:
                v = [r["gap_closed"][t] for r in rnd]
                cells.append(f"{statistics.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
            lines.append(f"| {frac:.0%} | random ({len(rnd)} draws) | {statistics.mean(r['n'] for r in rnd):.0f} | "
                         f"{statistics.mean(r['bytes'] for r in rnd) / 2**20:.1f} | "
                         f"{statistics.mean(r['predicted'] for r in rnd):.2f} | " + " | ".join(cells) + " |")
    rp = results.get("recipe_plans", {})
    if rp:
        rr = results["recipe_reference"]
        one = SensitivityProfile.from_json(out / "recipe_profile_1_batch.json")
        two = SensitivityProfile.from_json(out / "recipe_profile_2_batches.json")
        rl = one.scores("loss")
        lines += ["", f"Recipe batch ({one.tokens} target tokens; L_low {one.losses['low']:.4f}, L_high "
                  f"{one.losses['high']:.4f}): Spearman with its loss gains: " + ", ".join(
                      f"{sc} {spearman(one.scores(sc), rl):.3f}" for sc in PLANNED[1:] if sc in one.score_names)
                  + f"; first_order on 2 batches {spearman(two.scores('first_order'), rl):.3f}; loss gains on the "
                  f"recipe batch against those on the profile text {spearman(rl, loss):.3f}; single gains sum to "
                  f"{sum(rl) / one.gap:.2f} x the gap"]
        lines += ["", "On the recipe's own data: profiled on 1 (or 2) batch(es) of 4 generated problems, gap closed on "
                  f"4 held-out batches (L_low {rr['loss_low']:.4f}, L_high {rr['loss_high']:.4f}) and on the profile "
                  "batch", "", "| budget | chosen by | units | MiB | held-out | profile batch |", "|---|---|---|---|---|---|"]
        for frac in BUDGETS:
            named = [r for r in rp.values() if r["budget"] == frac and not r["name"].startswith("random")]
            for r in named:
                lines.append(f"| {frac:.0%} | {r['name']} | {r['n']} | {r['bytes'] / 2**20:.1f} | "
                             f"{r['heldout_gap_closed']:.3f} | {r['profile_batch_gap_closed']:.3f} |")
            rnd = [r for r in rp.values() if r["budget"] == frac and r["name"].startswith("random")]
            if rnd:
                h = [r["heldout_gap_closed"] for r in rnd]
                o = [r["profile_batch_gap_closed"] for r in rnd]
                lines.append(f"| {frac:.0%} | random ({len(rnd)} draws) | {statistics.mean(r['n'] for r in rnd):.0f} | "
                             f"{statistics.mean(r['bytes'] for r in rnd) / 2**20:.1f} | {statistics.mean(h):.3f} "
                             f"[{min(h):.3f}, {max(h):.3f}] | {statistics.mean(o):.3f} [{min(o):.3f}, {max(o):.3f}] |")
    sc = results.get("step_costs")
    if sc:
        lines += ["", f"Cost on the nf4 recipe's batch ({sc['batch'][0]} tokens): one training step (forward + "
                  f"backward + AdamW, LoRA r=8 on all seven projections) {sc['train_step_cpu_median']:.2f} CPU s, "
                  f"{sc['train_step_median']:.2f} s wall (median of {len(sc['train_step_seconds'])})", "",
                  "| criterion | batches | CPU seconds | wall seconds | forwards | backwards | training steps (CPU time) |",
                  "|---|---|---|---|---|---|---|"]
        for label, costs, share in (("1", sc["one_batch"], sc["share_of_step"]),
                                    ("2", sc["two_batches"], sc["two_batches_share"])):
            for k, v in costs.items():
                lines.append(f"| {k} | {label} | {v['cpu_seconds']:.1f} | {v['seconds']:.1f} | {v['forwards']} | "
                             f"{v['backwards']} | {share[k]:.2f} |")
    tr = results.get("transfer", {})
    if tr:
        lines += ["", "Plans carried to the other kind of data (gap closed there)", "",
                  "| budget | chosen by | on | " + " | ".join([*texts, "recipe held-out"]) + " |",
                  "|---|---|---|" + "---|" * (len(texts) + 1)]
        for frac in BUDGETS:
            for r in (r for r in tr.values() if r["budget"] == frac):
                cells = [_cell(r["gap_closed"].get(t)) for t in [*texts, "recipe held-out"]]
                lines.append(f"| {frac:.0%} | {r['score']} | {r['from']} | " + " | ".join(cells) + " |")
    mem = results.get("memory")
    if mem:
        lines += ["", "Peak memory, MiB (process RSS growth after returning freed heap to the OS; a training step "
                  "with AdamW's state created on its first step)", "",
                  "| data | tokens | reference (L_low, L_high) | output | first_order | lora_grad | training step |",
                  "|---|---|---|---|---|---|---|"]
        for where, m in mem.items():
            lines.append(f"| {where} | {m['tokens']} | " + " | ".join(
                f"{m[k] / 2**20:.0f}" for k in ("reference", "output", "first_order", "lora_grad", "training step"))
                + " |")
    return "\n".join(lines)


def plot(out: Path, path: Path) -> Path:
    """Gap closed against extra bytes per criterion: mean over the two held-out texts, and on the held-out
    recipe batches; random as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.reporting.plots import save_figure

    results = json.loads((out / "results.json").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    xs = [0] + [100 * f for f in BUDGETS]
    styles = {"loss": ("k", "o-"), "first_order": ("C3", "s-"), "output": ("C0", "^--"), "output_rel": ("C0", "v:"),
              "lora_grad": ("C2", "^--"), "lora_grad_rel": ("C2", "v:")}
    for ax, (title, rows, getter) in zip(axes, (
            ("two held-out texts (profiled on introduction.rst.txt)", results["plans"],
             lambda r: statistics.mean(r["gap_closed"][t] for t in HELDOUT_TEXTS)),
            ("4 held-out recipe batches (profiled on one batch)", results["recipe_plans"],
             lambda r: r["heldout_gap_closed"]))):
        for sc, (color, style) in styles.items():
            ys = [0.0]
            for frac in BUDGETS:
                r = next((r for r in rows.values() if r.get("budget") == frac and (
                    r.get("score") == sc and r.get("how") == "per byte" or r.get("name") == f"{sc} (1 batch)")), None)
                ys.append(math.nan if r is None else getter(r))
            ax.plot(xs, ys, style, color=color, label=sc)
        lo, mid, hi = [0.0], [0.0], [0.0]
        for frac in BUDGETS:
            v = [getter(r) for r in rows.values() if r.get("budget") == frac and (
                r.get("score") == "random" or str(r.get("name", "")).startswith("random"))]
            lo.append(min(v))
            mid.append(statistics.mean(v))
            hi.append(max(v))
        ax.fill_between(xs, lo, hi, color="grey", alpha=0.25, label="random (5 draws)")
        ax.plot(xs, mid, "-", color="grey")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("extra BF16 bytes, % of the quantised weights' BF16 bytes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gap closed (L_low - L_plan) / (L_low - L_high)")
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct NF4: plans by each criterion (greedy by score per byte)")
    return save_figure(fig, path, dpi=110)  # titles wrapped to fit, then laid out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile_criteria"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draws", type=int, default=5, help="random sets per budget (default 5)")
    p.add_argument("--report", action="store_true", help="only print the tables of a finished run")
    p.add_argument("--skip-recipe", action="store_true", help="skip the recipe-data stage (plans, cost)")
    p.add_argument("--plot", default=None, help="also write the gap-closed plot here (e.g. docs/profile_criteria.png)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
        model, tok, _ = load_model(args.threads)
        texts = {name: text_batch(tok, name) for name in (PROFILE_TEXT, *HELDOUT_TEXTS)}
        t0 = time.time()
        prof = stage_profile(model, texts, out, results)
        print(prof.cost_table(), flush=True)
        stage_references(model, texts, prof, results, out)
        stage_plans(model, texts, prof, results, out, args.draws)
        if not args.skip_recipe:
            stage_recipe(model, tok, results, out, args.draws)
            stage_memory(model, tok, texts, results, out)
            stage_transfer(model, tok, texts, results, out)
        print(f"[bench] done in {time.time() - t0:.0f} s", flush=True)
    text = report(out)
    (out / "table.md").write_text(text + "\n")
    print(text)
    if args.plot:
        print(f"wrote {plot(out, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
