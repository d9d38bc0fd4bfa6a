#!/usr/bin/env bash
# The MX bench on the small LLaMA stress recipe (docs/mx.md, section 6): every method of
# recipes/stress/pretrain.py with --low mxfp4 (weights, activations, gradients and the RMSNorm
# weights in MXFP4; the recovery path BF16-rounded operands in float32 GEMMs), max_active 1 of the 4
# decoder layers (25 %), SEEDS seeds. Resumable and safe to run in parallel: a run whose result.json
# exists is skipped, a run another worker holds (flock) is left to it, an interrupted one resumes from
# its latest checkpoint. Start two workers in the background, then the report:
#   for w in 1 2; do nohup bash bench/stress/mx_llama_bench.sh > bench/results/mx_llama/worker$w.log 2>&1 & done
#   python recipes/stress/report.py bench/results/mx_llama --seeds --spike-factor 1.2 --plot docs/mx_llama_val_loss.png
# Extra arguments are config overrides passed to every run (section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
CONFIG=${CONFIG:-recipes/stress/configs/cpu_bench.yaml}
OUT=${OUT:-bench/results/mx_llama}
LOW=${LOW:-mxfp4}
SEEDS=${SEEDS:-"0 1 2 3 4"}
METHODS=${METHODS:-"bf16 fixed gnmr random adapt gsnr"}
mkdir -p "$OUT"
for seed in $SEEDS; do
  for m in $METHODS; do
    run="$OUT/s$seed/$m"
    if [ -f "$run/result.json" ]; then echo "skip s$seed $m (done)"; continue; fi
    mkdir -p "$OUT/s$seed"
    exec 9> "$run.lock"
    if ! flock -n 9; then echo "skip s$seed $m (another worker has it)"; exec 9>&-; continue; fi
    if [ -f "$run/result.json" ]; then exec 9>&-; continue; fi
    echo "=== s$seed $m $(date -Is)"
    python recipes/stress/pretrain.py --config "$CONFIG" --method "$m" --low "$LOW" --output_dir "$run" --resume \
      data.cache_dir="$OUT/.cache" train.dtype=float32 train.logging_steps=1 train.seed=$seed \
      baselines.random_seed=$seed gnmr.max_active=1 mx.quantize_norms=true "$@" > "$run.log" 2>&1 \
      || { echo "FAILED s$seed $m (see $run.log)"; exec 9>&-; continue; }
    tail -n 2 "$run.log"
    exec 9>&-
  done
done
