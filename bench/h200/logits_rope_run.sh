#!/usr/bin/env bash
# Issue 12 (offline >= 0.85): bf16 logits + fused RoPE/KV store against TREE (the tree before them), in one call:
# their GPU tests, then per tree the device timeline of the offline run's steps (bench/h200/decode_timeline.py)
# and the offline run itself, alternating trees.
#   bash bench/h200/logits_rope_run.sh [TREE]
set -u
tree=${1:-.baseline}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
cp bench/h200/decode_timeline.py $tree/bench/h200/
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels/test_kv_store.py tests/kernels/test_layers.py tests/unit/test_engine_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/gpu-tests.log; grep -E "^(FAILED|ERROR)|^E " $OUT/gpu-tests.log | head -12
for side in before after; do
  dir=$([ $side = before ] && echo $tree || echo .)
  (cd $dir && timeout 150 python3 bench/offline_gpu.py --trace > $OUT/offline-$side.log 2>&1; echo "offline $side rc=$?")
  grep -v -i warn $OUT/offline-$side.log | tail -14
  (cd $dir && timeout 150 python3 bench/h200/decode_timeline.py > $OUT/timeline-$side.log 2>&1; echo "timeline $side rc=$?")
  grep -E "^## |unprofiled|replay alone" $OUT/timeline-$side.log
done
