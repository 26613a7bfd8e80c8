#!/usr/bin/env bash
# The checks that need a GPU, for a machine with CUDA, torch and pytest (no torch_xla):
# the native path on CUDA against eager on CUDA (tests/test_native_cuda.py), the
# differential fuzzer's cuda path under both executors, bench/backward_memory.py
# measured by the CUDA allocator, the memory plan's error (bench/plan_accuracy.py) and
# step time against Inductor (bench/native_speed.py). CI has no GPU; run this where one
# is lent.
#
#   tools/gpu_check.sh [OUT_DIR]      (logs and JSON land in OUT_DIR, default gpu-check-out)
#
# Each part has its own time limit (GPU_CHECK_* below) so that the whole fits a short
# lease; a part cut off by its limit says so in its log. Exit status: 0 if no part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
workers="${GPU_CHECK_WORKERS:-8}"         # pytest-xdist workers and fuzz shards
fuzz_per_shard="${GPU_CHECK_FUZZ:-30}"   # scenarios per shard and executor
status=0

python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda,
            torch.cuda.get_device_name(0), "python", sys.version.split()[0])' | tee "$out/versions.log"
python3 -c 'import transformers; print("transformers", transformers.__version__)' >>"$out/versions.log" 2>&1
python3 -c 'import torchvision; print("torchvision", torchvision.__version__)' >>"$out/versions.log" 2>&1

xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n "$workers")
timeout "${GPU_CHECK_TESTS_S:-300}" python3 -m pytest -q -rfE -p no:cacheprovider "${xdist[@]}" \
    tests/test_native_cuda.py >"$out/cuda-tests.log" 2>&1 || { echo "cuda tests: exit $?"; status=1; }
tail -n 3 "$out/cuda-tests.log"

for executor in aten inductor; do
    pids=()
    for shard in $(seq 0 $((workers - 1))); do
        start=$((30000 + shard * 1000))
        DONATE_XLA_NATIVE_COMPILER=$executor timeout "${GPU_CHECK_FUZZ_S:-150}" \
            python3 tests/xla_fuzz.py --path cuda --start "$start" --count "$fuzz_per_shard" --chunk "$fuzz_per_shard" \
            --out "$out/fuzz-$executor-$shard.json" >"$out/fuzz-$executor-$shard.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    python3 - "$out" "$executor" <<'PY'
import glob, json, sys
out, executor = sys.argv[1], sys.argv[2]
totals, failed = {}, []
for path in sorted(glob.glob(f"{out}/fuzz-{executor}-*.json")):
    with open(path) as f:
        data = json.load(f)
    for key, value in data["summary"].items():
        totals[key] = totals.get(key, 0) + value
    failed += [o for o in data["outcomes"] if o["status"] == "failed"]
print(f"fuzz cuda [{executor}]: {totals} (shards that hit their time limit write no JSON)")
for o in failed[:5]:
    print(f"  seed {o['seed']}: {o['detail'][:300]}")
PY
done

if [ "${GPU_CHECK_BENCH_S:-150}" != 0 ]; then  # 0: skip the benchmark
    timeout "${GPU_CHECK_BENCH_S:-150}" python3 bench/backward_memory.py --device cuda \
        >"$out/backward-memory.log" 2>&1 || { echo "backward_memory: exit $?"; status=1; }
    cat "$out/backward-memory.log"
fi
if [ "${GPU_CHECK_PLAN_S:-120}" != 0 ]; then
    timeout "${GPU_CHECK_PLAN_S:-120}" python3 bench/plan_accuracy.py --device cuda --meta --json "$out/plan-accuracy.json" \
        >"$out/plan-accuracy.log" 2>&1 || { echo "plan_accuracy: exit $?"; status=1; }
    grep -E "predicted|largest|failed|skipped" "$out/plan-accuracy.log"
fi

if [ "${GPU_CHECK_SPEED_S:-200}" != 0 ]; then
    timeout "${GPU_CHECK_SPEED_S:-200}" python3 bench/native_speed.py --device cuda --models 1,3 \
        --repeats "${GPU_CHECK_SPEED_REPEATS:-2}" --steps 10 --json "$out/native-speed.json" \
        >"$out/native-speed.log" 2>&1 || { echo "native_speed: exit $?"; status=1; }
    cat "$out/native-speed.log"
fi
exit $status
