#!/usr/bin/env bash
# Issue 12: build and run the hand-written Hopper GEMM probe (wgmma_probe.cu) against cuBLAS on the device.
#   bash bench/h200/wgmma_run.sh [M ...]     (default 256)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
# the device's CUDA toolkit has cuBLAS (the earlier lookup of the nvidia-cublas wheel found nothing there)
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe bench/h200/wgmma_probe.cu -lcublas 2>&1 | grep -v "^$" | head -20
echo "nvcc rc=${PIPESTATUS[0]}"
# arguments: M or M:shape (e.g. 8192:gate_up+silu_and_mul)
for arg in "${@:-256}"; do
  timeout 200 /tmp/wgmma_probe ${arg%%:*} $([ "${arg#*:}" != "$arg" ] && echo "${arg#*:}") 2>&1 | grep -v "CTAs resident" \
    | tee -a $OUT/wgmma.log; echo "probe $arg rc=${PIPESTATUS[0]}"
done
