#!/usr/bin/env bash
# Device run 1 of issue 11 on the H200 (nixl + nixl-cu13 wheels carried in .whl): the GPU tests of the KV paths and
# the engine, then the handoff bandwidth per backend. Logs and JSON go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -x --no-header -rs \
  tests/kvtransfer/test_gpu_checksum.py tests/kvtransfer/test_ipc_gpu.py tests/kvtransfer/test_nixl_options.py \
  tests/unit/test_gpu_memory.py tests/unit/test_gpu_memory_share.py tests/unit/test_engine_gpu.py tests/kernels \
  > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$?"; tail -15 $OUT/gpu-tests.log
# UCX's default GET gate (what NIXL did before): 16k tokens only, few repeats (it crawls)
timeout 60 python3 bench/kv_handoff_gpu.py --backends nixl --prompt-tokens 16384 --repeats 3 --warmup 1 \
  --variant 'name=ucx-default ucx_config=CUDA_IPC_ENABLE_GET_ZCOPY=n' --json $OUT/handoff-ucx-default.json \
  > $OUT/handoff-ucx-default.log 2>&1; echo "ucx-default rc=$?"; tail -8 $OUT/handoff-ucx-default.log
timeout 280 python3 bench/kv_handoff_gpu.py --backends nixl,nixl-write,ipc \
  --variant 'name=default' \
  --variant 'name=tls-no-emulation ucx_config=PROTO_EMULATION_ENABLE=n env:UCX_TLS=cuda_ipc,cuda_copy,tcp' \
  --json $OUT/handoff.json > $OUT/handoff.log 2>&1; echo "handoff rc=$?"; tail -40 $OUT/handoff.log
