#!/usr/bin/env bash
# Issue 12, device run 2: GPU tests of the engine (async scheduling, dense prefill), the decode step with
# asynchronous and synchronous scheduling side by side, and where a step's device time goes.
set -u
export PYTHONUNBUFFERED=1
TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs -x \
  tests/unit/test_engine_gpu.py tests/kernels/test_backend.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -15 $OUT/gpu-tests.log
for mode in async sync; do
  flag=$([ $mode = sync ] && echo --sync)
  timeout 150 python3 bench/decode_step.py --batches 1,8,64 --context 1024 $flag --out $OUT/decode-$mode.md \
    > $OUT/decode-$mode.log 2>&1; echo "decode $mode rc=$?"; tail -7 $OUT/decode-$mode.log
done
timeout 120 python3 bench/h200/step_profile.py --batches 1,64 > $OUT/profile.log 2>&1; echo "profile rc=$?"
cat $OUT/profile.log | grep -v Warning
