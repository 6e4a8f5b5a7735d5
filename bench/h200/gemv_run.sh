#!/usr/bin/env bash
# Batch-1 GEMV (engine/kernels/gemv.py): its configs against cuBLAS, its GPU tests, then the decode step before
# (TREE, a copy of the tree without it) and after, back to back in one device call.
#   bash bench/h200/gemv_run.sh [TREE]
set -u
tree=${1:-.before}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 200 python3 bench/h200/gemv_probe.py > $OUT/gemv-probe.log 2>&1; echo "probe rc=$?"; grep -v Warn $OUT/gemv-probe.log
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs \
  tests/kernels/test_gemv.py tests/unit/test_engine_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -6 $OUT/gpu-tests.log
timeout 100 python3 bench/decode_step.py --batches 1,8 --context 1024 --out $OUT/after-decode.md > $OUT/after.log 2>&1
echo "after rc=$?"; tail -5 $OUT/after.log
(cd $tree && timeout 100 python3 bench/decode_step.py --batches 1,8 --context 1024 --out $OUT/before-decode.md \
  > $OUT/before.log 2>&1; echo "before rc=$?"; tail -5 $OUT/before.log)
timeout 200 python3 bench/offline_gpu.py --trace --out $OUT/offline.md > $OUT/offline.log 2>&1
echo "offline rc=$?"; tail -5 $OUT/offline.log
