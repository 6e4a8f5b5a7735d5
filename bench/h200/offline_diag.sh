#!/usr/bin/env bash
# Where the offline run's time around its prompt steps goes (issue 12): the run twice in one engine (the second
# warm), with the slowest prompt steps and the Triton compilations of each run; what a new prompt length costs
# cuDNN's dense attention on its first call.
#   bash bench/h200/offline_diag.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 60 python3 bench/h200/sdpa_first_call.py > $OUT/sdpa-first-call.log 2>&1; echo "sdpa rc=$?"
grep -v Warn $OUT/sdpa-first-call.log
timeout 240 python3 bench/offline_gpu.py --trace --repeat 2 --out $OUT/offline.md > $OUT/offline.log 2>&1
echo "offline rc=$?"; tail -20 $OUT/offline.log
