#!/usr/bin/env bash
# The MX proxy bench (docs/mx.md), one run at a time, resumable (finished runs are skipped):
#   1. every method at one setting, 5 seeds: BF16, fixed MXFP4 (weights, activations, gradients and
#      the LayerNorm weights), GNMR, random, ADAPT-style, GSNR, max_active = 1 of 4 blocks (25 %);
#   2. the oracle diagnostic, one seed per trigger, over the first ORACLE_STEPS steps;
#   3. the in-situ switch (bench/stress/mx_insitu.sh);
#   4. more seeds of the 600-step sweep rows, as long as it runs.
#   nohup bash bench/stress/mx_bench.sh > bench/results/mx_bench.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
SETTING="width=64 depth=4 batch=128 lr=1e-2 fmt=mxfp4_e2m1"
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out bench/results/mx_methods --grid seed=$seed $SETTING steps=300 \
    method=bf16,fixed,gnmr,random,adapt,gsnr --extra=--quantize_norms
done
python bench/stress/mx_sweep.py --out bench/results/mx_oracle --grid seed=0 $SETTING steps=${ORACLE_STEPS:-100} \
  method=gnmr,random,adapt,gsnr --extra=--quantize_norms --extra=--oracle
bash bench/stress/mx_insitu.sh
for seed in 1 2 3 4; do
  python bench/stress/mx_sweep.py --out bench/results/mx_sweep --grid seed=$seed $SETTING steps=600 method=bf16
  python bench/stress/mx_sweep.py --out bench/results/mx_sweep --grid seed=$seed $SETTING steps=600 method=fixed \
    --extra=--quantize_norms
done
