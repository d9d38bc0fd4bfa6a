#!/usr/bin/env bash
# GPU readiness check: on one GPU, in at most 10 minutes, runs `pytest -m gpu`, bench/switch.py's
# GPU branch, bench/gpu_13b_shape.py (bf16 / int8 / gnmr step time and peak device memory) and 20 steps of
# each SmolLM2 recipe on CUDA, bench/train_memory.py (NF4 / plan / BF16 weights and training peak on SmolLM2 and
# Gemma 3), then writes OUT/gpu_check.json and OUT/gpu_check.md (one table) plus a log
# per stage under OUT/logs. The stages and their time limits are in bench/gpu_check.py.
#
#   bash bench/gpu_check.sh [--out runs/gpu_check]             # on a CUDA machine
#   bash bench/gpu_check.sh --dry-run --out /tmp/gpu_check     # every stage at its smallest size on the CPU
#
# Extra arguments go to bench/gpu_check.py (--budget-s, --recipe-steps). Exit status 0 when every stage
# passed, 1 when one failed, timed out or was skipped, 2 without a GPU (and without --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's environment when there is one here and none is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
args=("$@")
case " $* " in *" --out "*|*" --out="*) ;; *) args+=(--out runs/gpu_check) ;; esac
case " $* " in *" --dry-run "*) export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES="" ;; esac
exec python bench/gpu_check.py "${args[@]}"
