#!/usr/bin/env bash
# Issue 12: the MLP's down projection split along K over a cluster (engine/kernels/hopper_mlp.py's down_proj).
# The probe (the engine's kernel against cuBLAS), the kernel's GPU tests, then on an H200 the offline run in fresh
# engines (neither kernel / both / gate_up+SiLU only / both), on an H100 (whose 80 GB cannot hold the offline
# run's K/V) the decode step without and with the down kernel:
#   bash bench/h200/down_run.sh [probe|noprobe] [RUNS]
set -u
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
[ "${1:-probe}" = probe ] && bash bench/h200/wgmma_run.sh ${PROBE_SHAPES:-256:down 128:down 64:down 512:down 256:o_proj} 2>&1 \
  | grep -v -E "^\s*$"
TRITON_INTERPRET=0 timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --no-header --tb=short \
  tests/kernels/test_hopper_mlp.py > $OUT/hopper-mlp-tests.log 2>&1 || { echo "tests failed:"; tail -60 $OUT/hopper-mlp-tests.log; exit 1; }
tail -1 $OUT/hopper-mlp-tests.log
if [[ "$gpu" == *H200* ]]; then
  neither="--no-fused-gate-up-silu --no-hopper-down-proj" both="--fused-gate-up-silu --hopper-down-proj"
  flags=("$neither" "$both" "--fused-gate-up-silu --no-hopper-down-proj" "$both" "$neither" "$both")
  for n in $(seq 1 "${2:-4}"); do
    flag=${flags[$((n - 1))]}
    timeout 115 python3 bench/offline_gpu.py --trace $flag > $OUT/offline-$n.log 2>&1; echo "offline $n [$flag] rc=$?"
    grep -E "^\| 1 |^read bandwidth|engine start|^steps with|decode-only" $OUT/offline-$n.log | cut -c1-250
  done
elif [ "${DECODE_BATCHES:-}" != none ]; then
  for flag in --no-hopper-down-proj --hopper-down-proj; do
    log=$OUT/decode-step$flag-$RANDOM.log
    timeout 150 python3 bench/decode_step.py --batches ${DECODE_BATCHES:-64,256} --context 1024 $flag > $log 2>&1
    echo "decode_step $flag rc=$?"; grep -E "^\| [0-9]+ x |^\| [0-9]+ \|" $log
  done
fi
exit 0
