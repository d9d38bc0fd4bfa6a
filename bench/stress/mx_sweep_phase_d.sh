#!/usr/bin/env bash
# Phase D of the MX proxy sweep (docs/mx.md): wider (width 128, 600 steps), fixed MXFP4
# against BF16, seeds in order so that a stopped sweep still holds whole seeds.
#   nohup bash bench/stress/mx_sweep_phase_d.sh > bench/results/mx_sweep/phase_d.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=${OUT:-bench/results/mx_sweep}
COMMON="width=128 depth=4 batch=128 steps=600 lr=1e-2"
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed $COMMON method=bf16
  python bench/stress/mx_sweep.py --out "$OUT" --grid seed=$seed $COMMON method=fixed fmt=mxfp4_e2m1 --extra=--quantize_norms
done
