#!/usr/bin/env bash
# Issue 12: the offline run's steps with prompt tokens, in the run and alone (H200, 256 x 1024/1024):
#   [NUM_PROMPTS=256 MIXED_AFTER=10] bash bench/h200/mixed_run.sh
# the offline run with --trace; the device timeline of three steps with prompt tokens after MIXED_AFTER steps
# (decodes and a chunked prompt's continuation beside the fresh prompts); one such step alone (mixed_profile.py)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 120 python3 bench/offline_gpu.py --trace --num-prompts ${NUM_PROMPTS:-256} > $OUT/offline.log 2>&1; echo "offline rc=$?"
grep -E "^\| 1 |^steps|engine start|^host" $OUT/offline.log
timeout 200 python3 bench/h200/decode_timeline.py --num-prompts ${NUM_PROMPTS:-256} --mixed-after ${MIXED_AFTER:-10} --steps 3 --decode-warm-steps 2 \
  --wall-steps 10 --trace-dir $OUT/tl > $OUT/tl.log 2>&1; echo "timeline rc=$?"
sed -n '/steps with prompt/,/decode-only/p' $OUT/tl.log | head -60
timeout 120 python3 bench/h200/mixed_profile.py --decodes 128 2>&1 | grep -v -i warn > $OUT/mixed.log
echo "mixed profile rc=$?"; grep -A14 "^## " $OUT/mixed.log | head -40
# the decode-step goals on the same machine (ratios to the floor measured in the run)
timeout 150 python3 bench/decode_step.py --batches 1,8,64 --context 1024 > $OUT/decode_step.log 2>&1
echo "decode step rc=$?"; grep -E "^\||floor|TB/s" $OUT/decode_step.log | head -20
