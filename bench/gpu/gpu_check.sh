#!/usr/bin/env bash
# GPU readiness check: on one GPU, in at most 10 minutes, runs `pytest -m gpu`, bench/cost/switch.py's
# GPU branch, bench/gpu/gpu_13b_shape.py (bf16 / int8 / gnmr step time and peak device memory) and 20 steps of
# each SmolLM2 recipe on CUDA, bench/cost/train_memory.py (NF4 / plan / BF16 weights and training peak on SmolLM2 and
# Gemma 3), then writes OUT/gpu_check.json and OUT/gpu_check.md (one table) plus a log
# per stage under OUT/logs. The stages and their time limits are in bench/gpu/gpu_check.py.
#
#   bash bench/gpu/gpu_check.sh [--out runs/gpu_check]             # on a CUDA machine
#   bash bench/gpu/gpu_check.sh --dry-run --out /tmp/gpu_check     # every stage at its smallest size on the CPU
#
# Extra arguments go to bench/gpu/gpu_check.py (--budget-s, --recipe-steps). Exit status 0 when every stage
# passed, 1 when one failed, timed out or was skipped, 2 without a GPU (and without --dry-run).
set -euo pipefail
cd "$(dirname "$0")/../.."
# the project's environment when there is one here and none is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
args=("$@")
case " $* " in *" --out "*|*" --out="*) ;; *) args+=(--out runs/gpu_check) ;; esac
case " $* " in *" --dry-run "*) export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES="" ;; esac
status=0
python bench/gpu/gpu_check.py "${args[@]}" || status=$?
[ "$status" = 2 ] && exit 2  # no GPU (and no --dry-run)

# Extra stages (issue 49), outside gpu_check.py's budgeted table; each writes OUT/logs/NAME.log and one line in
# OUT/extra_stages.txt. Nothing depends on them. They run on a GPU; --dry-run leaves them out unless EXTRA_STAGES=1
# (minutes on a CPU: the real SmolLM2), and SKIP_EXTRA=1 always does.
#   sharded:   planned-ladder-nf4 on SmolLM2 under FSDP2 (torchrun, one rank per GPU, two on a CPU) against one
#              process: the same plan, and the gathered 4-bit bytes equal to the unsharded model's (bitsandbytes
#              issue #1945: NaN canonicalisation of packed 4-bit bytes on CUDA); losses in the log
#   step_cost: python bench/cost/step_cost.py run --short (if the bench exists)
out=$(python - "${args[@]}" <<'PY'
import sys; a = sys.argv[1:]
print(next((x.split("=", 1)[1] for x in a if x.startswith("--out=")), a[a.index("--out") + 1] if "--out" in a else "runs/gpu_check"))
PY
)
mkdir -p "$out/logs"
stage() {  # stage NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    if timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1; then echo "$name: passed" >> "$out/extra_stages.txt"
    else local rc=$?; echo "$name: failed (exit $rc, log $out/logs/$name.log)" >> "$out/extra_stages.txt"; status=1; fi
}
sharded_stage() {
    local d="$out/sharded" n
    n=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
    local common=(--config recipes/smollm2-135m/planned-ladder-nf4.yaml --model smollm2-135m-instruct --max_steps 3
                  --num_generated 16 --per_device_train_batch_size 2 --max_seq_len 64 --data_dir "$d/data"
                  --disable_tqdm true)
    PYTHONPATH=. python tests/sharded_planned_worker.py "${common[@]}" --output_dir "$d/one" &&
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node "$n" tests/sharded_planned_worker.py \
        "${common[@]}" --output_dir "$d/fsdp" --fsdp full_shard --fsdp_config recipes/accelerate/fsdp2-qlora.json &&
    python - "$d" <<'PY'
import json, sys
d = sys.argv[1]
one, two = (json.load(open(f"{d}/{x}/rank0.json")) for x in ("one", "fsdp"))
loss = lambda x: [e["loss"] for e in json.load(open(f"{d}/{x}/trainer_state.json"))["log_history"] if "loss" in e]
print("losses one process:", loss("one"), "fsdp2:", loss("fsdp"))
print("sharded:", two["shards"])
assert two["shards"]["4bit_dtensor"] == two["shards"]["4bit"] > 0, "the 4-bit weights were not sharded"
assert {k: v for k, v in one["plan"].items() if k != "ranks_agreed"} == \
    {k: v for k, v in two["plan"].items() if k != "ranks_agreed"}, "another plan under FSDP2"
bad = [k for k in one["digests"] if one["digests"][k] != two["digests"].get(k)]
assert not bad, f"{len(bad)} of {len(one['digests'])} gathered 4-bit weights differ from the unsharded ones: {bad[:3]}"
print("same plan; all", len(bad) or len(one["digests"]), "gathered 4-bit weights equal the unsharded ones")
PY
}
dry=0; case " $* " in *" --dry-run "*) dry=1 ;; esac
if [ "${SKIP_EXTRA:-0}" != 1 ] && { [ "$dry" = 0 ] || [ "${EXTRA_STAGES:-0}" = 1 ]; }; then
    : > "$out/extra_stages.txt"
    export out; export -f sharded_stage
    stage sharded 600 bash -c sharded_stage
    if [ -f bench/cost/step_cost.py ]; then stage step_cost 600 python bench/cost/step_cost.py run --short; fi
    cat "$out/extra_stages.txt"
fi
exit "$status"
