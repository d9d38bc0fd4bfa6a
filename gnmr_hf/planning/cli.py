"""``gnmr-hf profile``: load the model and the data, profile, plan at the price points, print and write."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.planning.budget import format_price_table, memory_budget, over_low_prices, parse_budget
from gnmr_hf.planning.criteria import CRITERIA, DEFAULT_CRITERION, _criteria
from gnmr_hf.planning.passes import _units
from gnmr_hf.planning.planner import budget_error, measure_plan, plan
from gnmr_hf.planning.profiler import profile_sensitivity

# ------------------------------------------------------------------------------------------ CLI


class ProfileError(Exception):
    """Bad input to ``gnmr-hf profile``: printed as one line, exit code 2."""


PRICE_POINTS = (0.05, 0.10, 0.25)
_LOW = ("nf4", "fp4", "int8", "int4")
_TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text")


PROFILE_EPILOG = """examples:
  gnmr-hf profile --output prof                              SmolLM2, NF4, the recipes' data, 10 % budget
  gnmr-hf profile --model PATH --low nf4 --budget 300MB --data train.jsonl --output prof
  gnmr-hf profile --output prof --criterion first_order,loss --heldout-batches 2   compare criteria
  gnmr-hf profile --model PATH --low int4 --group-size 64 --budget +10%int4 --data docs.txt --output prof
                                                             a ladder for gnmr-hf export --format compressed-tensors
  gnmr-hf eval --model PATH --precision nf4 --skip-modules prof/profile.json --adapter ADAPTER
                                                             score an adapter on the planned mixed base

In Python: BitsAndBytesConfig(load_in_4bit=True, ..., llm_int8_skip_modules=json.load(open("prof/profile.json"))
["skip_modules"]) loads that base with stock transformers. Errors are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    from gnmr_hf.reporting.report import OneLineErrorParser

    p = OneLineErrorParser(
        prog="gnmr-hf profile",
        description="Profile which quantised linears are worth keeping on BF16 (a few batches of the training "
                    "data, before training) and plan a byte budget: prints the price table, writes "
                    "DIR/profile.json (skip_modules, units) and DIR/profile.png, nothing else (the default "
                    "generated training set is written to a temporary folder and removed).",
        epilog=PROFILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model folder with safetensors (the BF16 checkpoint), or an offline alias: "
                        "smollm2-135m-instruct (default), gemma3-270m")
    p.add_argument("--low", default="nf4", choices=_LOW,
                   help="the quantised low path (default nf4); int4: the compressed-tensors export's own W4A16 "
                        "quantiser (gnmr_hf.planning.int4.int4_fake_quant, the BF16 model loaded without bitsandbytes): "
                        "a precision-ladder plan (INT8 / BF16 rungs, first-order gains ct_rung_gains) for gnmr-hf "
                        "export --format compressed-tensors, budgets in the folder's bytes over uniform W4A16 "
                        "(+10%%int4, a size over it, or a share N%% of what every decoder linear on BF16 would cost "
                        "over it), grouped for vLLM by default; --criterion, --storage and --no-ladder do not apply")
    p.add_argument("--group-size", type=int, default=None,
                   help="--low int4: the INT4 group the export will use (default 128, vLLM's W4A16 preset; it must "
                        "divide every decoder linear's input size); recorded in profile.json for the export")
    p.add_argument("--budget", default="10%",
                   help="memory over the all-low model (+10%%nf4, +10%%int8: the served model's bytes), a size "
                        "over it (300MB, 2GiB, 123456B, as served), or a share of the quantised weights' BF16 "
                        "bytes: a percentage (10%%) or a fraction in (0, 1] (0.1) (a bare number above 1 is "
                        "refused as ambiguous); it must buy at least the smallest linear and stay within the total "
                        "(checked once the model is loaded, before profiling); default 10%%")
    p.add_argument("--output", "-o", required=True,
                   help="output folder (profile.json, profile.png; created if missing; an existing file is refused)")
    p.add_argument("--data", default=None,
                   help="training data: a .json/.jsonl file or folder in the recipe's schema (tokenised as "
                        "recipes/finetune.py does), or a text file (.txt/.rst/.md: chunks of --max-seq-len tokens); "
                        "default: the SmolLM2 recipes' generated GSM8K-style training set")
    p.add_argument("--criterion", default=DEFAULT_CRITERION,
                   help=f"criteria, comma-separated ({', '.join(CRITERIA)}, or all); the first plans "
                        f"(default {DEFAULT_CRITERION})")
    p.add_argument("--batches", type=int, default=1,
                   help="batches to profile on (default 1: first_order on one batch costs about 1.6 training steps "
                        "and chose as well as two on SmolLM2, docs/profile.md)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per batch (default: the recipe's, 4)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per example (default: the recipe's; 512 for a text file)")
    p.add_argument("--heldout-batches", type=int, default=0,
                   help="also measure the plans on the next N batches of the data (default 0); refused when the "
                        "data has nothing left after the profile batches, a warning when it has less than asked")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--storage", default="host", choices=("host", "device", "disk"),
                   help="where the BF16 recovery weights live during profiling (default host)")
    p.add_argument("--recipe", default=None, help="the recipe YAML whose data and LoRA settings to use "
                   "(default: recipes/smollm2-135m/<low>.yaml)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-plot", action="store_true", help="do not write profile.png")
    p.add_argument("--groups", default=None, choices=("vllm", "none"),
                   help="plan whole serving groups: q/k/v of a layer as one purchase, gate/up as one (o_proj and "
                        "down_proj single), as vLLM fuses them (the layout read from the model's architecture; an "
                        "unknown one is refused), so that vLLM can serve the plan; default: free (linear by "
                        "linear), except for --low int4 (default vllm there: its export targets vLLM); none: free. "
                        "Either way the free and the grouped plans are printed side by side")
    p.add_argument("--no-ladder", action="store_true",
                   help="4-bit low paths: skip the precision ladder's table (INT8 and BF16 rungs under budgets of "
                        "memory over the 4-bit model; gnmr_hf.planning.ladder, one model load per row)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return _run(args)
    except ProfileError as e:
        print(f"gnmr-hf profile: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"gnmr-hf profile: error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2


def _load_recipe(args: argparse.Namespace, out: Path, scratch: Path):
    """The recipe's configuration (its data, templates, batch size and LoRA), read by :mod:`gnmr_hf.recipe` as
    ``recipes/finetune.py`` reads it. The default generated training set is written under ``scratch`` (a
    temporary folder), not the output folder."""
    from gnmr_hf.recipe import RecipeError, load_config, recipes_folder

    try:
        recipe_file = Path(args.recipe) if args.recipe else (
            recipes_folder() / "smollm2-135m" / ("int8.yaml" if args.low == "int8" else "nf4.yaml"))
    except RecipeError as e:
        raise ProfileError(str(e)) from None
    if not recipe_file.is_file():
        raise ProfileError(f"recipe {recipe_file} not found")
    argv = ["--config", str(recipe_file), "--output_dir", str(out), "--data_dir", str(scratch / "data")]
    if args.data and Path(args.data).suffix.lower() not in _TEXT_SUFFIXES:
        argv += ["--dataset", args.data]
    if args.max_seq_len:
        argv += ["--max_seq_len", str(args.max_seq_len)]
    try:
        return load_config(argv)
    except RecipeError as e:
        raise ProfileError(str(e)) from None


def _text_batches(path: Path, tokenizer, n_batches: int, batch_size: int, seq_len: int) -> list[dict[str, Any]]:
    from gnmr_hf.offline.text_data import read_text_file

    ids = tokenizer(read_text_file(path))["input_ids"]  # strict UTF-8: a Latin-1 file is one line, not U+FFFD
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) > 1][: n_batches * batch_size]
    if not chunks:
        raise ProfileError(f"{path} holds fewer than 2 tokens")
    batches = []
    for i in range(0, len(chunks), batch_size):
        group = chunks[i:i + batch_size]
        width = max(len(c) for c in group)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([c + [pad] * (width - len(c)) for c in group])
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in group])
        labels = input_ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": input_ids, "attention_mask": mask, "labels": labels})
    return batches


def _record_batches(recipe, tokenizer, n_batches: int, batch_size: int, out: Path) -> list[dict[str, Any]]:
    """The first ``n_batches`` batches of the recipe's training rows (:func:`gnmr_hf.recipe.training_rows`),
    collated as the recipe's Trainer collates them."""
    from transformers import DataCollatorForSeq2Seq

    from gnmr_hf.recipe import RecipeError, training_rows

    try:
        rows, _ = training_rows(recipe.script, tokenizer, out, limit=n_batches * batch_size)
    except RecipeError as e:
        raise ProfileError(str(e)) from None
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    return [dict(collate([rows[j] for j in range(i, min(i + batch_size, len(rows)))]))
            for i in range(0, len(rows), batch_size)]


# what a tokenizer folder holds (tokenizer.save_pretrained writes one of these, with tokenizer_config.json)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.tiktoken")


def _load_tokenizer(model_path: Path, shown: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # transformers raises ValueError, OSError, TypeError ... depending on what is missing
        present = [f for f in _TOKENIZER_FILES if (Path(model_path) / f).is_file()]
        if not present:
            raise ProfileError(
                f"--model {shown}: the folder has no tokenizer files (it needs tokenizer.json, or tokenizer.model "
                "or vocab.json + merges.txt, with tokenizer_config.json: what tokenizer.save_pretrained(folder) "
                "writes)") from None
        first = (str(e).strip().splitlines() or [""])[0]
        raise ProfileError(f"--model {shown}: its tokenizer ({', '.join(present)}) did not load: "
                           f"{type(e).__name__}: {first}") from None


def _check_output(out: Path, shown: str) -> None:
    """``--output`` must be a folder or creatable as one (refused before anything is loaded or written)."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ProfileError(f"--output {shown}: " + ("an existing file, not a folder" if p == out else
                                                            f"{p} is a file, not a folder"))
            if not os.access(p, os.W_OK):
                raise ProfileError(f"--output {shown}: {p} is not writable")
            return


def _examples(batches: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Examples and target tokens in prepared-or-collated batches."""
    rows = sum(int(b["input_ids"].shape[0]) for b in batches)
    tokens = sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)
    return rows, tokens


def _run(args: argparse.Namespace) -> int:
    from gnmr_hf.memory import parse_memory_budget

    int4 = args.low == "int4"
    memory = parse_memory_budget(args.budget, lows=_LOW)  # "+10%nf4", "+10%int4": converted once the model is known
    over_int4 = memory[0] if memory is not None and memory[1] == "int4" else None  # over the uniform W4A16 folder
    if over_int4 is not None and not int4:
        raise ProfileError(f"--budget {args.budget} is memory over the uniform W4A16 (int4) model, but --low is "
                           f"{args.low}")
    if args.group_size is not None and not int4:
        raise ProfileError(f"--group-size is the INT4 group of --low int4 (the compressed-tensors export's), not of "
                           f"--low {args.low}")
    if int4 and args.criterion != DEFAULT_CRITERION:
        raise ProfileError(f"--criterion {args.criterion}: --low int4 profiles the rungs' first-order gains against the "
                           "export's INT4 quantiser (gnmr_hf.planning.int4.ct_rung_gains), no other criterion")
    memory = None if over_int4 is not None else memory
    if memory is not None and memory[1] != args.low:
        raise ProfileError(f"--budget {args.budget} is memory over the {memory[1]} model, but --low is {args.low}")
    budget_bytes, budget_fraction = ((None, None) if memory is not None or over_int4 is not None
                                     else parse_budget(args.budget))
    criteria = _criteria(args.criterion)
    if not int4 and args.groups == "none":
        args.groups = None  # free, the default of the bitsandbytes low paths
    for flag in ("batches", "batch_size", "max_seq_len", "threads", "group_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ProfileError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.heldout_batches < 0:
        raise ProfileError(f"--heldout-batches must be >= 0, got {args.heldout_batches}")
    if args.data and not Path(args.data).exists():
        raise ProfileError(f"--data {args.data}: no such file or folder")
    out = Path(args.output).resolve()
    _check_output(out, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from gnmr_hf._import_utils import require

    for pkg in ("transformers", "peft", "datasets") if int4 else ("transformers", "bitsandbytes", "peft", "datasets"):
        require(pkg, "gnmr-hf profile")
    started = time.time()

    # the model folder
    from gnmr_hf.offline.gguf_models import MODELS, resolve_model

    try:
        model_path = Path(resolve_model(args.model))
    except FileNotFoundError as e:
        raise ProfileError(str(e)) from None
    if args.model not in MODELS or model_path == Path(args.model):  # a folder (one named like an alias included)
        if not (model_path / "config.json").is_file():  # a hub id: profile reads the safetensors from a folder
            raise ProfileError(f"--model {args.model}: not a model folder (no config.json)")
        if not list(model_path.glob("*.safetensors")):
            raise ProfileError(f"--model {args.model}: no *.safetensors files (the BF16 weights the recovery path "
                               "reads)")

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tokenizer = _load_tokenizer(model_path, args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    import tempfile

    # the generated training set (no --data) goes to a temporary folder: DIR holds profile.json and profile.png only
    with tempfile.TemporaryDirectory(prefix="gnmr-hf-profile-") as scratch:
        recipe = _load_recipe(args, out, Path(scratch))
        batch_size = args.batch_size or recipe.training.per_device_train_batch_size
        n_total = args.batches + args.heldout_batches
        text = bool(args.data) and Path(args.data).suffix.lower() in _TEXT_SUFFIXES
        if text:
            seq_len = args.max_seq_len or 512
            all_batches = _text_batches(Path(args.data), tokenizer, n_total, batch_size, seq_len)
        else:
            all_batches = _record_batches(recipe, tokenizer, n_total, batch_size, out)
    batches, heldout = all_batches[:args.batches], all_batches[args.batches:]
    if not batches:
        raise ProfileError("the data gave no batch")
    what = f"piece(s) of up to {seq_len} tokens" if text else "example(s)"
    rows, tokens = _examples(batches)
    used = (f"[profile] data: {args.data or 'the recipes generated training set'}: profiling {len(batches)} batch(es) "
            f"({rows} {what}, {tokens} target tokens; batch size {batch_size})")
    if args.heldout_batches:
        if not heldout:
            raise ProfileError(
                f"--heldout-batches {args.heldout_batches}: the data has nothing left for held-out batches (all "
                f"{rows} {what} went to the {len(batches)} profile batch(es)): give more data, fewer --batches, or "
                "--heldout-batches 0")
        h_rows, h_tokens = _examples(heldout)
        used += f", held-out {len(heldout)} batch(es) ({h_rows} {what}, {h_tokens} target tokens)"
    print(used, flush=True)
    if rows < args.batches * batch_size:
        print(f"gnmr-hf profile: warning: --batches {args.batches} x batch size {batch_size} asked for "
              f"{args.batches * batch_size} {what}; the data gave {rows}", file=sys.stderr, flush=True)
    if args.heldout_batches and h_rows < args.heldout_batches * batch_size:
        print(f"gnmr-hf profile: warning: --heldout-batches {args.heldout_batches} x batch size {batch_size} asked "
              f"for {args.heldout_batches * batch_size} {what}; the data left {h_rows} in {len(heldout)} batch(es)",
              file=sys.stderr, flush=True)

    import gnmr_hf

    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    if int4:
        return _run_int4(args, model_path, batches, heldout, dtype, over_int4, budget_bytes, budget_fraction, out,
                         started)
    if args.low == "int8":
        qconfig = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.low, bnb_4bit_compute_dtype=dtype)
    device_map = {"": 0} if torch.cuda.is_available() else None
    print(f"[profile] loading {model_path} in {args.low} ({dtype}) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=qconfig,
                                                 device_map=device_map)
    if args.low != "int8":
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        keep_reference_layout(model)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage=args.storage, units="linears",
                                      dtype=dtype)
    # the budget against the model's linears, before the profile costs anything
    info = _units(model, None)
    sizes, unit_names = [u.bytes for u in info], [u.name for u in info]
    linears = [m for u in info for m in u.modules]
    over_low = over_low_prices(model_path, linears, args.low)  # the price table's second currency
    if memory is not None:
        over_low = memory_budget(args.budget, model_path, linears, args.low)
        budget_bytes = over_low["bf16_budget"]
        print(f"[profile] budget {args.budget}: {over_low['over_low_bytes'] / 2**20:.2f} MiB over the "
              f"{over_low['low_model_bytes'] / 2**20:.1f} MiB {args.low} model = {budget_bytes / 2**20:.2f} MiB of "
              f"BF16 weights ({100 * budget_bytes / sum(sizes):.1f} % of the quantised linears')", flush=True)
    elif budget_bytes is not None:  # a size is bytes over the all-low model as served, as in the recipes
        budget_bytes = int(budget_bytes * over_low["min_bf16_per_over_byte"])
    want = budget_bytes if budget_bytes is not None else int(budget_fraction * sum(sizes))
    why = budget_error(sizes, want, unit_names)
    if why:
        raise ProfileError(f"--budget {args.budget}: {why}")
    # the serving groups (what vLLM fuses), for --groups and for the free-against-grouped table
    from gnmr_hf.planning.groups import purchase_totals
    from gnmr_hf.planning.planner import serving_layout, unit_purchases

    try:
        layout, no_layout = serving_layout("vllm", model=model, linears=linears), None
    except ValueError as e:
        if args.groups:
            raise ProfileError(f"--groups {args.groups}: {e}") from None
        layout, no_layout = None, str(e)
    buys, buy_names = unit_purchases([u.modules for u in info], layout) if layout else (None, None)
    if args.groups:
        sizes, unit_names = purchase_totals(buys, sizes), buy_names  # a grouped plan buys whole groups
        why = budget_error(sizes, want, unit_names)
        if why:
            raise ProfileError(f"--budget {args.budget} with --groups {args.groups}: {why}")
    if "lora_grad" in criteria:
        import peft

        lora = recipe.lora
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha,
                                                           lora_dropout=lora.lora_dropout,
                                                           target_modules=lora.lora_target_modules,
                                                           task_type="CAUSAL_LM"))

    prof = profile_sensitivity(model, batches, criteria=criteria, progress=not args.quiet)
    name = prof._score_name(criteria[0]) if criteria[0] not in prof.skipped else None
    if name is None:
        raise ProfileError(f"criterion {criteria[0]} was skipped: {prof.skipped[criteria[0]]}")

    kw: dict[str, Any] = {"model": model, "batches": batches}
    if heldout:
        ref = measure_plan(model, [], heldout)
        kw.update(heldout=heldout, heldout_reference=(ref["loss_low"], ref["loss_high"]))
    kw["groups"] = args.groups
    main_plan = plan(prof, budget_bytes, budget_fraction=budget_fraction, criterion=name, **kw)
    # price points that buy no unit on this model (a tiny one) are left out
    price = [plan(prof, budget_fraction=f, criterion=name, **kw) for f in PRICE_POINTS
             if (budget_fraction is None or abs(f - budget_fraction) > 1e-9)
             and budget_error(sizes, int(f * prof.total_bytes)) is None]
    price = sorted(price + [main_plan], key=lambda p: p.budget_bytes)

    print()
    print(prof.table(name, top=15))
    print()
    print(prof.cost_table())
    print()
    print(f"price table (gap closed = (L_low - L_plan) / (L_low - L_high); L_low {prof.losses['low']:.4f}, "
          f"L_high {prof.losses['high']:.4f} on the profile batches):")
    print(format_price_table(price, over_low))
    grouping = None
    if layout is not None:  # the constraint's price: the free and the grouped plan at each budget
        from gnmr_hf.planning.planner import format_grouping_table, paired_plans

        kw.pop("groups")
        free, grouped = paired_plans(prof, price, "vllm", **kw)
        print(f"\nfree and grouped plans (grouped: whole serving groups as vLLM fuses them, q/k/v and gate/up of a "
              f"layer together; gap closed in-sample on the {len(batches)} profile batch(es)"
              f"{f' and on the {len(heldout)} held-out batch(es)' if heldout else ''}; grouped - free is what the "
              f"constraint costs; the plan written is the {'grouped' if args.groups else 'free'} one):")
        print(format_grouping_table(free, grouped, layout, over_low))
        grouping = {"groups": "vllm", "plans": [
            {"kind": "grouped" if p.groups else "free", "budget_bytes": p.budget_bytes, "bytes": p.bytes,
             "linears": len(p.modules), "predicted_gap_closed": p.predicted_gap_closed, "measured": p.measured}
            for pair in zip(free, grouped) for p in pair]}
    else:
        print(f"\n[profile] no grouped plans: {no_layout}")
    ladder_rows = None
    if args.low != "int8" and not args.no_ladder:
        from gnmr_hf.planning.ladder import MEMORY_POINTS, format_ladder_table, ladder_table

        print(f"\n[profile] the precision ladder: each linear on {args.low}, INT8 or BF16, planned under memory over "
              f"the {args.low} model (one load per row) ...", flush=True)
        # a budget written as memory over the low model gets its own rows: their ladder plan is the file's ladder
        # plan (gnmr_hf.planning.plan.Plan.load(..., rung_set=("int8", "bf16")); a recipe's --profile.plan)
        points = MEMORY_POINTS if memory is None or memory[1] != args.low else \
            tuple(sorted(set(MEMORY_POINTS) | {memory[0]}))
        ladder_rows = ladder_table(model_path, batches, args.low, dtype=dtype, points=points, progress=not args.quiet)
        print(f"ladder price table (gap closed on the profile batches; L_low {ladder_rows['loss_low']:.4f}, "
              f"L_high {ladder_rows['loss_high']:.4f} as stock-loaded; served over {args.low} = the rungs' exact "
              "bytes with BF16 rungs in BF16):")
        print(format_ladder_table(ladder_rows))
        if args.groups:
            print("(the ladder's rows are free plans; a grouped ladder: choose_rungs(..., groups=serving_groups(model)) "
                  "or a recipe's profile.rungs with profile.groups: vllm; bench/value/group_price.py measures both)")
    print()
    print(main_plan.summary())
    skips = main_plan.skip_modules()
    units_json = [{"index": u.index, "name": u.name, "bytes": u.bytes, "score": u.scores[name],
                   "modules": u.modules, "layer": u.layer, "op": u.op, "scores": u.scores} for u in prof.units]
    out.mkdir(parents=True, exist_ok=True)
    path = prof.to_json(out / "profile.json", skip_modules=skips, criterion=name, budget=args.budget,
                        low=args.low, plan=main_plan.to_dict(), price=[p.to_dict() for p in price], units=units_json,
                        **({} if ladder_rows is None else {"ladder": ladder_rows}),
                        **({} if grouping is None else {"grouping": grouping}),
                        command="gnmr-hf profile " + shlex.join(args.argv))
    written = [str(path)]
    if not args.no_plot:
        try:
            from gnmr_hf.reporting.profile_plot import plot_profile

            # x axis: memory over the all-low model, the price tables' currency; the ladder's rows beside
            title = f"{Path(str(model_path)).name}, {args.low}: profiled on {prof.tokens} target tokens"
            written.append(str(plot_profile(prof, price, out / "profile.png", name, title=title, over_low=over_low,
                                            ladder=ladder_rows)))
        except ImportError:
            print("[profile] matplotlib is not installed: no profile.png (pip install matplotlib)", file=sys.stderr)
    print()
    print("load with these linears unquantised:\n"
          f"  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={args.low!r}, llm_int8_skip_modules=json.load("
          f"open({str(path)!r}))['skip_modules'])" if args.low != "int8" else
          f"  BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=json.load(open({str(path)!r}))['skip_modules'])")
    print(f"[profile] wrote {', '.join(written)} in {time.time() - started:.0f} s")
    return 0


# --------------------------------------------------------------------------------- --low int4

#: --low int4's price points: memory over the uniform W4A16 folder
INT4_POINTS = (0.05, 0.10, 0.25)


def _run_int4(args: argparse.Namespace, model_path: Path, batches, heldout, dtype, over_int4: float | None,
              budget_bytes: int | None, budget_fraction: float | None, out: Path, started: float) -> int:
    """``--low int4``: the ladder planned against the compressed-tensors export's own INT4 quantiser.

    The BF16 model is loaded without a quantiser; :func:`gnmr_hf.planning.int4.ct_rung_gains` gives each decoder
    linear's first-order gain on INT8 and BF16 at the uniform W4A16 point and each rung's price in the folder's
    bytes (:func:`~gnmr_hf.planning.int4.ct_rung_prices`); :func:`gnmr_hf.planning.ladder.choose_rungs` plans under
    the budget (whole vLLM serving groups unless ``--groups none``). Every plan is measured on the batches with
    the export's quantiser applied in torch (the served weights, bit-exact)."""
    from transformers import AutoModelForCausalLM

    from gnmr_hf.planning.groups import ServingLayoutError, decoder_linears, serving_groups, split_groups
    from gnmr_hf.planning.int4 import (
        _largest_group,
        ct_rung_gains,
        ct_rung_prices,
        ct_shapes,
        ct_tensor_bytes,
        int4_fake_quant,
        int8_fake_quant,
    )
    from gnmr_hf.planning.ladder import _loss, choose_rungs, plan_gain
    from gnmr_hf.planning.profiler import model_identity

    gs = 128 if args.group_size is None else args.group_size
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(f"[profile] loading {model_path} in {str(dtype).replace('torch.', '')} (no quantiser: the low path is the "
          f"compressed-tensors export's INT4, group {gs}, simulated in torch) ...", flush=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if args.quiet:
        hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    finally:
        if bars and args.quiet:
            hf_logging.enable_progress_bar()
    linears = decoder_linears(model)
    mods = dict(model.named_modules())
    short = [n for n in linears if mods[n].in_features % gs]
    if short:
        g = _largest_group([mods[n].in_features for n in linears], gs)
        fix = f"use --group-size {g}" if g else "no power-of-two group of at least 16 divides them all"
        raise ProfileError(f"--group-size {gs} does not divide the input size of {short[0]} "
                           f"({mods[short[0]].in_features}): {fix}")
    want_groups = args.groups != "none"  # unset: vLLM's groups, the export's default target
    try:
        groups, no_layout = serving_groups(model, linears), None
    except ServingLayoutError as e:
        if want_groups:
            how = "--groups vllm" if args.groups else "--low int4 plans whole vLLM serving groups by default"
            raise ProfileError(f"{how}: {e}; --groups none plans linear by linear (export it with --target "
                               "transformers)") from None
        groups, no_layout = None, str(e)

    # the one currency: the folder's tensor bytes over the uniform W4A16 folder (gnmr_hf.planning.int4.ct_tensor_bytes)
    shapes, other = ct_shapes(model, linears)
    w4a16 = ct_tensor_bytes(shapes, {}, other, gs)
    all_bf16 = ct_tensor_bytes(shapes, dict.fromkeys(linears, "bf16"), other, gs) - w4a16
    if over_int4 is not None:
        budget = int(over_int4 * w4a16)
    elif budget_bytes is not None:
        budget = int(budget_bytes)
    else:
        budget = int(budget_fraction * all_bf16)
    prices = {n: ct_rung_prices(mods[n].out_features, mods[n].in_features, gs) for n in linears}
    buys = [g.members for g in groups] if groups is not None and want_groups else [(n,) for n in linears]
    cheapest = min(sum(prices[m]["int8"] for m in b) for b in buys)
    what = "serving group" if len(buys) < len(linears) else "linear"
    if budget < cheapest:
        raise ProfileError(f"--budget {args.budget} = {budget} B over uniform W4A16 buys nothing: the cheapest "
                           f"{what} costs {cheapest} B on INT8")
    if budget > all_bf16:
        raise ProfileError(f"--budget {args.budget} = {budget} B over uniform W4A16 is more than every decoder linear "
                           f"on BF16 costs over it ({all_bf16} B): give a smaller budget")

    def on(bs):
        return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in bs]

    profile_b, heldout_b = on(batches), on(heldout)
    t0 = time.time()
    units = ct_rung_gains(model, profile_b, gs, linears)
    print(f"[profile] rung gains against INT4 (group {gs}) on {len(batches)} batch(es) in {time.time() - t0:.0f} s",
          flush=True)
    originals = {n: mods[n].weight.detach().to(torch.bfloat16).clone() for n in linears}

    def measure(rungs: dict[str, str]) -> dict[str, float]:
        """The losses of the folder ``rungs`` describes (its weights as served, computed in ``dtype``)."""
        with torch.no_grad():
            for n in linears:
                r, w, o = rungs.get(n, "low"), mods[n].weight, originals[n]
                w.copy_((o if r == "bf16" else int8_fake_quant(o) if r == "int8" else int4_fake_quant(o, gs)).to(w.dtype))
        return {"profile": _loss(model, profile_b), **({"heldout": _loss(model, heldout_b)} if heldout_b else {})}

    low, high = measure({}), measure(dict.fromkeys(linears, "bf16"))
    budgets = sorted({budget} | {int(f * w4a16) for f in INT4_POINTS if cheapest <= int(f * w4a16) <= all_bf16})
    rows = []
    for b in budgets:
        for kind in ("free", "grouped") if groups is not None else ("free",):
            chosen = choose_rungs(units, b, groups=groups if kind == "grouped" else None)
            gain, price = plan_gain(units, chosen)
            loss = measure(chosen)
            rows.append({"memory_over_w4a16": b / w4a16, "budget_bytes": b, "kind": kind,
                         "int8": sum(r == "int8" for r in chosen.values()),
                         "bf16": sum(r == "bf16" for r in chosen.values()), "price_bytes": price,
                         "predicted_gain": gain, "loss": loss,
                         "gap_closed": {k: (low[k] - v) / (low[k] - high[k]) if low[k] != high[k] else None
                                        for k, v in loss.items()},
                         "split_groups": len(split_groups(chosen, groups)) if groups is not None else None,
                         "rungs": chosen})
    kind = "grouped" if groups is not None and want_groups else "free"
    main_row = next(r for r in rows if r["budget_bytes"] == budget and r["kind"] == kind)
    originals.clear()

    print(f"\nINT4 ladder (every decoder linear on the export's INT4, group {gs}, on INT8 or on BF16; prices in the "
          f"compressed-tensors folder's bytes over uniform W4A16, {w4a16 / 2**20:.2f} MiB; gap closed = (L_W4A16 - L) / "
          f"(L_W4A16 - L_BF16): L_W4A16 {low['profile']:.4f}, L_BF16 {high['profile']:.4f} on the {len(batches)} "
          f"profile batch(es){'' if groups is None else '; grouped: whole vLLM serving groups, q/k/v and gate/up of a layer on one rung'}):")
    cols = ["profile"] + (["heldout"] if heldout_b else [])
    head = ("| memory over W4A16 | plan | INT8 linears | BF16 linears | price over W4A16 (MiB) | predicted gain | "
            + " | ".join(f"loss ({c}) | gap closed ({c})" for c in cols) + " |")
    print(head)
    print("|" + " --- |" * (6 + 2 * len(cols)))
    for r in rows:
        gaps = " | ".join(f"{r['loss'][c]:.4f} | " + ("-" if r["gap_closed"][c] is None else f"{r['gap_closed'][c]:.3f}")
                          for c in cols)
        print(f"| +{100 * r['memory_over_w4a16']:.1f} % | {r['kind']}{' (vllm)' if r['kind'] == 'grouped' else ''} | "
              f"{r['int8']} | {r['bf16']} | {r['price_bytes'] / 2**20:.3f} | {r['predicted_gain']:.4f} | {gaps} |")
    if groups is None:
        print(f"\n[profile] no grouped plans: {no_layout}")
    chosen = main_row["rungs"]
    record = {"low": "int4", "group_size": gs, "groups": "vllm" if kind == "grouped" else None,
              "rungs": chosen, "price_bytes": main_row["price_bytes"], "budget": args.budget, "budget_bytes": budget,
              "w4a16_bytes": w4a16, "bf16_over_w4a16_bytes": all_bf16,
              "plan": {"rungs": chosen, "groups": "vllm" if kind == "grouped" else None, "budget_bytes": budget,
                       "price_bytes": main_row["price_bytes"], "predicted_gain": main_row["predicted_gain"],
                       "loss": main_row["loss"], "gap_closed": main_row["gap_closed"]},
              "model": type(mods[""]).__name__, "model_identity": model_identity(model_path),
              "losses": {"low": low, "high": high}, "batches": len(batches), "heldout_batches": len(heldout),
              "tokens": _examples(batches)[1], "dtype": str(dtype).replace("torch.", ""),
              "units": [{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                        for u in units],
              "plans": [{k: v for k, v in r.items() if k != "rungs"} for r in rows],
              "command": "gnmr-hf profile " + shlex.join(args.argv)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nthe plan written ({kind}, budget {args.budget} = {budget / 2**20:.3f} MiB over uniform W4A16): "
          f"{main_row['int8']} linear(s) on INT8, {main_row['bf16']} on BF16, {main_row['price_bytes']} B over W4A16 "
          f"(+{100 * main_row['price_bytes'] / w4a16:.2f} %)")
    print(f"export it: gnmr-hf export --model {args.model} --plan {out} --format compressed-tensors --output DIR "
          f"[--adapter ADAPTER] (group {gs} read from the plan)")
    print(f"[profile] wrote {path} (no profile.png for --low int4) in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
