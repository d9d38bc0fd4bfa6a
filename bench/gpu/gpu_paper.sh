#!/usr/bin/env bash
# The paper's activation-quantisation stress at its 60M shape (Table 8: hidden 512, intermediate 1376, 8 heads,
# 8 layers = 56 operator units, 256-token sequences; recipes/stress/configs/llama_60m.yaml) on ONE GPU:
# BF16, fixed 4-bit, GNMR (4-bit, up to gnmr.max_active operators at 8-bit) and random at GNMR's budget (a
# seeded random draw of GNMR's measured mean active units per step), one seed, as many optimizer steps as fit
# in BUDGET_S seconds of training for the four runs together; then the paper's Table 1 layout.
#
#   bash bench/gpu/gpu_paper.sh                                   # on a GPU machine, ~6 min of training
#   BUDGET_S=20 bash bench/gpu/gpu_paper.sh model.hidden_size=32 ...  # a CPU dry run at a tiny size (docs/fsdp2.md)
#
# Steps: a short GNMR calibration run (CALIB_STEPS steps) measures the step time; STEPS = the steps per run
# that fit BUDGET_S for the four runs (bench/gpu/gpu_paper.py steps; set STEPS to skip the calibration); the four
# runs share STEPS (the same cosine schedule) and the seed (same initial weights and data order); random_budget
# runs after GNMR with baselines.random_mean_active = GNMR's summary mean_active.
#
# Env: OUT (runs/gpu_paper), CONFIG (llama_60m.yaml), BUDGET_S (360), CALIB_STEPS (8), STEPS (from the
# calibration), BATCH (64 sequences per step; the paper uses 512 = 64 x 8 accumulation, 8x fewer steps in the
# same time: set BATCH=64 ACCUM=8 for the paper's batch), ACCUM (1), CORPUS (the Python 3.11 documentation,
# apt-get install -y python3.11-doc; without it the shipped five-chapter sample, far too small for this model:
# the script says so). Extra arguments are config overrides for every run (section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
OUT=${OUT:-runs/gpu_paper}
CONFIG=${CONFIG:-recipes/stress/configs/llama_60m.yaml}
BUDGET_S=${BUDGET_S:-360}
CALIB_STEPS=${CALIB_STEPS:-8}
BATCH=${BATCH:-64}
ACCUM=${ACCUM:-1}
CORPUS=${CORPUS:-/usr/share/doc/python3.11/html/_sources}
if [ ! -d "$CORPUS" ]; then
  echo "WARNING: corpus $CORPUS not found (apt-get install -y python3.11-doc, or CORPUS=...); using the shipped" \
       "five-chapter sample recipes/stress/corpus_sample, far too small for a 60M model: the figures only show" \
       "that the bench runs" >&2
  CORPUS=recipes/stress/corpus_sample
fi
python -c 'import torch; print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no CUDA: a dry run)")'
mkdir -p "$OUT"
COMMON=(data.corpus_dir="$CORPUS" data.cache_dir="$OUT/.cache" train.batch_size="$BATCH"
        train.gradient_accumulation_steps="$ACCUM" train.save_steps=null train.save_final=false
        train.eval_steps=100000000 train.logging_steps=10)

run() {  # run METHOD STEPS [overrides...]
  local m=$1 steps=$2; shift 2
  local t0=$SECONDS
  python recipes/stress/pretrain.py --config "$CONFIG" --method "$m" --output_dir "$OUT/$m" \
    "${COMMON[@]}" train.max_steps="$steps" "$@" > "$OUT/$m.log" 2>&1 || { tail -n 30 "$OUT/$m.log"; exit 1; }
  echo "$m: $steps steps, $((SECONDS - t0)) s wall (training, evaluation, start-up): $(tail -n 2 "$OUT/$m.log" | head -n 1)"
}

if [ -z "${STEPS:-}" ]; then
  rm -rf "$OUT/calibrate"
  run gnmr "$CALIB_STEPS" "$@"
  mv "$OUT/gnmr" "$OUT/calibrate"; mv "$OUT/gnmr.log" "$OUT/calibrate.log"
  STEPS=$(python bench/gpu/gpu_paper.py steps "$OUT/calibrate/result.json" --budget-s "$BUDGET_S" --runs 4)
fi
echo "=== $STEPS optimizer steps per run ($BATCH x $ACCUM sequences per step), budget $BUDGET_S s for 4 runs"
T0=$SECONDS
for m in bf16 fixed4 gnmr; do rm -rf "${OUT:?}/$m"; run "$m" "$STEPS" "$@"; done
MEAN=$(python bench/gpu/gpu_paper.py mean-active "$OUT/gnmr/result.json")
rm -rf "${OUT:?}/random_budget"
run random_budget "$STEPS" baselines.random_mean_active="$MEAN" "$@"
echo "=== four runs: $((SECONDS - T0)) s wall; random at GNMR's budget: $MEAN units per step on average"
python bench/gpu/gpu_paper.py table "$OUT/bf16" "$OUT/fixed4" "$OUT/gnmr" "$OUT/random_budget" | tee "$OUT/table1.md"
