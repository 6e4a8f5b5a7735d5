#!/usr/bin/env bash
# Issue 12: fresh prompts of one length attended in one dense call (engine/kernels/backend.py). The backend's and
# the engine's GPU tests, then the offline run (--trace) in fresh engines, alternating BEFORE (a `git archive`
# copy of the tree before, carried with the call) and this tree:
#   bash bench/h200/dense_batch_run.sh [BEFORE] [notests]
set -u
before=${1:-.baseline}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
[ "${2:-}" = notests ] || TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels/test_backend.py tests/unit/test_engine_gpu.py > $OUT/gpu-tests.log 2>&1
[ "${2:-}" = notests ] || { echo "gpu tests rc=$?"; tail -2 $OUT/gpu-tests.log; grep -E "^(FAILED|ERROR)|^E " $OUT/gpu-tests.log | head -12; }
n=0
for dir in $before . $before .; do
  n=$((n + 1))
  (cd $dir && timeout 100 python3 bench/offline_gpu.py --trace > $OUT/offline-$n.log 2>&1; echo "offline $n ($dir) rc=$?")
  grep -E "^\| 1 |^steps with|^host time|^read bandwidth|engine start" $OUT/offline-$n.log
done
timeout 120 python3 bench/h200/mixed_profile.py --decodes 128 2>&1 | grep -v -i warn > $OUT/mixed.log
echo "mixed profile rc=$?"; grep -E "^## |^\| [0-9.]+ \| [0-9.]+ \| [0-9]+ \| (cudnn|Memcpy|void at::native::elem|Memset)|unprofiled" $OUT/mixed.log
