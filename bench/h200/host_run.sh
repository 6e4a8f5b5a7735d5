#!/usr/bin/env bash
# Issue 12: the offline run after trimming the host's work per decode step (no copy of each request's output ids
# into its sampling row, step inputs through array.array), with Python's collector threshold as it is and at 20000
# (one process each, with the host's wait and garbage-collection trace).
#   bash bench/h200/host_run.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
for flag in "" "--gc-threshold 20000"; do
  name=offline$(echo $flag | tr -d ' -')
  timeout 150 python3 bench/offline_gpu.py --trace $flag --out $OUT/$name.md > $OUT/$name.log 2>&1
  echo "offline $flag rc=$?"; grep -v Warn $OUT/$name.log | grep -v "^|---" | tail -11
done
