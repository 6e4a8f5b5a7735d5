#!/usr/bin/env bash
# Issue 12: GEMM algorithms picked by timing at start-up (engine/kernels/lt_gemm.py). The GPU tests, the decode
# step with and without the tuning (which prints the tuning's table) and, first, optionally the offline run in fresh
# engines, alternating without and with it (needs an H200: the workload's K/V does not fit an H100):
#   [OFFLINE_RUNS=4] bash bench/h200/gemm_tuning_run.sh [tests|notests] [offline|nooffline] [decode|nodecode]
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels/test_lt_gemm.py > $OUT/lt-tests.log 2>&1 || { echo "lt_gemm tests failed:"; tail -40 $OUT/lt-tests.log; exit 1; }
tail -1 $OUT/lt-tests.log
[ "${1:-tests}" = tests ] && bash bench/h200/gpu_tests.sh
if [ "${2:-nooffline}" = offline ]; then
  n=0
  flags=(--no-gemm-tuning --gemm-tuning --no-gemm-tuning --gemm-tuning)
  for flag in "${flags[@]:0:${OFFLINE_RUNS:-4}}"; do
    n=$((n + 1))
    timeout 110 python3 bench/offline_gpu.py $flag > $OUT/offline-$n.log 2>&1; echo "offline $n $flag rc=$?"
    grep -E "^\| 1 |^read bandwidth|engine start" $OUT/offline-$n.log
    [ $n = 2 ] && grep -E "^\| 8192 x |^\| 256 x " $OUT/offline-$n.log
  done
fi
if [ "${3:-decode}" = decode ]; then
  for flag in --no-gemm-tuning --gemm-tuning; do
    log=$OUT/decode-step$flag.log
    timeout 200 python3 bench/decode_step.py --batches 64,256 --context 1024 $flag > $log 2>&1
    echo "decode_step $flag rc=$?"; grep -E "^\| [0-9]+ x |^\| [0-9]+ \|" $log
  done
fi
