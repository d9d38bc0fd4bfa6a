#!/usr/bin/env python
"""Score a base model (+ LoRA adapter) with lm-evaluation-harness; same as ``gnmr-hf eval``.

    python eval/run_lm_eval.py --model PATH_OR_ID [--adapter DIR] [--precision bf16|int8] \\
        --tasks gsm8k,mmlu,hellaswag,wikitext [--data-dir DIR] [--limit N] [--output FILE]

The logic lives in :mod:`gnmr_hf.evaluation.evaluate` so the installed ``gnmr-hf`` command runs the same code.
"""

import sys

from gnmr_hf.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
