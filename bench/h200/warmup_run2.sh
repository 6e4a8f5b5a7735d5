#!/usr/bin/env bash
# Issue 12, after the warm-up change: the GPU tests (a mixed step's launch must not synchronise), the offline
# run with the host's launch times, and where a batch-256 decode step's time goes (per kernel, and the decode
# attention kernel's configurations at the offline run's shapes).
#   bash bench/h200/warmup_run2.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
bash bench/h200/gpu_tests.sh
timeout 150 python3 bench/offline_gpu.py --trace --out $OUT/offline.md > $OUT/offline.log 2>&1
echo "offline rc=$?"; grep -v Warn $OUT/offline.log | tail -10
timeout 100 python3 bench/h200/step_profile.py --batches 256 --context 1536 --steps 3 > $OUT/profile-256.log 2>&1
echo "profile rc=$?"; grep -v Warn $OUT/profile-256.log | head -26
timeout 120 python3 bench/h200/decode_sweep.py --large > $OUT/decode-sweep.log 2>&1
echo "sweep rc=$?"; grep -E "^\||read bandwidth" $OUT/decode-sweep.log | head -50
