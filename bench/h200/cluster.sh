#!/usr/bin/env bash
# Device run 2 of issue 11 on the H200 (cluster wheels in .whl, the trimmed Mooncake in .carry-mooncake): the whole
# P/D path with the ipc backend, the ipc handoff with the block-copy kernel, then Mooncake on GPU memory.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
timeout 400 python3 bench/gpu_cluster.py --out $OUT/gpu-cluster --kv-backend ipc --time-budget-s 370 \
  > $OUT/gpu-cluster.log 2>&1; echo "gpu-cluster rc=$?"; tail -45 $OUT/gpu-cluster.log
timeout 70 python3 bench/kv_handoff_gpu.py --backends ipc --repeats 10 --warmup 2 --json $OUT/handoff-ipc.json \
  > $OUT/handoff-ipc.log 2>&1; echo "handoff-ipc rc=$?"; tail -16 $OUT/handoff-ipc.log
( bash .carry-mooncake/setup.sh /tmp/mc > $OUT/mooncake.log 2>&1 && . /tmp/mc/env.sh \
  && timeout 40 python3 .carry-mooncake/smoke.py nvlink_intra >> $OUT/mooncake.log 2>&1 \
  && timeout 60 python3 bench/kv_handoff_gpu.py --backends mooncake --mooncake-protocol nvlink_intra --repeats 5 \
     --warmup 1 --variant 'name=nvlink_intra env:MC_INTRANODE_NVLINK=1' >> $OUT/mooncake.log 2>&1 ); \
  echo "mooncake rc=$?"; tail -14 $OUT/mooncake.log
