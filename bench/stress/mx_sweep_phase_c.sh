#!/usr/bin/env bash
# Phase C of the MX proxy sweep (docs/mx.md): a higher learning rate, where the study's instabilities
# should show first, and MXFP8 at the bench setting; 300 steps, 5 seeds, fixed MX against BF16.
#   nohup bash bench/stress/mx_sweep_phase_c.sh > bench/results/mx_sweep/phase_c.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${OUT:-bench/results/mx_sweep}
COMMON="width=64 depth=4 batch=128 steps=300"
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed lr=3e-2 $COMMON method=bf16
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed lr=3e-2 $COMMON method=fixed fmt=mxfp4_e2m1 \
    --extra=--quantize_norms
done
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed lr=1e-2 $COMMON method=fixed fmt=mxfp8_e4m3 \
    --extra=--quantize_norms
done
