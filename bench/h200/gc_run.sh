#!/usr/bin/env bash
# Issue 12: the offline run with the engine's gc.freeze() after start-up and without it (one process each, with
# the host's wait and garbage-collection trace), then the decode step (the bench's single-GPU path).
#   bash bench/h200/gc_run.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
for flag in "" --gc-unfreeze; do
  timeout 150 python3 bench/offline_gpu.py --trace $flag --out $OUT/offline$flag.md > $OUT/offline$flag.log 2>&1
  echo "offline $flag rc=$?"; grep -v Warn $OUT/offline$flag.log | grep -v "^|---" | tail -11
done
timeout 120 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/decode.md > $OUT/decode.log 2>&1
echo "decode rc=$?"; tail -6 $OUT/decode.log
