#!/usr/bin/env bash
# Issue 12: the GPU tests of the tree, then the offline run with the caching allocator's counters (does a prompt
# step's launch wait for the device because the allocator frees cached blocks?), as configured and with
# expandable segments.
#   bash bench/h200/alloc_run.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
bash bench/h200/gpu_tests.sh
for alloc in "" "expandable_segments:True"; do
  name=offline$(echo $alloc | tr -d ':')
  PYTORCH_CUDA_ALLOC_CONF=$alloc timeout 150 python3 bench/offline_gpu.py --trace --out $OUT/$name.md > $OUT/$name.log 2>&1
  echo "offline alloc=$alloc rc=$?"; grep -v Warn $OUT/$name.log | grep -v "^|---" | tail -9
done
