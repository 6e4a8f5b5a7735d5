#!/usr/bin/env bash
# The engine's GPU tests on the device (kernels, engine, speculative decoding), log in $OUT/gpu-tests.log; prints the
# summary and the failures. The files that need Redis (not on the device) are left out.
#   bash bench/h200/gpu_tests.sh
TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels tests/unit/test_engine_gpu.py tests/unit/test_spec_decode_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/gpu-tests.log; grep -E "^(FAILED|ERROR)|^E " $OUT/gpu-tests.log | head -12
