#!/usr/bin/env bash
# Device run 4 of issue 11 (cluster wheels in .whl): after the handoff-latency changes. The GPU tests of the KV
# paths, the pieces of an ipc read, the two-process ipc handoff, then the whole P/D path (correctness, latency with
# the decode node's phase timings, serving vs colocated, transformers generate).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -x --no-header -rs tests/kvtransfer/test_gpu_checksum.py \
  tests/kvtransfer/test_ipc_gpu.py \
  > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -4 $OUT/gpu-tests.log
timeout 60 python3 bench/h200/ipc_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err; echo "probe rc=$?"; cat $OUT/probe.jsonl
timeout 70 python3 bench/kv_handoff_gpu.py --backends ipc --repeats 10 --warmup 2 --json $OUT/handoff-ipc.json \
  > $OUT/handoff-ipc.log 2>&1; echo "handoff-ipc rc=$?"; grep -E "^\| default \| (ipc|copy)" $OUT/handoff-ipc.log
timeout 360 python3 bench/gpu_cluster.py --out $OUT/gpu-cluster --kv-backend ipc --time-budget-s 320 \
  --node-args "--log-level debug" > $OUT/gpu-cluster.log 2>&1; echo "gpu-cluster rc=$?"
grep -hE "blocks; reserve|admitted -> " $OUT/gpu-cluster/logs/decode-*.log | cut -c1-220 > $OUT/decode-phases.txt
gzip -q $OUT/gpu-cluster/logs/*.log; head -30 $OUT/decode-phases.txt; tail -40 $OUT/gpu-cluster.log
