#!/usr/bin/env bash
# The CPU stress bench (docs/stress.md): every method of recipes/stress/pretrain.py one after the other,
# then the report. Resumable: a method whose result.json exists is skipped, an interrupted one resumes
# from its latest checkpoint. Start it in the background:
#   nohup bash bench/stress/stress_bench.sh > runs/stress/bench.log 2>&1 &
# Extra arguments are config overrides passed to every run (section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
CONFIG=${CONFIG:-recipes/stress/configs/cpu_bench.yaml}
OUT=${OUT:-runs/stress/bench}
METHODS=${METHODS:-"bf16 fixed8 fixed4 gnmr adapt gsnr random"}
mkdir -p "$OUT"
for m in $METHODS; do
  if [ -f "$OUT/$m/result.json" ]; then echo "skip $m (done)"; continue; fi
  echo "=== $m $(date -Is)"
  python recipes/stress/pretrain.py --config "$CONFIG" --method "$m" --output_dir "$OUT/$m" --resume \
    data.cache_dir="$OUT/../.cache" "$@" > "$OUT/$m.log" 2>&1
  tail -n 2 "$OUT/$m.log"
done
python recipes/stress/report.py "$OUT" --out "$OUT/tables.md" --plot "$OUT/val_loss.png"
