#!/usr/bin/env bash
# Issue 12 on an H100 (the offline workload's K/V does not fit its 80 GB): the engine's GPU tests on this tree, the
# decode step at batch 1/8/64/256 (context 1k) against its floor, and the offline run at 128 prompts (fits) with
# --trace, for where a run's time goes on this card. Logs under $OUT.
#   bash bench/h200/h100_check.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
bash bench/h200/gpu_tests.sh
timeout 150 python3 bench/decode_step.py --batches 1,8,64,256 --context 1024 --out $OUT/decode.md > $OUT/decode.log 2>&1
echo "decode rc=$?"; tail -8 $OUT/decode.log
timeout 150 python3 bench/offline_gpu.py --num-prompts 128 --trace > $OUT/offline-128.log 2>&1; echo "offline rc=$?"
grep -E "^\| 1 |^steps with|^host |roofline|tok/s" $OUT/offline-128.log | cut -c1-300 | head -12
