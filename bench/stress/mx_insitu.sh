#!/usr/bin/env bash
# In-situ precision switch on the MX proxy (docs/mx.md): rerun fixed MXFP4 seed SEED of the bench setting
# (300 steps) with checkpoints, then resume from step AT on the BF16 path (every block) and with GNMR,
# on the same data stream. WIDTH, STEPS, EVERY (checkpoint period) and OUT select another setting, e.g. the
# width-128 MXFP4 run that diverged at step 296:
#   SEED=0 WIDTH=128 STEPS=600 EVERY=10 AT=250 OUT=bench/results/mx_insitu_w128 bash bench/stress/mx_insitu.sh
#   nohup bash bench/stress/mx_insitu.sh > bench/results/mx_insitu.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
export OMP_NUM_THREADS=1
SEED=${SEED:-0}
AT=${AT:-150}
WIDTH=${WIDTH:-64}
STEPS=${STEPS:-300}
EVERY=${EVERY:-50}
OUT=${OUT:-bench/results/mx_insitu}
CK=${CK:-runs/mx_insitu/ckpt_w${WIDTH}_seed$SEED}
COMMON="--width $WIDTH --depth 4 --batch 128 --steps $STEPS --lr 1e-2 --fmt mxfp4_e2m1 --quantize_norms --seed $SEED --threads 1"
mkdir -p "$OUT"
[ -f "$OUT/fixed_seed$SEED.json" ] || nice -n 10 python recipes/stress/mx_proxy.py $COMMON --method fixed \
  --checkpoint_every $EVERY --checkpoint_dir "$CK" --out "$OUT/fixed_seed$SEED.json"
for m in bf16 gnmr; do
  [ -f "$OUT/${m}_from${AT}_seed$SEED.json" ] || nice -n 10 python recipes/stress/mx_proxy.py $COMMON --method $m \
    --resume_from "$CK/step_$AT.pt" --out "$OUT/${m}_from${AT}_seed$SEED.json"
done
