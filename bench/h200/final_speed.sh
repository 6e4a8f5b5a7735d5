#!/usr/bin/env bash
# Issue 12, last device run: every GPU test of the engine and kernels on the final tree, then the decode step and
# the offline workload (asynchronous scheduling, the defaults).
set -u
export PYTHONUNBUFFERED=1
TRITON_INTERPRET=0 timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs \
  tests/unit/test_engine_gpu.py tests/kernels > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -6 $OUT/gpu-tests.log
timeout 120 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/decode.md > $OUT/decode.log 2>&1
echo "decode rc=$?"; tail -6 $OUT/decode.log
timeout 150 python3 bench/offline_gpu.py --out $OUT/offline.md > $OUT/offline.log 2>&1
echo "offline rc=$?"; tail -4 $OUT/offline.log
