#!/usr/bin/env bash
# Device run 3 of issue 11 (cluster wheels in .whl): where the ipc handoff's time goes (bench/h200/ipc_probe.py:
# copy-kernel variants, the pieces of a read, the checksum), then the P/D latency with the decode node's phase
# timings (debug log).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
timeout 240 python3 bench/h200/ipc_probe.py --variants > $OUT/probe.jsonl 2> $OUT/probe.err; echo "probe rc=$?"
grep -v '"variant"' $OUT/probe.jsonl; tail -3 $OUT/probe.err
timeout 300 python3 bench/gpu_cluster.py --out $OUT/gpu-cluster --kv-backend ipc --time-budget-s 120 \
  --short-concurrency 1 --long-concurrency 1 --skip-hf --node-args "--log-level debug" \
  > $OUT/gpu-cluster.log 2>&1; echo "gpu-cluster rc=$?"; grep -E "first -> second|Handoff|OK|FAIL" $OUT/gpu-cluster.log
grep -hE "lease|pull |admitted" $OUT/gpu-cluster/logs/decode-*.log | cut -c1-200 | tail -40 > $OUT/decode-phases.txt
gzip -q $OUT/gpu-cluster/logs/*.log; tail -40 $OUT/decode-phases.txt
