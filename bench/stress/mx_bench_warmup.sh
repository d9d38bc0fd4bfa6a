#!/usr/bin/env bash
# GNMR with a full-recovery (BF16) warm-up as long as the ADAPT-style profile (30 of 300 steps) at the
# method-bench setting (docs/mx.md, section 3): does adapt's lead come from its BF16 warm-up?
#   nohup bash bench/stress/mx_bench_warmup.sh > bench/results/mx_bench_warmup.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
for seed in 0 1 2 3 4; do
  python bench/stress/mx_sweep.py --out bench/results/mx_methods_warmup --grid seed=$seed width=64 depth=4 batch=128 \
    lr=1e-2 fmt=mxfp4_e2m1 steps=300 method=gnmr full_recovery_steps=30 --extra=--quantize_norms
done
