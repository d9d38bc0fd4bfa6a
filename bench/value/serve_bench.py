"""Value at serving time: held-out Python-docs loss of compressed-tensors checkpoints of the base model (no
adapter, post-training quantisation for serving), each exported by ``gnmr_hf.export_compressed_tensors`` and
read back with stock ``AutoModelForCausalLM.from_pretrained(folder)`` (no arguments), so each figure is the
served model's weights.

Rows, per model (the folder's tensor bytes and bytes on disk beside each):

- ``bf16``: the BF16 checkpoint itself;
- ``w4a16``: every decoder linear W4A16 (INT4, group-wise symmetric; ``lm_head`` and the embeddings BF16);
- ``planned``: the precision ladder (W4A16 / W8A16 / BF16 per serving group) at ``--over`` (+10 %) of the
  uniform W4A16 folder's tensor bytes, planned on first-order gains against the export's own INT4 quantiser
  (:func:`gnmr_hf.export_ct.ct_rung_gains`: the gradient at the uniform W4A16 point, on ``--profile-blocks``
  training blocks), grouped as vLLM fuses (:func:`gnmr_hf.planning.groups.serving_groups`: q/k/v and gate/up
  on one rung each), ``choose_rungs(..., fill=True)`` over the groups;
- ``random-S``: the same rungs drawn at random over the same groups at the same budget (groups in a seeded
  random order, each on a random rung while it fits, else INT8 while that fits), seeds ``--seeds``.

``--adapter PATH --tag NAME``: the same rows for a fine-tune served merged: the LoRA adapter merged into the
original BF16 weights (as ``export_compressed_tensors(..., adapter=...)`` merges it), written once as a BF16
folder under ``--work``, and that merged model profiled, quantised and scored in place of the base (the
``bf16`` row is the merged model itself); rows go to ``OUT/<model>+<NAME>.json``. E.g. a ladder fine-tune and
an NF4 QLoRA one (``bench/value/qlora_budget.py run ... --save-adapter``), each re-quantised at equal bytes.

The loss: mean next-token cross-entropy on every token of ``--heldout-blocks`` 256-token blocks of the
held-out files (every 20th file of Debian's python3.11-doc sources, ``gnmr_hf.offline.text_data.text_task``,
as bench/value/qlora_budget.py's pydocs task), forward only. The stock-loaded model decompresses its weights at
its first forward (BF16, bit-equal to ``gnmr_hf.export_ct.fake_quantize_model``, tests/test_export_ct.py);
those weights are copied into an FP32 copy of the model and the loss computed in FP32 (this CPU has no BF16
matmul units, and FP32 keeps small differences visible). One torch thread.

Resumable: each row is appended to ``OUT/<model>.json`` as it finishes and skipped on a rerun; the plans
(rungs per row, the units' gains and prices) go to ``OUT/<model>_plans.json``; ``OUT/serve.md`` is the table
of every model done so far. The exported folders are written under ``--work`` and removed after scoring.

    python bench/value/serve_bench.py --model smollm2-135m-instruct --group-size 64
    python bench/value/serve_bench.py --model gemma3-270m --group-size 128
    python bench/value/serve_bench.py --model gemma3-270m --group-size 128 --adapter RUN/adapter --tag lad-10-seed0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PYDOCS = "/usr/share/doc/python3.11/html/_sources"
BLOCK = 256
OUT = ROOT / "bench" / "results" / "serve"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def spaced(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (all of them when there are fewer)."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def batches(blocks: list[dict], size: int):
    import torch

    for i in range(0, len(blocks), size):
        ids = torch.tensor([b["input_ids"] for b in blocks[i:i + size]])
        yield {"input_ids": ids, "labels": torch.tensor([b["labels"] for b in blocks[i:i + size]])}


def heldout_loss(model, blocks: list[dict], size: int) -> float:
    """Mean next-token cross-entropy over every scored target of ``blocks`` (FP32 logits)."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in batches(blocks, size):
            logits = model(input_ids=b["input_ids"]).logits.float()
            labels = b["labels"][:, 1:]
            total += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                             labels.reshape(-1), ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


def random_rungs(gunits: list, budget: int, seed: int) -> dict[str, str]:
    """A random ladder over the groups within ``budget``: groups in a seeded random order, each on a random rung
    (INT8 or BF16) while it fits, else on INT8 while that fits."""
    rng = random.Random(seed)
    order = list(range(len(gunits)))
    rng.shuffle(order)
    used, chosen = 0, {}
    for i in order:
        u = gunits[i]
        first = rng.choice(("int8", "bf16"))
        for r in dict.fromkeys((first, "int8")):
            if used + u.prices[r] <= budget:
                chosen[u.name] = r
                used += u.prices[r]
                break
    return chosen


def merged_folder(base: Path, adapter: Path, folder: Path) -> Path:
    """``adapter`` merged into ``base``'s BF16 weights (the export's own merge), saved once as a BF16 folder with
    the tokenizer; reused when it is complete."""
    done = folder / ".complete"
    if done.is_file() and done.read_text() == str(adapter.resolve()):
        return folder
    from transformers import AutoTokenizer

    from gnmr_hf.export_ct import _merged_bf16

    log(f"merging {adapter} into {base}")
    shutil.rmtree(folder, ignore_errors=True)
    _merged_bf16(base, adapter).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    done.write_text(str(adapter.resolve()))
    return folder


def served_fp32(folder: Path, base: Path, probe):
    """The stock-loaded export's weights (decompressed at its first forward) in an FP32 copy of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(folder)  # no arguments: as a user loads it
    with torch.no_grad():
        stock(input_ids=probe)
    served = stock.state_dict()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    want = plain.state_dict()
    missing = [k for k in want if k not in served]
    if missing:
        raise RuntimeError(f"the stock-loaded {folder} has no {missing[0]} after its first forward")
    plain.load_state_dict({k: served[k].to(torch.float32) for k in want})
    del stock, served
    return plain.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="offline alias or BF16 model folder")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--over", type=float, default=0.10, help="the budget: this fraction over uniform W4A16 bytes")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                   help="the random rows' seeds (none: no random rows)")
    p.add_argument("--profile-blocks", type=int, default=16)
    p.add_argument("--heldout-blocks", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--work", default="/tmp/serve_bench")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--adapter", default=None, help="a PEFT LoRA folder: score the fine-tune merged (see above)")
    p.add_argument("--tag", default=None, help="the adapter's name in the rows file (with --adapter)")
    p.add_argument("--source", default=PYDOCS, help="the text folder (default: Debian's python3.11-doc sources)")
    args = p.parse_args(argv)
    if (args.adapter is None) != (args.tag is None):
        p.error("--adapter and --tag go together (the tag names the fine-tune's rows)")
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        p.error(f"--adapter {args.adapter}: not a PEFT adapter folder (no adapter_config.json)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gnmr_hf.export_ct import ct_rung_gains, ct_tensor_bytes, export_compressed_tensors
    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.offline.text_data import text_task
    from gnmr_hf.planning.groups import decoder_linears, expand_rungs, grouped_ladder_units, serving_groups
    from gnmr_hf.planning.ladder import choose_rungs, plan_gain

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = Path(resolve_model(args.model))
    tag = Path(args.model).name
    setting = {"model": tag, "group_size": args.group_size, "over": args.over, "profile_blocks": args.profile_blocks,
               "heldout_blocks": args.heldout_blocks, "block": BLOCK, "source": str(args.source), "seeds": args.seeds}
    if args.adapter is not None:
        tag = f"{tag}+{args.tag}"
        setting.update(adapter=str(Path(args.adapter).resolve()), tag=args.tag)
        base = merged_folder(base, Path(args.adapter), Path(args.work) / tag / "merged")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path, plans_path = out / f"{tag}.json", out / f"{tag}_plans.json"
    doc = json.loads(rows_path.read_text()) if rows_path.is_file() else {}
    if doc and doc.get("setting") != setting:
        raise SystemExit(f"{rows_path} was measured with {doc.get('setting')}; move it away to measure {setting}")
    doc = doc or {"setting": setting, "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
                  "rows": {}}

    tok = AutoTokenizer.from_pretrained(base)
    log(f"{tag}: tokenising {args.source}")
    train, held, summary = text_task(args.source, tok, BLOCK)
    prof_blocks, held_blocks = spaced(train, args.profile_blocks), spaced(held, args.heldout_blocks)
    doc["data"] = {k: summary[k] for k in ("files", "train_files", "heldout_files", "train_blocks", "heldout_blocks")}
    doc["data"]["heldout_tokens_scored"] = sum(sum(t != -100 for t in b["labels"][1:]) for b in held_blocks)
    probe = torch.tensor([held_blocks[0]["input_ids"][:8]])

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    linears = decoder_linears(model)
    modules = dict(model.named_modules())
    shapes = {n: (modules[n].out_features, modules[n].in_features, modules[n].bias is not None) for n in linears}
    other = sum(prm.numel() for n, prm in model.named_parameters() if n.rsplit(".", 1)[0] not in set(linears))
    uniform = ct_tensor_bytes(shapes, {}, other, args.group_size)
    budget = int(args.over * uniform)
    groups = serving_groups(model, linears)

    if plans_path.is_file():
        plans = json.loads(plans_path.read_text())
    else:
        log(f"{tag}: gains against the export's INT4 (group {args.group_size}) on {len(prof_blocks)} blocks")
        t0 = time.time()
        units = ct_rung_gains(model, batches(prof_blocks, args.batch_size), args.group_size, linears)
        gunits = grouped_ladder_units(units, groups)
        planned = expand_rungs(choose_rungs(gunits, budget, ("int8", "bf16"), fill=True), groups)
        plans = {"budget_bytes": budget, "uniform_w4a16_tensor_bytes": uniform, "gains_seconds": round(time.time() - t0),
                 "units": [{"name": u.name, "gains": u.gains, "prices": u.prices} for u in units],
                 "rungs": {"w4a16": {}, "planned": planned}}
        for s in args.seeds:
            plans["rungs"][f"random-{s}"] = expand_rungs(random_rungs(gunits, budget, s), groups)
        for name, r in plans["rungs"].items():
            plans.setdefault("predicted_gain", {})[name] = plan_gain(units, r)[0]
        write_json(plans_path, plans)
    doc["budget_bytes"], doc["uniform_w4a16_tensor_bytes"] = budget, uniform

    if "bf16" not in doc["rows"]:
        log(f"{tag}: bf16")
        loss = heldout_loss(model, held_blocks, args.batch_size)
        disk = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        doc["rows"]["bf16"] = {"loss": loss, "tensor_bytes": ct_tensor_bytes(shapes, dict.fromkeys(shapes, "bf16"),
                                                                             other, args.group_size),
                               "bytes_on_disk": disk, "schemes": {"BF16": len(linears)}}
        write_json(rows_path, doc)
    del model

    for name, rungs in plans["rungs"].items():
        if name in doc["rows"]:
            continue
        folder = Path(args.work) / tag / name
        log(f"{tag}: export {name} ({sum(r == 'int8' for r in rungs.values())} INT8, "
            f"{sum(r == 'bf16' for r in rungs.values())} BF16 linears)")
        t0 = time.time()
        s = export_compressed_tensors(base, rungs, folder, group_size=args.group_size, force=True)
        served = served_fp32(folder, base, probe)
        loss = heldout_loss(served, held_blocks, args.batch_size)
        del served
        doc["rows"][name] = {"loss": loss, "tensor_bytes": s["tensor_bytes"], "bytes_on_disk": s["bytes_on_disk"],
                             "schemes": s["schemes"], "predicted_gain": plans["predicted_gain"][name],
                             "seconds": round(time.time() - t0)}
        write_json(rows_path, doc)
        shutil.rmtree(folder)
        log(f"{tag}: {name}: loss {loss:.4f}")
    write_table(out)
    return 0


def write_table(out: Path) -> None:
    """``OUT/serve.md``: every model's rows, with the gap closed and the random rows' median [min, max]."""
    mib = 2**20
    lines = ["# Value at serving time: compressed-tensors checkpoints of the base models (and merged fine-tunes)", "",
             "Written by bench/value/serve_bench.py (its docstring: the rows, the data, how each is loaded and scored). "
             "Held-out loss on the Python docs (every 20th file), the export read back with stock "
             "`from_pretrained(folder)`; gap closed = (L_W4A16 - L) / (L_W4A16 - L_BF16).", ""]
    for path in sorted(out.glob("*.json")):
        if path.name.endswith("_plans.json"):
            continue
        doc = json.loads(path.read_text())
        st, rows = doc["setting"], doc["rows"]
        name = st["model"] + (f"+{st['tag']}" if st.get("tag") else "")
        lines += [f"## {name} (W4A16 group {st['group_size']}, budget +{100 * st['over']:.0f} % over uniform W4A16)",
                  "", f"`{doc['command']}`", "",
                  f"Held-out: {st['heldout_blocks']} blocks of {st['block']} tokens "
                  f"({doc['data']['heldout_tokens_scored']} scored tokens); plan profiled on {st['profile_blocks']} "
                  "training blocks." + (f" The LoRA adapter `{st['adapter']}` merged into the BF16 weights first: every "
                                        "row is that fine-tune." if st.get("adapter") else ""), "",
                  "| row | W4A16 / W8A16 / BF16 linears | tensor bytes | over W4A16 | on disk | held-out loss | gap closed |",
                  "|---|---|---|---|---|---|---|"]
        w4, bf = rows.get("w4a16", {}).get("loss"), rows.get("bf16", {}).get("loss")
        for name, r in rows.items():
            c = r["schemes"]
            gap = (w4 - r["loss"]) / (w4 - bf) if w4 is not None and bf is not None and w4 != bf else None
            over = r["tensor_bytes"] / doc["uniform_w4a16_tensor_bytes"] - 1
            lines.append(f"| {name} | {c.get('W4A16', 0)} / {c.get('W8A16', 0)} / {c.get('BF16', 0)} | "
                         f"{r['tensor_bytes'] / mib:.1f} MiB | {100 * over:+.1f} % | {r['bytes_on_disk'] / mib:.1f} MiB | "
                         f"{r['loss']:.4f} | {'-' if gap is None else f'{gap:.3f}'} |")
        rand = sorted(r["loss"] for n, r in rows.items() if n.startswith("random-"))
        if rand and w4 is not None and bf is not None:
            med = statistics.median(rand)
            lines += ["", f"Random allocation, {len(rand)} seeds: loss median {med:.4f} [{rand[0]:.4f}, {rand[-1]:.4f}], "
                      f"gap closed {(w4 - med) / (w4 - bf):.3f} [{(w4 - rand[-1]) / (w4 - bf):.3f}, "
                      f"{(w4 - rand[0]) / (w4 - bf):.3f}]."]
        lines.append("")
    lines += finetune_table(out)
    (out / "serve.md").write_text("\n".join(lines))


def finetune_rows(out: Path) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """``{(model, training method): {seed: {row: loss}}}`` of every fine-tune rows file tagged ``<method>-seed<S>``,
    by model, NF4 QLoRA first."""
    found: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for path in sorted(out.glob("*.json")):
        if path.name.endswith("_plans.json"):
            continue
        st = json.loads(path.read_text())
        m = re.fullmatch(r"(.+)-seed(\d+)", st["setting"].get("tag") or "")
        if m:
            found.setdefault((st["setting"]["model"], m[1]), {})[int(m[2])] = {k: r["loss"] for k, r in st["rows"].items()}
    return dict(sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][1] != "nf4", kv[0][1])))


def _spread(xs: list[float], fmt: str = "{:.4f}") -> str:
    xs = sorted(xs)
    return fmt.format(statistics.median(xs)) + (f" [{fmt.format(xs[0])}, {fmt.format(xs[-1])}]" if len(xs) > 1 else "")


def finetune_table(out: Path) -> list[str]:
    """serve.md's fine-tune section: per training method, each row's loss over seeds (median [min, max]), and per
    seed the ladder fine-tune served planned against the NF4 QLoRA fine-tune served uniformly and served planned
    (the same seed's ``(model, "nf4")`` rows)."""
    runs = finetune_rows(out)
    if not runs:
        return []
    names = ("bf16", "w4a16", "planned")
    lines = ["## Fine-tunes served (adapters tagged `<method>-seed<S>`: merged into BF16, then exported)", "",
             "Held-out loss, median [min, max] over the seeds; gap closed = (L_W4A16 - L_planned) / (L_W4A16 - L_BF16) "
             "of the same fine-tune.", "",
             "| model, training method | seeds | bf16 (merged) | w4a16 | planned | gap closed |", "|---|---|---|---|---|---|"]
    for (model, method), seeds in runs.items():
        full = [r for r in seeds.values() if all(n in r for n in names)]
        if not full:
            continue
        gaps = [(r["w4a16"] - r["planned"]) / (r["w4a16"] - r["bf16"]) for r in full if r["w4a16"] != r["bf16"]]
        lines.append(f"| {model} {method} | {len(full)} | " + " | ".join(_spread([r[n] for r in full]) for n in names)
                     + f" | {_spread(gaps, '{:.3f}') if gaps else '-'} |")
    pairs = []
    for (model, method), seeds in runs.items():
        if method == "nf4":
            continue
        ref = runs.get((model, "nf4"), {})
        both = [(s, seeds[s], ref[s]) for s in sorted(seeds) if s in ref
                and "planned" in seeds[s] and all(n in ref[s] for n in ("w4a16", "planned"))]
        if both:
            pairs.append(f"| {model} | {method} | " + ", ".join(str(s) for s, _, _ in both) + " | "
                         + _spread([a["planned"] - b["w4a16"] for _, a, b in both], "{:+.4f}") + " | "
                         + _spread([a["planned"] - b["planned"] for _, a, b in both], "{:+.4f}") + " |")
    if pairs:
        lines += ["", "The fine-tune served planned against the NF4 QLoRA fine-tune of the same seed (loss difference, "
                  "negative: lower loss; median [min, max] over seeds):", "",
                  "| model | training method | seeds | planned - NF4 QLoRA's w4a16 (+10 % bytes) | "
                  "planned - NF4 QLoRA's planned (equal bytes) |", "|---|---|---|---|---|", *pairs]
    return [*lines, ""]


if __name__ == "__main__":
    raise SystemExit(main())
