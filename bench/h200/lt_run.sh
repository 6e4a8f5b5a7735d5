#!/usr/bin/env bash
# Issue 12, the decode GEMMs at M = 256: build and run lt_probe.cu (cuBLASLt heuristic + exhaustive sweep) and
# tma_probe.py on the device, with --offline then one offline run of this tree. Logs under $OUT.
#   bash bench/h200/lt_run.sh [--offline]
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
cublas=$(python3 -c "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) or list(nvidia.cublas.__path__)[0])" 2>/dev/null)
echo "cublas wheel: $cublas"
inc=""; lib=""
if [ -n "$cublas" ] && [ -e "$cublas/include/cublasLt.h" ]; then
  inc="-I$cublas/include"; lib="-L$cublas/lib -Xlinker -rpath=$cublas/lib"
  [ -e "$cublas/lib/libcublasLt.so" ] || ln -sf "$(ls $cublas/lib/libcublasLt.so.* | head -1)" /tmp/libcublasLt.so && lib="$lib -L/tmp"
fi
nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/lt_probe bench/h200/lt_probe.cu $inc $lib -lcublasLt 2>&1 | tail -5
echo "nvcc rc=${PIPESTATUS[0]}"
timeout 300 /tmp/lt_probe ${LT_ARGS:---all 256} > $OUT/lt-probe.log 2>&1; echo "lt_probe rc=$?"
grep -E "^M=|heuristic's first|^ " $OUT/lt-probe.log | grep -vE "^  +[0-9.]+ us .*#-?[0-9]+ algo" | head -30
grep -E "^M=| us " $OUT/lt-probe.log | awk '/^M=/{print; n=0; next} n<3 {print; n++}'
(cd bench/h200 && timeout 120 python3 tma_probe.py > $OUT/tma-probe.log 2>&1; echo "tma_probe rc=$?")
grep -E "^M=" $OUT/tma-probe.log | sed -E 's/err=[^ ]+ //g' | cut -c1-400
if [ "${1:-}" = "--offline" ]; then  # needs an H200: the workload's K/V does not fit an H100's 80 GB
  timeout 150 python3 bench/offline_gpu.py --trace > $OUT/offline-base.log 2>&1; echo "offline rc=$?"
  grep -E "^\| 1 |^steps with|^host time|engine start" $OUT/offline-base.log
fi
