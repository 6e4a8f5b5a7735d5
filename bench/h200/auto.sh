#!/usr/bin/env bash
# Device run 5 of issue 11: --kv-backend auto on the H200.
#   bash bench/h200/auto.sh tests    (carry .whl-nixl = nixl + nixl-cu13): the auto connector's GPU test (CUDA IPC
#                                    on this host, NIXL for another host or memory kind, a plain nixl node reading
#                                    an auto node) and the ipc GPU tests
#   bash bench/h200/auto.sh cluster  (carry .whl = cluster wheels, .carry-mooncake): the whole P/D path with auto
#                                    nodes whose cross-host backend is Mooncake (ipc is what they must choose here)
set -u
export PYTHONUNBUFFERED=1
if [ "$1" = tests ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-nixl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header -rs tests/kvtransfer/test_same_host_gpu.py \
    tests/kvtransfer/test_ipc_gpu.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -25 $OUT/gpu-tests.log
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
  bash .carry-mooncake/setup.sh /tmp/mc > $OUT/mooncake-setup.log 2>&1 && . /tmp/mc/env.sh || exit 1
  timeout 420 python3 bench/gpu_cluster.py --out $OUT/gpu-cluster --kv-backend auto --kv-cross-host-backend mooncake \
    --time-budget-s 150 --short-concurrency 1,64 --long-concurrency 1 --skip-hf \
    --node-args "--mooncake-protocol nvlink_intra" --node-env MC_INTRANODE_NVLINK=1 \
    > $OUT/gpu-cluster.log 2>&1; echo "gpu-cluster rc=$?"
  grep -h "KV peer\|runs without ipc" $OUT/gpu-cluster/logs/*.log | cut -c1-200 | head -5
  gzip -q $OUT/gpu-cluster/logs/*.log; tail -32 $OUT/gpu-cluster.log
fi
