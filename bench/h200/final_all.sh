#!/usr/bin/env bash
# The session's last device call (2026-12-03, afternoon), in priority order: the GPU tests of the merged tree, the
# decode step against its floor (issue 12), FP8 vs bf16 KV at batch 64 x 8k (issue 16), n-gram speculation at
# batch 1 (issue 16), structured output's cost per token (issue 16, xgrammar wheels carried in .whl-xgr), the
# offline workload is left out: the device time left did not cover it (it ran earlier in the session).
#   bash bench/h200/final_all.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-xgr/*.whl \
  && export PYTHONPATH=/tmp/site
TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -x \
  tests/kernels tests/unit/test_engine_gpu.py tests/unit/test_spec_decode_gpu.py tests/unit/test_fp8_kv_cache.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu-tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu-tests.log | head -5
timeout 75 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/decode.md > $OUT/decode.log 2>&1
echo "decode rc=$?"; tail -5 $OUT/decode.log
for kv in auto fp8; do
  timeout 65 python3 bench/decode_step.py --batches 64 --context 8192 --kv-cache-dtype $kv --out $OUT/decode-8k-$kv.md \
    > $OUT/decode-8k-$kv.log 2>&1; echo "decode 8k $kv rc=$?"; tail -3 $OUT/decode-8k-$kv.log
done
timeout 80 python3 bench/spec_decode.py --output-len 128 --out $OUT/spec_decode.json > $OUT/spec.log 2>&1
echo "spec rc=$?"; tail -12 $OUT/spec.log
timeout 75 python3 bench/structured_output.py --batches 1,16 --steps 32 --context 256 \
  --out $OUT/structured_output.md > $OUT/structured.log 2>&1; echo "structured rc=$?"
cat $OUT/structured_output.md 2>/dev/null || tail -20 $OUT/structured.log
