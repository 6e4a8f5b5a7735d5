#!/usr/bin/env bash
# Issue 12's GPU measurements in one device call: prefill attention candidates, the decode step against its floor
# (batch 1/8/64, context 1k), offline 256 x 1024/1024 against the roofline.
#   bash bench/h200/speed.sh LABEL [TREE]   (TREE: a copy of another commit's tree to measure, e.g. .baseline)
set -u
label=${1:-run}
tree=${2:-.}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
if [ -z "${SKIP_PROBE:-}" ]; then
  timeout 150 python3 bench/h200/prefill_probe.py ${PROBE_ARGS:-} > $OUT/$label-prefill.log 2>&1; echo "probe rc=$?"
  cat $OUT/$label-prefill.log
fi
if [ -n "${GPU_TESTS:-}" ]; then
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs $GPU_TESTS \
    > $OUT/$label-gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -15 $OUT/$label-gpu-tests.log
fi
cd $tree
timeout 200 python3 bench/decode_step.py --batches 1,8,64 --context 1024 --out $OUT/$label-decode.md \
  > $OUT/$label-decode.log 2>&1; echo "decode rc=$?"; tail -8 $OUT/$label-decode.log
timeout 220 python3 bench/offline_gpu.py --out $OUT/$label-offline.md > $OUT/$label-offline.log 2>&1
echo "offline rc=$?"; tail -8 $OUT/$label-offline.log
