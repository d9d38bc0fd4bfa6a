"""``gnmr-hf profile``: load the model and the data, profile, plan at the price points, print and write."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gnmr_hf._import_utils import require
from gnmr_hf.memory import parse_budget, parse_memory_budget
from gnmr_hf.offline.gguf_models import MODELS, resolve_model
from gnmr_hf.offline.text_data import read_text_file
from gnmr_hf.planning.criteria import CRITERIA, DEFAULT_CRITERION, _criteria
from gnmr_hf.planning.plan import GGUF_LOWS, LOWS
from gnmr_hf.planning.profile_int4 import INT4_POINTS, run_int4  # noqa: F401  (INT4_POINTS re-exported)
from gnmr_hf.planning.profile_run import PRICE_POINTS, ProfileError, examples, run_bnb  # noqa: F401
from gnmr_hf.reporting.report import OneLineErrorParser
from gnmr_hf.rungs import get_rung
from gnmr_hf.rungs.int4 import INT4_LOWS
from gnmr_hf.serving import TARGETS as SERVE_TARGETS
from gnmr_hf.serving import serve_target

# ------------------------------------------------------------------------------------------ CLI


_LOW = LOWS  # nf4, fp4, int8, int4, int4-asym and the GGUF types (q4_0, q4_1, q5_0, q5_1)
_TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text")


PROFILE_EPILOG = """examples:
  gnmr-hf profile --output prof                              SmolLM2, NF4, the recipes' data, 10 % budget
  gnmr-hf profile --model PATH --low nf4 --budget 300MB --data train.jsonl --output prof
  gnmr-hf profile --output prof --criterion first_order,loss --heldout-batches 2   compare criteria
  gnmr-hf profile --model PATH --low int4 --group-size 64 --budget +10%int4 --data docs.txt --output prof
                                                             a ladder for gnmr-hf export --format compressed-tensors
  gnmr-hf profile --serve gguf --budget +10%q4_0 --data docs.txt --output prof
                                                             a ladder over Q4_0 (Q8_0 / BF16 rungs) for --format gguf
  gnmr-hf eval --model PATH --precision nf4 --skip-modules prof/profile.json --adapter ADAPTER
                                                             score an adapter on the planned mixed base

In Python: BitsAndBytesConfig(load_in_4bit=True, ..., llm_int8_skip_modules=json.load(open("prof/profile.json"))
["skip_modules"]) loads that base with stock transformers. Errors are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--low", default=None, choices=_LOW,
                   help="the quantised low path (default nf4); int4: the compressed-tensors export's own W4A16 "
                        "quantiser (gnmr_hf.planning.int4.int4_fake_quant, the BF16 model loaded without bitsandbytes): "
                        "a precision-ladder plan (INT8 / BF16 rungs, first-order gains ct_rung_gains) for gnmr-hf "
                        "export --format compressed-tensors, budgets in the folder's bytes over uniform W4A16 "
                        "(+10%%int4, a size over it, or a share N%% of what every decoder linear on BF16 would cost "
                        "over it), grouped for vLLM by default; --storage and --no-ladder do not apply. int4-asym: "
                        "the same over W4A16_ASYM (a zero point per group; +10%%int4-asym; vLLM serves it, stock "
                        "transformers does not load it: --serve vllm-cpu or vllm-gpu). q4_0, q4_1, "
                        "q5_0, q5_1 (--serve gguf, default q4_0): a ladder over that GGUF type with Q8_0 (int8) and "
                        "BF16 rungs, profiled against the gguf package's own quantisers, budgets in the GGUF file's "
                        "tensor bytes over the uniform file (+10%%q4_0), for gnmr-hf export --format gguf")
    p.add_argument("--group-size", type=int, default=None,
                   help="--low int4: the INT4 group the export will use (default 128, vLLM's W4A16 preset; it must "
                        "divide every decoder linear's input size); recorded in profile.json for the export")
    p.add_argument("--choose-int4", action="store_true",
                   help="--low int4: choose the INT4 setting too: every group of 128 / 64 / 32 that divides the "
                        "model's inputs, symmetric and (where --serve names a vLLM target) asymmetric W4A16_ASYM, "
                        "each planned at the same folder bytes (uniform W4A16 at the coarsest group plus --budget) "
                        "against its own quantiser; the plan is made over the setting whose plan has the lowest "
                        "held-out loss (the table printed; gnmr_hf.planning.int4_choice)")
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
                   "(default: the model's own recipes/<model>/<low>.yaml for an alias, else recipes/smollm2-135m's)")
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
    p.add_argument("--serve", default=None, choices=tuple(SERVE_TARGETS),
                   help="the server the plan is for: the planner buys only the rungs it serves and keeps the groups "
                        "it fuses, and the plan records it (gnmr-hf export refuses it for another target). vllm-cpu: "
                        "W4A16 with BF16 groups (--low int4; vLLM's CPU build has no W8A16 kernel); vllm-gpu: W4A16 "
                        "with INT8 and BF16 groups (--low int4); gguf: llama.cpp, a GGUF type (--low q4_0 by default) "
                        "with Q8_0 and BF16 linears; bitsandbytes: NF4/FP4 with BF16 linears; transformers: any. "
                        "docs/serving.md: which server serves what")
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


#: an alias's own recipes folder: the default data is what that model's recipes train on
_RECIPE_FOLDERS = {"smollm2-135m-instruct": "smollm2-135m", "gemma3-270m": "gemma3-270m"}


def _default_recipe(folder: Path, args: argparse.Namespace) -> Path:
    """``recipes/<the model's folder>/<low>.yaml`` when the model is an alias with one (its data, templates and
    batch size: what its recipes train on), else the SmolLM2 recipe's."""
    name = "int8.yaml" if args.low == "int8" else "nf4.yaml"
    own = folder / _RECIPE_FOLDERS.get(args.model, "smollm2-135m") / name
    return own if own.is_file() else folder / "smollm2-135m" / name


def _load_recipe(args: argparse.Namespace, out: Path, scratch: Path):
    """The recipe's configuration (its data, templates, batch size and LoRA), read by :mod:`gnmr_hf.recipe` as
    ``recipes/finetune.py`` reads it. The default generated training set is written under ``scratch`` (a
    temporary folder), not the output folder."""
    from gnmr_hf.recipe import RecipeError, load_config, recipes_folder  # transformers (the [train] extra)

    try:
        recipe_file = Path(args.recipe) if args.recipe else _default_recipe(recipes_folder(), args)
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

    from gnmr_hf.recipe import RecipeError, training_rows  # transformers (the [train] extra)

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


_examples = examples  # the former name


def _check_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Every flag checked before anything is loaded (one :class:`ProfileError` line); returns the criteria."""
    _apply_serve(args)
    int4 = args.low in INT4_LOWS
    memory = parse_memory_budget(args.budget, lows=_LOW)  # "+10%nf4", "+10%int4": priced once the model is known
    if memory is not None and memory[1] in INT4_LOWS and memory[1] != args.low:
        scheme = get_rung(memory[1]).exports["compressed-tensors"]
        raise ProfileError(f"--budget {args.budget} is memory over the uniform {scheme} ({memory[1]}) model, but --low "
                           f"is {args.low}")
    if getattr(args, "choose_int4", False):
        if args.low != "int4":
            raise ProfileError(f"--choose-int4 chooses among the compressed-tensors INT4 settings (int4-asym included "
                               f"where --serve takes it): give --low int4 (or --serve vllm-cpu / vllm-gpu), not "
                               f"--low {args.low}")
        if args.group_size is not None:
            raise ProfileError("--choose-int4 chooses the group size: give it or --group-size, not both")
    if args.group_size is not None and not int4:
        raise ProfileError(f"--group-size is the INT4 group of --low int4 / int4-asym (the compressed-tensors "
                           f"export's), not of --low {args.low}")
    if memory is not None and memory[1] != args.low:
        raise ProfileError(f"--budget {args.budget} is memory over the {memory[1]} model, but --low is {args.low}")
    if memory is None:
        parse_budget(args.budget)  # a malformed budget: one line before anything loads
    criteria = _criteria(args.criterion)
    if not int4 and args.groups == "none":
        args.groups = None  # free, the default of the bitsandbytes and GGUF low paths
    for flag in ("batches", "batch_size", "max_seq_len", "threads", "group_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ProfileError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.heldout_batches < 0:
        raise ProfileError(f"--heldout-batches must be >= 0, got {args.heldout_batches}")
    if args.data and not Path(args.data).exists():
        raise ProfileError(f"--data {args.data}: no such file or folder")
    return criteria


def _model_folder(args: argparse.Namespace) -> Path:
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
    return model_path


def _data(args: argparse.Namespace, model_path: Path, out: Path):
    """``(recipe, batches, heldout)``: the profile batches and the held-out ones, with what they hold printed."""
    import tempfile

    tokenizer = _load_tokenizer(model_path, args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # the generated training set (no --data) goes to a temporary folder: DIR holds profile.json and profile.png only
    with tempfile.TemporaryDirectory(prefix="gnmr-hf-profile-") as scratch:
        recipe = _load_recipe(args, out, Path(scratch))
        batch_size = args.batch_size or recipe.training.per_device_train_batch_size
        n_total = args.batches + args.heldout_batches
        text = bool(args.data) and Path(args.data).suffix.lower() in _TEXT_SUFFIXES
        seq_len = args.max_seq_len or 512
        all_batches = (_text_batches(Path(args.data), tokenizer, n_total, batch_size, seq_len) if text
                       else _record_batches(recipe, tokenizer, n_total, batch_size, out))
    batches, heldout = all_batches[:args.batches], all_batches[args.batches:]
    if not batches:
        raise ProfileError("the data gave no batch")
    what = f"piece(s) of up to {seq_len} tokens" if text else "example(s)"
    rows, tokens = examples(batches)
    used = (f"[profile] data: {args.data or 'the recipes generated training set'}: profiling {len(batches)} batch(es) "
            f"({rows} {what}, {tokens} target tokens; batch size {batch_size})")
    if args.heldout_batches:
        if not heldout:
            raise ProfileError(
                f"--heldout-batches {args.heldout_batches}: the data has nothing left for held-out batches (all "
                f"{rows} {what} went to the {len(batches)} profile batch(es)): give more data, fewer --batches, or "
                "--heldout-batches 0")
        h_rows, h_tokens = examples(heldout)
        used += f", held-out {len(heldout)} batch(es) ({h_rows} {what}, {h_tokens} target tokens)"
    print(used, flush=True)
    if rows < args.batches * batch_size:
        print(f"gnmr-hf profile: warning: --batches {args.batches} x batch size {batch_size} asked for "
              f"{args.batches * batch_size} {what}; the data gave {rows}", file=sys.stderr, flush=True)
    if args.heldout_batches and h_rows < args.heldout_batches * batch_size:
        print(f"gnmr-hf profile: warning: --heldout-batches {args.heldout_batches} x batch size {batch_size} asked "
              f"for {args.heldout_batches * batch_size} {what}; the data left {h_rows} in {len(heldout)} batch(es)",
              file=sys.stderr, flush=True)
    return recipe, batches, heldout


def _apply_serve(args: argparse.Namespace) -> None:
    """``--serve``: the low format, the rungs and the groups its target takes (``args.serve_rungs``), or one line
    when ``--low`` / ``--groups`` ask for what it does not serve; without it, ``--low`` defaults to nf4."""
    args.serve_rungs = None
    serve = getattr(args, "serve", None)
    if serve is None:
        args.low = args.low or "nf4"
        return
    target = serve_target(serve)
    if serve == "gguf":
        if args.low is not None and args.low not in GGUF_LOWS:
            raise ProfileError(f"--serve gguf plans over a GGUF type ({', '.join(GGUF_LOWS)}), not --low {args.low}: "
                               "its gains rank the file's own quantiser's errors")
        args.low = args.low or "q4_0"
        args.serve_rungs = target.rungs
        return
    if args.low is not None and args.low not in target.lows:
        raise ProfileError(f"--serve {serve} serves {', '.join(target.lows)} low formats, not --low {args.low}")
    if target.groups and args.groups == "none":
        raise ProfileError(f"--serve {serve} fuses q/k/v and gate/up (each group on one rung): --groups none plans "
                           "that it cannot load")
    args.low = args.low or target.lows[0]
    if target.groups:
        args.groups = target.groups
    if args.low in INT4_LOWS:
        args.serve_rungs = target.rungs
    elif target.rungs != ("bf16",) and serve != "transformers":
        raise ProfileError(f"--serve {serve}: its rungs {target.rungs} over {args.low} are not planned by gnmr-hf "
                           "profile")


def _run(args: argparse.Namespace) -> int:
    criteria = _check_args(args)
    out = Path(args.output).resolve()
    _check_output(out, args.output)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    int4 = args.low in INT4_LOWS or args.low in GGUF_LOWS  # the BF16 model and an export's quantisers in torch
    needs = ("transformers", "peft", "datasets") if int4 else ("transformers", "bitsandbytes", "peft", "datasets")
    for pkg in needs + (("gguf",) if args.low in GGUF_LOWS else ()):
        require(pkg, "gnmr-hf profile")
    started = time.time()
    model_path = _model_folder(args)
    recipe, batches, heldout = _data(args, model_path, out)
    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    if int4:
        return run_int4(args, model_path, batches, heldout, dtype, out, started)
    return run_bnb(args, model_path, recipe, batches, heldout, dtype, out, started, criteria)


if __name__ == "__main__":
    raise SystemExit(main())
