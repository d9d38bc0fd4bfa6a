#!/usr/bin/env python
"""Print the paper's Table 7 layout for several eval result files; same as ``gnmr-hf report``.

    python eval/report.py bf16.json int8.json gnmr.json [--names BF16 "Fixed INT8" GNMR] [--plot t7.png]

The logic lives in :mod:`gnmr_hf.reporting.report`.
"""

import sys

from gnmr_hf.reporting.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
