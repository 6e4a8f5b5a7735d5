#!/usr/bin/env bash
# Issue 12 (offline >= 0.85): the device timeline of the offline run's steps (bench/h200/decode_timeline.py), traces
# in $OUT, then the offline run itself with --trace.
#   bash bench/h200/timeline_run.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 200 python3 bench/h200/decode_timeline.py --trace-dir $OUT > $OUT/timeline.log 2>&1
echo "timeline rc=$?"; grep -v -i "warn" $OUT/timeline.log | tail -150
