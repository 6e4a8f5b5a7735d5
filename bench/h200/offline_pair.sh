#!/usr/bin/env bash
# Issue 12, device run 3: offline 256 x 1024/1024 with asynchronous and synchronous scheduling back to back,
# the prefill probe at 8k (the engine's dense path), the decode partition sweep.
set -u
export PYTHONUNBUFFERED=1
for mode in async sync; do
  flag=$([ $mode = sync ] && echo --sync)
  timeout 170 python3 bench/offline_gpu.py $flag --out $OUT/offline-$mode.md > $OUT/offline-$mode.log 2>&1
  echo "offline $mode rc=$?"; tail -3 $OUT/offline-$mode.log
done
timeout 60 python3 bench/h200/prefill_probe.py --lengths 8192 2>&1 | grep -v -i "warn\|out = call" > $OUT/prefill.log
echo "probe rc=$?"; cat $OUT/prefill.log
timeout 120 python3 bench/h200/decode_sweep.py 2>&1 | grep -v "^  " > $OUT/decode-sweep.log; echo "sweep rc=$?"
grep "^|\|bandwidth" $OUT/decode-sweep.log
