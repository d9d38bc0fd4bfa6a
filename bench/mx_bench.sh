#!/usr/bin/env bash
# The MX proxy bench (docs/mx.md), one run at a time, resumable (finished runs are skipped):
#   1. the rest of the sweep at lr 1e-2 (fixed MXFP4 with quantised norms vs BF16, seeds 1-4);
#   2. GNMR and the baselines at that setting, max_active = 1 of 4 blocks (25 %), 5 seeds;
#   3. the oracle diagnostic, one seed per trigger, over the first ORACLE_STEPS steps.
#   nohup bash bench/mx_bench.sh > bench/results/mx_bench.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
SETTING="width=64 depth=4 batch=128 steps=600 lr=1e-2"
SWEEP=${SWEEP:-bench/results/mx_sweep}
METHODS_OUT=${METHODS_OUT:-bench/results/mx_methods}
ORACLE_OUT=${ORACLE_OUT:-bench/results/mx_oracle}
ORACLE_STEPS=${ORACLE_STEPS:-200}
for seed in 1 2 3 4; do
  python bench/mx_sweep.py --out "$SWEEP" --grid seed=$seed $SETTING method=fixed fmt=mxfp4_e2m1 --extra=--quantize_norms
  python bench/mx_sweep.py --out "$SWEEP" --grid seed=$seed $SETTING method=bf16
done
for seed in 0 1 2 3 4; do
  python bench/mx_sweep.py --out "$METHODS_OUT" --grid seed=$seed $SETTING method=gnmr,random,adapt,gsnr \
    fmt=mxfp4_e2m1 --extra=--quantize_norms
done
python bench/mx_sweep.py --out "$ORACLE_OUT" --grid seed=0 width=64 depth=4 batch=128 steps=$ORACLE_STEPS lr=1e-2 \
  method=gnmr,random,adapt,gsnr,fixed fmt=mxfp4_e2m1 --extra=--quantize_norms --extra=--oracle
