"""A checkpoint anyone can load: the planned mixed model as a pre-quantised bitsandbytes folder.

``export_planned(model_path, profile_json, out_dir)`` (and ``gnmr-hf export``) writes a folder that stock
``AutoModelForCausalLM.from_pretrained(folder)`` loads with no arguments as the planned mixed model: the
quantised linears in bitsandbytes' 4-bit (NF4 / FP4) or INT8 serialisation, the planned linears (and
``lm_head``) in BF16, ``config.json``'s ``quantization_config`` listing them in ``llm_int8_skip_modules``
by full dotted name, the tokenizer, and a model card (``README.md``). It is the layout of the
pre-quantised ``*-bnb-4bit`` checkpoints practitioners share.

Who loads what (``target``, ``--target``; the skip list is matched by each loader against its *own*
module names):

- **transformers** (``from_pretrained(folder)``): every kept linear is listed by its full dotted name
  (``model.layers.1.self_attn.v_proj``), which selects exactly that module under transformers' rule (an
  entry matches from the start of a name up to a module boundary, as a regex, or as a suffix:
  :func:`transformers_selects`), so ``layers.1`` never catches ``layers.11``.
- **vLLM** fuses q/k/v into one ``...self_attn.qkv_proj`` and gate/up into one ``...mlp.gate_up_proj``
  (:mod:`gnmr_hf.planning.groups`: the layout per architecture) and keeps a module unquantised when a skip
  entry equals one of its dotted components or leading dotted parts (``is_layer_skipped_bnb``): a leaf name
  such as ``...v_proj`` matches no vLLM module. So ``target="vllm"`` (the default) also lists, for every
  kept fused group, the fused name vLLM matches (``model.layers.1.self_attn.qkv_proj``,
  ``model.layers.1.mlp.gate_up_proj``); o_proj and down_proj are their own groups. transformers matches no
  module by these aliases (checked at export time), so they change nothing it keeps. A fused module has one
  quantisation, so a plan that keeps part of a group (``v_proj`` but not ``q_proj``) cannot be served by
  vLLM: it is refused for ``target="vllm"`` in one line naming the split groups (the fix: a grouped plan,
  ``groups='vllm'``), and a model whose fused layout is unknown is refused likewise.
- ``target="transformers"`` writes the leaf names only, whatever the grouping: a folder for transformers
  (and PEFT on top) only, which its model card states; vLLM cannot load it.

:func:`selected_by` applies transformers' rule and the plain dotted-prefix rule to a list of names;
:func:`serving_skip_entries` builds the vLLM list and checks both rules on both name sets; the tests
(tests/test_export_vllm.py) check every exported entry per architecture, and load the folder.

``merge=True`` writes a merged BF16 model instead: the adapter folded into the original BF16 weights (not
into the quantised ones), the portable route for a server without bitsandbytes. It takes a precision-ladder
plan too (INT8 rungs; the plan's names are only checked against the model), which the bitsandbytes folder
refuses: one bitsandbytes checkpoint holds one low precision.

``gnmr-hf export --format compressed-tensors`` writes the plan (a ladder or a BF16-only plan, with the adapter
merged first when one is given) through :func:`gnmr_hf.export_ct.export_compressed_tensors` instead: INT4 /
INT8 / BF16 per linear in one checkpoint that stock ``from_pretrained`` and vLLM load (``--group-size``: the
INT4 group, 128 by default).

Where the code is: this module is the command (:func:`main`), which dispatches ``--format`` through
:mod:`gnmr_hf.exports` (one file per format, :func:`gnmr_hf.exports.register_format` for a new one); the
bitsandbytes exporter is :mod:`gnmr_hf.exports.bitsandbytes`, its model card :mod:`gnmr_hf.exports.card`. Their
public names are re-exported here.
"""


from __future__ import annotations

from gnmr_hf.export_folder import ExportError, OutputFolderError  # noqa: F401  (re-exported)
from gnmr_hf.export_score import (
    HOW_TO_ASK,
    SCORED_FORMATS,
    ScoreError,
    record,
    score_export,
    score_line,
    warning_line,
)
from gnmr_hf.exports import ExportFormat, format_names, get_format, register_format  # noqa: F401
from gnmr_hf.exports.bitsandbytes import (  # noqa: F401  (re-exported: the bitsandbytes exporter's names)
    LADDER_BNB,
    QUANTS,
    TARGETS,
    _read_plan,
    export_planned,
    name_adapter_base,
    read_plan,
    selected_by,
    serving_skip_entries,
    transformers_selects,
    vllm_selects,
)
from gnmr_hf.exports.card import (  # noqa: F401  (re-exported: the model card's names)
    AFTER_TRAINING_DOCS,
    finetune_command,
    model_card,
    serving_lines,
    source_name,
)
from gnmr_hf.exports.compressed_tensors import check_options as _ct_options  # noqa: F401
from gnmr_hf.offline.gguf_models import resolve_model
from gnmr_hf.offline.text_data import read_text_source
from gnmr_hf.rungs import get_rung
from gnmr_hf.rungs.int4 import int4_low
from gnmr_hf.serving import EXPORT_TARGETS, serve_target

#: the stock formats (``gnmr-hf export --format`` takes every registered one: :func:`gnmr_hf.exports.format_names`)
FORMATS = ("bitsandbytes", "compressed-tensors", "gguf")


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="gnmr-hf export", description="Write the planned mixed model as a folder stock "
                                "transformers loads with no arguments: pre-quantised bitsandbytes + the plan on BF16 "
                                "(--format bitsandbytes, BF16-only plans), or compressed-tensors with INT4 / INT8 / BF16 "
                                "per linear (--format compressed-tensors, ladder plans too; vLLM serves both).",
                                epilog="examples: gnmr-hf export --model ~/.cache/gnmr_hf/smollm2-135m-instruct "
                                       "--plan prof/ --output smollm2-planned-nf4;  gnmr-hf export --model gemma3-270m "
                                       "--plan run/profile.json --adapter run/ --format compressed-tensors --output g-ct;  gnmr-hf export "
                                       "--model gemma3-270m --adapter run/ --format gguf --replan train.txt --output "
                                       "g.gguf (planned anew for Q4_0 on the merged model)")
    p.add_argument("--model", required=True, help="the BF16 model folder (safetensors), or an offline alias")
    p.add_argument("--plan", default=None, help="profile.json (or the folder holding it) from gnmr-hf profile --budget "
                   "or a recipe (a ladder plan's rungs: --format compressed-tensors or --merge); required, except "
                   "with --format gguf --uniform TYPE")
    p.add_argument("--output", required=True, help="the folder to write (refused if it exists and is not empty, or is "
                   "the model, adapter or profile folder, holds one, or is the current folder or a parent of it)")
    p.add_argument("--format", default=None, choices=format_names(), dest="fmt",
                   help="default: the format of the server the plan was made for (gnmr-hf profile --serve, a "
                   "recipe's profile.serve; another that server does not load is refused), else bitsandbytes. " +
                   "; ".join(f"{n}: {get_format(n).help}" for n in format_names() if get_format(n).help))
    p.add_argument("--quant", default=None, choices=QUANTS, help="bitsandbytes: the low precision (default nf4)")
    p.add_argument("--group-size", type=int, default=None,
                   help="compressed-tensors: the INT4 group size (default: an int4 profile's own, else 128, vLLM's "
                   "W4A16 preset; another than an int4 profile's is refused; it must divide "
                   "every INT4 linear's input size, e.g. 64 for SmolLM2's 576)")
    p.add_argument("--target", default=None, choices=EXPORT_TARGETS,
                   help="default: the plan's own (gnmr-hf profile --serve), else vllm. vllm (also vllm-gpu): a folder vLLM and transformers load (a plan that splits a "
                   "fused q/k/v or gate/up group is refused); vllm-cpu (compressed-tensors): vLLM's CPU build, "
                   "which has no W8A16 kernel (a plan with INT8 rungs is refused, with the price of the BF16 "
                   "alternative); transformers: transformers only, any plan")
    p.add_argument("--double-quant", action="store_true", help="bitsandbytes 4-bit: quantise the scales too")
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder: copied beside the model (adapter/) for "
                   "bitsandbytes, merged into the BF16 weights before quantising for compressed-tensors")
    p.add_argument("--merge", action="store_true", help="write the adapter merged into the BF16 weights instead "
                   "(any plan, the ladder included)")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --output (only a folder gnmr-hf "
                   "export wrote: it holds .gnmr_export.json; replaced by rename, the old one removed last)")
    p.add_argument("--low-type", default=None, help="the type of the linears the plan leaves low: gguf: a GGUF type "
                   "(default Q4_0; Q4_1, Q5_0, Q5_1, Q8_0, BF16); compressed-tensors: W4A16 (default: symmetric INT4) "
                   "or W4A16_ASYM (a zero point per group: vLLM serves it, stock transformers does not load it); a "
                   "plan profiled against one of them (gnmr-hf profile --low int4 / int4-asym) brings its own")
    p.add_argument("--uniform", default=None, metavar="TYPE", help="every decoder linear at TYPE, no plan (the "
                   "uniform baseline): a GGUF type with --format gguf, W4A16 or W4A16_ASYM with --format "
                   "compressed-tensors")
    p.add_argument("--score-data", default=None, metavar="FILE", help="compressed-tensors, gguf: held-out text to "
                   "score the export on against the merged BF16 model and the uniform low form (printed, and on the "
                   "card); without it nothing is scored")
    p.add_argument("--replan", default=None, metavar="FILE", help="compressed-tensors, gguf: plan the export anew "
                   "instead of --plan: the adapter merged, the merged model profiled against the export's own "
                   "quantiser (INT4, or the --low-type GGUF type) on the start of this text (the run's own data: a "
                   "text file or a folder of them), "
                   "within --budget, for --target's rungs and groups; the plan saved as OUTPUT.plan.json, and the "
                   "export scored on the text's last blocks unless --score-data names other text")
    p.add_argument("--budget", default=None, help="--replan: memory over the uniform low form (default +10%%int4 or "
                   "+10%%q4_0), a size (300MB) or a share (10%%)")
    p.add_argument("--replan-batches", type=int, default=2, help="--replan: batches of 4 x 512 tokens to profile "
                   "on (default 2)")
    p.add_argument("--score-block", type=int, default=256, help="tokens per scored block (default 256)")
    p.add_argument("--score-blocks", type=int, default=16, help="at most this many blocks, taken from the end of "
                   "--score-data (default 16)")
    return p


def main(argv: list[str] | None = None) -> int:
    import sys

    args = _parser().parse_args(argv)
    def fail(msg: str) -> int:
        print(f"gnmr-hf export: error: {msg}", file=sys.stderr)
        return 2

    wrong = _format_for_plan(args)
    if wrong:
        return fail(wrong)
    fmt = get_format(args.fmt)
    if args.replan is None and (args.budget is not None or args.replan_batches != 2):
        return fail(f"--{'budget' if args.budget is not None else 'replan-batches'} goes with --replan (the export "
                    "plans anew); a plan made before is --plan")
    if args.replan is not None:
        if args.plan or args.uniform:
            return fail(f"--replan makes the plan: give it or --{'plan' if args.plan else 'uniform'}, not both")
        if args.replan_batches < 1:
            return fail(f"--replan-batches must be >= 1, got {args.replan_batches}")
        if args.fmt not in ("compressed-tensors", "gguf"):
            return fail(f"--replan is for --format compressed-tensors and gguf (an export whose low type is not the "
                        f"training's), not {args.fmt}")
        args.score_data = args.score_data or args.replan
    args.ct_low = None
    if args.fmt == "compressed-tensors" and (args.uniform is not None or args.low_type is not None):
        if args.uniform is not None and args.low_type is not None:
            return fail("give --uniform W4A16_ASYM or --low-type W4A16_ASYM, not both")
        try:
            args.ct_low = int4_low(args.uniform or args.low_type)
        except ValueError as e:
            return fail(f"--{'uniform' if args.uniform else 'low-type'} {e} (GGUF types: --format gguf)")
        if args.uniform is not None:
            if args.plan:
                return fail(f"give --plan or --uniform {args.uniform}, not both")
            args.plan = {}  # no planned linear: every decoder linear on the low scheme
    elif args.fmt != "gguf" and (args.low_type or args.uniform):
        return fail(f"--{'low-type' if args.low_type else 'uniform'} is --format gguf's (GGUF types) and "
                    "compressed-tensors' (W4A16, W4A16_ASYM)")
    if args.fmt != "gguf" and not args.plan and args.plan != {} and args.replan is None:
        return fail("--plan is required (a profile.json, or the folder holding it), or --replan DATA")
    bad = fmt.check(args)
    if bad:
        return fail(bad)
    text = None
    if args.score_data is not None:
        if args.score_block < 2 or args.score_blocks < 1:
            return fail(f"--score-block {args.score_block} / --score-blocks {args.score_blocks}: a block holds at "
                        "least 2 tokens, at least one block")
        if args.fmt not in SCORED_FORMATS:
            return fail(f"--score-data: the export scores {', '.join(SCORED_FORMATS)} exports, not {args.fmt}")
        try:
            text = read_text_source(args.score_data)
        except (OSError, ValueError) as e:
            return fail(f"--score-data: {e}")
    try:
        model_path = resolve_model(args.model)
        if args.replan is not None:
            args.plan = _replan(args, model_path, fmt)
        summary = fmt.run(args, model_path)
    except fmt.errors as e:
        return fail(str(e))
    print(fmt.describe(summary))
    if args.fmt in SCORED_FORMATS:
        _score(args, model_path, summary, text)
        hint = _replan_hint(args)
        if hint:
            print(hint)
    return 0


def _format_for_plan(args) -> str | None:
    """``--format``: the one the plan's serving target loads when not given (else bitsandbytes); the line that
    refuses a format that target does not load (``--merge``, BF16 every server loads, is never refused)."""
    plan = _plan_of(args.plan) if isinstance(args.plan, str) and args.plan and args.replan is None else None
    if plan is None or plan.serve is None or args.merge:
        args.fmt = args.fmt or "bitsandbytes"
        return None
    target = serve_target(plan.serve)
    if args.fmt is None:
        args.fmt = target.export_format
        return None
    if args.fmt in target.formats:
        return None
    low = (f"{get_rung(plan.low).exports['compressed-tensors']} (group {plan.group_size})" if plan.is_int4
           else plan.low.upper())
    over = plan.chosen_by.get("low_model_bytes")
    price = "" if plan.price_bytes is None else (
        f" (it adds {plan.price_bytes / 2**20:.2f} MiB" + (f", +{100 * plan.price_bytes / over:.1f} %," if over else "")
        + f" over the all-{low} model)")
    return (f"{plan.source} was made for {target.name}, which loads --format {' or '.join(target.formats)}, not "
            f"{args.fmt}: export it with --format {target.export_format}{price}, or --merge (BF16, every server), "
            f"or plan for the other server (gnmr-hf profile --serve, or gnmr-hf export --replan DATA)")


def _plan_of(path: str):
    """The plan at ``path`` (:meth:`gnmr_hf.planning.Plan.load`), or None where it does not read (the format's own
    reading then says why)."""
    from gnmr_hf.planning.plan import Plan, PlanError

    try:
        return Plan.load(path)
    except (PlanError, ValueError, OSError):
        return None


def _replan_hint(args) -> str | None:
    """A line when a plan profiled against a bitsandbytes low is exported for another quantiser (``--replan``)."""
    if args.replan is not None or not isinstance(args.plan, str):
        return None
    plan = _plan_of(args.plan)
    low = plan.low if plan is not None else None
    if low not in ("nf4", "fp4", "int8"):
        return None
    return (f"note: the plan was profiled against {low.upper()} (the training's low path), not this export's "
            f"{'INT4' if args.fmt == 'compressed-tensors' else 'GGUF types'}: --replan TRAIN_TEXT (instead of --plan) "
            "plans the export anew on the merged model against its own quantiser")


def _replan(args, model_path: str, fmt) -> str:
    """``--replan DATA``: the plan made for this export (:func:`gnmr_hf.export_replan.replan`), its file."""
    import os

    from gnmr_hf.export_replan import replan  # torch: keeps `gnmr-hf export --help` light

    try:
        text = read_text_source(args.replan)
    except (OSError, ValueError) as e:
        raise ExportError(f"--replan: {e}") from None
    keep = args.score_block * args.score_blocks if args.score_data == args.replan else 0
    _, saved = replan(model_path, args.adapter, args.fmt, text, args.output, budget=args.budget,
                      low_type=args.low_type, group_size=args.group_size, target=args.target,
                      batches=args.replan_batches, keep_tail=keep, source=os.path.basename(args.replan),
                      force=args.force)
    return str(saved)


def _score(args, model_path: str, summary: dict, text: str | None) -> None:
    """The export scored on ``--score-data`` (:func:`gnmr_hf.export_score.score_export`): one line printed, a
    ``warning:`` line when it loses more than its plan recovered, the figures on the folder's card and marker."""
    import os

    if text is None:
        print(HOW_TO_ASK)
        return
    gguf = args.fmt == "gguf"
    try:
        r = score_export(model_path, summary["file"] if gguf else summary["folder"], args.fmt, args.adapter, text,
                         block=args.score_block, blocks=args.score_blocks, group_size=summary.get("group_size") or 128,
                         low_type=summary["rung_types"]["low"] if gguf else "Q4_0", source=os.path.basename(args.score_data),
                         planned=len(summary["linears_by_type"]) > 1 if gguf else bool(summary.get("rungs")),
                         ct_low=summary.get("low", "int4"))
    except ScoreError as e:
        print(str(e))
        return
    print(score_line(r))
    w = warning_line(r)
    if w:
        print(w)
    if not gguf:
        record(summary["folder"], r)
