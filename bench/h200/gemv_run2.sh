#!/usr/bin/env bash
# Batch-1 fusions (rms_norm_gemv, gemv with SiLU-and-mul) and the offline prefill profile, one device call:
# GPU tests, decode step after and before (TREE), per-kernel batch-1 profile, prefill-step profile.
#   bash bench/h200/gemv_run2.sh [TREE]
set -u
tree=${1:-.before}
export PYTHONUNBUFFERED=1
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs \
  tests/kernels/test_gemv.py tests/unit/test_engine_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -4 $OUT/gpu-tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu-tests.log | head
timeout 100 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/after-decode.md > $OUT/after.log 2>&1
echo "after rc=$?"; tail -5 $OUT/after.log
(cd $tree && timeout 100 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/before-decode.md \
  > $OUT/before.log 2>&1; echo "before rc=$?"; tail -5 $OUT/before.log)
timeout 90 python3 bench/h200/step_profile.py --batches 1 > $OUT/step-profile.log 2>&1
echo "step profile rc=$?"; grep -v Warn $OUT/step-profile.log | tail -24
timeout 120 python3 bench/h200/mixed_profile.py > $OUT/mixed-profile.log 2>&1
echo "mixed profile rc=$?"; grep -v Warn $OUT/mixed-profile.log | tail -48
if [ -d .moe ]; then  # issue 15's MoE kernel figure, from the MoE branch's tree
  (cd .moe && TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header \
     tests/kernels/test_moe.py > $OUT/moe-tests.log 2>&1; echo "moe gpu tests rc=$?"; tail -3 $OUT/moe-tests.log
   timeout 150 python3 bench/moe_kernel.py --sweep --out $OUT/moe_kernel.json > $OUT/moe.log 2>&1
   echo "moe bench rc=$?"; tail -30 $OUT/moe.log)
fi
