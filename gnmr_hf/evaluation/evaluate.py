"""``gnmr-hf eval``: score a base model plus an optional LoRA adapter with lm-evaluation-harness.

The paper's downstream evaluation (Table 7) is GSM8K (generation, exact match on the ``#### N``
answer), MMLU (multiple-choice log-likelihood accuracy), HellaSwag (continuation log-likelihood
accuracy) and WikiText-2 (perplexity). Everything here goes through the harness itself: the base is
loaded in BF16, bitsandbytes INT8 or NF4, the adapter applied with plain PEFT, the model wrapped in the
harness's ``HFLM`` and scored by ``lm_eval.simple_evaluate`` with the harness's own task definitions.

``data_dir`` points the tasks at local JSONL files in the hub datasets' own schemas. The task YAMLs
in ``gnmr_hf/evaluation/lm_eval_tasks/`` ``include`` the installed harness's YAMLs and override only the data
source (``dataset_path: json`` plus ``dataset_kwargs.data_files``, which the harness passes to
``datasets.load_dataset``); since those keys need absolute paths, each run fills them in and writes
the YAMLs into a temporary include folder that a ``TaskManager`` indexes on its own (without the
harness's ~thousands of default YAMLs, so the local tasks keep the harness's names).

MMLU is, in the harness, a group of 57 subject tasks (one hub config each, with a per-subject
description). Locally the group is rebuilt from the subjects present in ``DIR/mmlu/test.jsonl``:
one harness subject task per subject, reading that subject's rows, aggregated like the harness's
own group (accuracy weighted by subject size).

Every form a user ends with is scored the same way (:func:`load_model`; the summary's ``scored`` says which
form, the decoder linears per precision and the bytes):

- a BF16 checkpoint, quantised at load (``--precision int8|nf4``, ``--skip-modules``) or not;
- an exported bitsandbytes folder (``gnmr-hf export``: its ``quantization_config`` says it all) and a
  compressed-tensors folder (``gnmr-hf export --format compressed-tensors``), loaded as stock
  ``from_pretrained(folder)`` loads them;
- a ladder plan on its training base (``--plan profile.json``): the BF16 checkpoint through
  :func:`gnmr_hf.planning.ladder.load_planned` (the low linears NF4, or INT8 with ``--precision int8``);
- the merged BF16 model (``gnmr-hf export --merge``), a plain BF16 folder.

The tasks run one at a time (one ``simple_evaluate`` each, on the one loaded model), so each shows its
own progress bar with an ETA; with ``resume_dir`` (``--resume-dir``) each task's results are written
there as soon as it finishes and a rerun with the same settings reads them instead of scoring the task
again, so an interrupted evaluation resumes at the task it was in. The settings hold what the model, adapter,
plan and data paths hold (:func:`contents_fingerprint`), not only their names: a folder re-exported in place is
scored again.

A compressed-tensors folder is scored de-compressed: transformers unpacks its quantised weights to BF16 on the
first forward. The summary's ``precision`` names the folder's format (:func:`folder_format`), and ``scored``
records the bytes held when scoring ended (:func:`held_after_scoring`), saying so.

This module is the command line; the work lives beside it, one file per job (every name stays importable from
here): :mod:`~gnmr_hf.evaluation.tasks` (the tasks and the local data), :mod:`~gnmr_hf.evaluation.skip_list`
(``--skip-modules``), :mod:`~gnmr_hf.evaluation.forms` (the form scored and its record),
:mod:`~gnmr_hf.evaluation.loading` (the base and the adapter), :mod:`~gnmr_hf.evaluation.resume` (the resume
files and their fingerprints) and :mod:`~gnmr_hf.evaluation.run` (the harness run, :func:`evaluate`).
"""

from __future__ import annotations

import argparse
import math
import sys

from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.evaluation.forms import (  # noqa: F401 (the names this module has always had)
    CT_DECOMPRESSED,
    PREQUANTISED,
    _export_marker,
    check_form,
    describe_scored,
    folder_format,
    folder_quantisation,
    format_scored,
    held_after_scoring,
    linear_precision,
)
from gnmr_hf.evaluation.loading import (  # noqa: F401
    COMPUTE_DTYPES,
    PRECISIONS,
    _adapter_weights,
    _compute_dtype,
    _read_adapter_config,
    check_adapter_matches,
    load_model,
    load_scored,
    resolve_model,
)
from gnmr_hf.evaluation.resume import (  # noqa: F401
    _PER_TASK_KEYS,
    _SCORED_KEY,
    _SETTINGS_KEY,
    _file_digest,
    _stale_reason,
    _write_json,
    contents_fingerprint,
    merge_task_results,
    read_task_result,
    write_task_result,
)
from gnmr_hf.evaluation.run import _harness_model, default_method_name, evaluate  # noqa: F401
from gnmr_hf.evaluation.skip_list import _check_skip_modules, _kept_linears, read_skip_modules  # noqa: F401
from gnmr_hf.evaluation.tasks import (  # noqa: F401
    DATA_FILES,
    FEWSHOT,
    FIELDS,
    TASKS,
    check_data_dir,
    parse_tasks,
    write_local_tasks,
)
from gnmr_hf.reporting.report import GSM8K_FILTERS, OneLineErrorParser, format_table


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(value) if value >= 1 and value.is_integer() else value


EPILOG = """examples:
  gnmr-hf eval --model ~/.cache/gnmr_hf/smollm2-135m-instruct --data-dir eval_data --limit 20
  gnmr-hf eval --model PATH --adapter runs/gnmr --precision int8 --tasks gsm8k,wikitext --output gnmr.json
  gnmr-hf eval --model PATH --compute-dtype float32 --batch-size 8 --resume-dir runs/eval_parts
  gnmr-hf eval --model PATH --precision nf4 --skip-modules prof/profile.json --adapter runs/planned-nf4
                                                    # the mixed base a planned adapter trained on
  gnmr-hf eval --model PATH --plan runs/ladder/profile.json --adapter runs/ladder
                                                    # a ladder plan on its training base (load_planned)
  gnmr-hf eval --model exported/                    # an exported folder (bitsandbytes, compressed-tensors, --merge)
  python -m gnmr_hf.offline.eval_data eval_data     # writes the offline evaluation set used above

Errors (a bad task, data folder, adapter or option) are one line on stderr and exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="gnmr-hf eval",
        description="Score a base model (+ LoRA adapter) on GSM8K, MMLU, HellaSwag and WikiText-2 with "
                    "lm-evaluation-harness, and print the paper's Table 7 row.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="base checkpoint folder, hub id or offline alias "
                                                  "(smollm2-135m-instruct, gemma3-270m)")
    p.add_argument("--adapter", help="PEFT LoRA adapter folder to apply on the base")
    p.add_argument("--precision", default=None, choices=PRECISIONS, help="base weights: bf16 (default), bitsandbytes "
                   "int8 or nf4; with --plan the low linears' (nf4 default); left out for an exported folder")
    p.add_argument("--plan", help="a plan file (profile.json, or its folder) loaded on --model, the BF16 checkpoint it "
                   "was made on, through gnmr_hf.load_planned: a ladder's INT8/BF16 rungs, the others --precision")
    p.add_argument("--compute-dtype", default="bfloat16", choices=COMPUTE_DTYPES,
                   help="dtype the model computes in (default bfloat16; float32 makes --batch-size > 1 give the "
                        "batch-1 scores; auto: BF16 where the hardware has BF16 units, else FP32)")
    p.add_argument("--skip-modules", help="int8/nf4: modules kept unquantised (llm_int8_skip_modules): a "
                                          "comma-separated list, or a profile.json from gnmr-hf profile")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--data-dir", help="local data in the hub schemas, DIR/<task>/<split>.jsonl (default: hub datasets)")
    p.add_argument("--limit", type=_limit, help="documents per task (per MMLU subject); <1 = a fraction")
    p.add_argument("--batch-size", default="1", help="batch size (an int or 'auto')")
    p.add_argument("--num-fewshot", type=int, help="override the harness's few-shot counts")
    p.add_argument("--max-gen-toks", type=_positive_int, help="cap GSM8K generation (harness default 256)")
    p.add_argument("--gsm8k-filter", default="strict-match", choices=GSM8K_FILTERS,
                   help="filter for the summary's GSM8K EM (both are in the results)")
    p.add_argument("--name", help="method name for the summary row")
    p.add_argument("--output", help="write the results JSON here")
    p.add_argument("--resume-dir", help="keep each task's results here as it finishes; a rerun with the same "
                                        "settings and the same folder contents reads them instead of scoring "
                                        "the task again")
    p.add_argument("--log-samples", action="store_true", help="keep per-document samples in the results JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    return p


def main(argv: list[str] | None = None) -> int:
    """``gnmr-hf eval --model PATH [--adapter DIR] [--precision bf16|int8|nf4] --tasks ...``; 2 on user errors."""
    args = build_parser().parse_args(argv)
    batch_size: int | str = args.batch_size
    if str(batch_size).isdigit():
        batch_size = int(batch_size)
    elif not str(batch_size).startswith("auto"):
        print(f"gnmr-hf eval: error: --batch-size must be an integer or 'auto', got {batch_size!r} "
              "(see gnmr-hf eval --help)", file=sys.stderr)
        return 2
    try:
        skip_modules = read_skip_modules(args.skip_modules)
        results = evaluate(
            args.model, args.tasks, adapter=args.adapter, precision=args.precision, data_dir=args.data_dir,
            limit=args.limit, batch_size=batch_size, num_fewshot=args.num_fewshot, device=args.device,
            method=args.name, gsm8k_filter=args.gsm8k_filter, max_gen_toks=args.max_gen_toks,
            log_samples=args.log_samples, output=args.output, compute_dtype=args.compute_dtype,
            resume_dir=args.resume_dir, skip_modules=skip_modules, plan=args.plan,
        )
    except (EvalError, ImportError) as e:  # ImportError: require()'s "install it with" message
        print(f"gnmr-hf eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngnmr-hf eval: interrupted" + (f"; rerun the same command to continue (finished tasks are in "
                                               f"{args.resume_dir})" if args.resume_dir else ""), file=sys.stderr)
        return 130
    from lm_eval.utils import make_table

    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(format_table([results["summary"]]))
    if results["summary"].get("scored"):
        print(format_scored(results["summary"]["scored"]))
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    bad = [k for k in ("gsm8k_em", "mmlu_acc", "hellaswag_acc", "wikitext_word_ppl")
           if results["summary"][k] is not None and not math.isfinite(results["summary"][k])]
    if bad:
        print(f"gnmr-hf eval: warning: non-finite {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
