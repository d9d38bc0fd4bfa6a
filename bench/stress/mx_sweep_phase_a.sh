#!/usr/bin/env bash
# Phase A of the MX proxy sweep (docs/mx.md): fixed MXFP4 (norms quantised too) against BF16, 5 seeds,
# two learning rates, at the size a shared 2-core CPU affords. Resumable (finished runs are skipped).
#   nohup bash bench/stress/mx_sweep_phase_a.sh > bench/results/mx_sweep/sweep.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${OUT:-bench/results/mx_sweep}
COMMON="width=64 depth=4 batch=128 steps=600"
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed lr=1e-2,3e-3 $COMMON method=fixed fmt=mxfp4_e2m1 \
    --extra=--quantize_norms
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed lr=1e-2,3e-3 $COMMON method=bf16
done
