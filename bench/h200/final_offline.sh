#!/usr/bin/env bash
# Issue 12 (offline >= 0.85), the final call of 2026-12-04: the engine's GPU tests (in .abc), then the offline run
# (--trace) in fresh engines, alternating trees: BEFORE (aaef64d, before the day's changes), .abc (AB with the
# batched dense prompts, since dropped), AB (ba63058: bf16 logits + fused RoPE/K/V store), BEFORE, .abc. Each tree is
# a `git archive` copy, carried with the call; run from .abc: bash .abc/bench/h200/final_offline.sh [BEFORE] [AB]
set -u
before=${1:-.baseline}
ab=${2:-.ab}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
(cd .abc && bash bench/h200/gpu_tests.sh)
n=0
for dir in $before .abc $ab $before .abc; do
  n=$((n + 1))
  (cd $dir && timeout 90 python3 bench/offline_gpu.py --trace > $OUT/offline-$n.log 2>&1; echo "offline $n ($dir) rc=$?")
  grep -E "^\| 1 |^steps with|^host time|^read bandwidth|engine start" $OUT/offline-$n.log
done
