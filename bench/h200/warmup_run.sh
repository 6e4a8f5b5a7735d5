#!/usr/bin/env bash
# Issue 12, the offline run's prompt steps: kernels that do not specialise on a step's shape and the start-up
# warm-up (GPU tests, the offline run twice in one engine), the decode step before (TREE, the tree without the
# change) and after, and where a batch-256 decode step's time goes (the offline run's decode shape).
#   bash bench/h200/warmup_run.sh [TREE]
set -u
tree=${1:-.before}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
bash bench/h200/gpu_tests.sh
timeout 240 python3 bench/offline_gpu.py --trace --repeat 2 --out $OUT/offline.md > $OUT/offline.log 2>&1
echo "offline rc=$?"; grep -v Warn $OUT/offline.log | tail -16
timeout 90 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/after-decode.md > $OUT/after.log 2>&1
echo "after rc=$?"; tail -5 $OUT/after.log
(cd $tree && timeout 90 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/before-decode.md \
  > $OUT/before.log 2>&1; echo "before rc=$?"; tail -5 $OUT/before.log)
timeout 90 python3 bench/h200/step_profile.py --batches 256 --context 1536 --steps 3 > $OUT/profile-256.log 2>&1
echo "profile rc=$?"; grep -v Warn $OUT/profile-256.log | head -24
