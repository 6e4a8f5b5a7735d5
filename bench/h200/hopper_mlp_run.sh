#!/usr/bin/env bash
# Issue 12: the MLP's gate_up GEMM with SiLU-and-mul in one Hopper kernel (engine/kernels/hopper_mlp.py). Its GPU
# tests, then (optionally) the offline run in fresh engines alternating without and with it (needs an H200: the
# workload's K/V does not fit an H100), then the decode step without and with it, then (optionally) the GPU suite:
#   [OFFLINE_RUNS=4] bash bench/h200/hopper_mlp_run.sh [offline|nooffline] [decode|nodecode] [suite|nosuite]
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import time, torch; from engine.kernels import hopper_mlp; t = time.time(); \
print('kernel built and loaded:', hopper_mlp.device_supported(torch.device('cuda')), f'{time.time() - t:.1f} s')"
TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels/test_hopper_mlp.py > $OUT/hopper-mlp-tests.log 2>&1 || { echo "tests failed:"; tail -40 $OUT/hopper-mlp-tests.log; exit 1; }
tail -1 $OUT/hopper-mlp-tests.log
[ "${PROBE_FIRST:-1}" = 1 ] && timeout 120 python3 bench/h200/hopper_mlp_probe.py 2>&1 | grep -v Warning
if [ "${1:-nooffline}" = offline ]; then
  n=0
  flags=(--no-fused-gate-up-silu --fused-gate-up-silu --no-fused-gate-up-silu --fused-gate-up-silu
         "--fused-gate-up-silu --fused-max-rows 8192" "--fused-gate-up-silu --fused-max-rows 8192")
  for flag in "${flags[@]:0:${OFFLINE_RUNS:-4}}"; do
    n=$((n + 1))
    timeout 110 python3 bench/offline_gpu.py --trace $flag > $OUT/offline-$n.log 2>&1; echo "offline $n $flag rc=$?"
    grep -E "^\| 1 |^read bandwidth|engine start|^steps with|decode-only" $OUT/offline-$n.log | cut -c1-250
  done
fi
if [ "${2:-decode}" = decode ]; then
  for flag in --no-fused-gate-up-silu --fused-gate-up-silu; do
    log=$OUT/decode-step$flag.log
    timeout 200 python3 bench/decode_step.py --batches 128,256 --context 1024 $flag > $log 2>&1
    echo "decode_step $flag rc=$?"; grep -E "^\| [0-9]+ x |^\| [0-9]+ \|" $log
  done
fi
[ "${3:-nosuite}" = suite ] && bash bench/h200/gpu_tests.sh
exit 0
