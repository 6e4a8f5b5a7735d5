#!/usr/bin/env bash
# Issue 17 on one host with two GPUs (the nvidia-h200-x2 kind), in one device call: every figure of
# bench/results/multi-gpu-<date>.md, in the issue's order, each step under its own timeout and all of them under one
# budget (MGPU_BUDGET_S, default 560 s: a step that would start with under 30 s left is skipped and says so).
#
#   bash bench/h200/multi_gpu.sh [STEP ...]     # STEP of: tp-step tp-greedy handoff serving moe tests (default: all)
#
# Carry (64 MiB in all): .whl (the cluster wheels: starlette, uvicorn, click, redis, grpcio, protobuf), .carry-nixl
# (bench/h200/pack_nixl.sh) and .carry-mooncake; a missing one skips what needs it (the step says why).
# NCCL_NVLS_ENABLE is left as the machine sets it. What comes back in $OUT (5 files): results.md (every table, also
# printed last), handoff.json, handoff-mooncake.json, serving.json, logs.tar.gz (every step's log).
set -u
export PYTHONUNBUFFERED=1
budget_end=$((SECONDS + ${MGPU_BUDGET_S:-560}))
steps=${*:-tp-step tp-greedy handoff serving moe tests}
logs=/tmp/mgpu-logs
results=$OUT/results.md
mkdir -p $logs /tmp/site
: > $results

note() { echo "$*" | tee -a $results; }

# Wheels: what the serving step imports (and NIXL); PYTHONPATH keeps this checkout first for the worker ranks
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || note "wheels from .whl failed to install"
fi
[ -f .carry-nixl/nixl-site.tar.xz ] && tar -xJf .carry-nixl/nixl-site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site
mooncake=no
if [ -d .carry-mooncake ] && bash .carry-mooncake/setup.sh /tmp/mc > $logs/mooncake-setup.log 2>&1; then mooncake=yes; fi

{ echo "# issue 17 on $(hostname): $(date -u +%FT%TZ), steps: $steps"; echo '```'
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m 2>&1 | head -8
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count(),
"nccl", torch.cuda.nccl.version())'
  python3 -c 'import nixl._api; print("nixl: importable")' 2>&1 | tail -1
  echo "mooncake (carry-mooncake set up): $mooncake; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-<unset>}"
  echo '```'; } 2>&1 | tee -a $results

# run_step NAME LIMIT_S COMMAND...: COMMAND under `timeout` (at most what the budget has left), output in $logs/NAME.log
run_step() {
  local name=$1 limit=$2 left=$((budget_end - SECONDS)); shift 2
  if (( left < 30 )); then note "- $name: skipped, ${left} s of the budget left"; return 1; fi
  (( limit > left )) && limit=$left
  echo "[$(date +%T)] $name: up to ${limit} s" >&2
  local started=$SECONDS
  timeout -k 15 $limit "$@" > $logs/$name.log 2>&1
  local rc=$?
  note "- $name: exit $rc in $((SECONDS - started)) s$( ((rc == 124)) && echo ' (timed out)')"
  return $rc
}

# table FILE: the Markdown table lines (and the lines just above them) of a log into results.md
table() { grep -E '^\||^[A-Za-z].*(bandwidth|weights|skipped|pool|Correctness|Goodput|OK|FAIL)' "$1" >> $results; }

for step in $steps; do
  case $step in
  tp-step)  # 1. TP=2 decode step of the Llama-3.1-8B shape against the two-GPU floor, with its all-reduce time
    note $'\n## TP=2 decode step, Llama-3.1-8B shape (dummy bf16), against the floor of one of two GPUs'
    run_step tp-step 150 python3 bench/decode_step.py --tensor-parallel-size 2 --batches 1,64 --context 1024 \
      --steps 30 --out $logs/tp-step.md
    [ -f $logs/tp-step.md ] && cat $logs/tp-step.md >> $results || tail -5 $logs/tp-step.log >> $results ;;
  tp-greedy)  # 2. a TP=2 node's greedy tokens equal the TP=1 engine's on the same random weights
    note $'\n## TP=2 greedy == TP=1, Llama-3.1-8B shape (2 layers, random float32 checkpoint)'
    run_step tp-greedy 120 python3 bench/tp_gpu_check.py --shape llama-3.1-8b --num-layers 2 --max-tokens 16
    python3 - $logs/tp-greedy.log >> $results <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print("- prompt of %d tokens: token_exact %s, first difference %s, %d distinct tokens of %d"
              % (r["prompt_tokens"], r["token_exact"], r["first_difference"], r["distinct_tokens"], len(r["tp1_tokens"])))
PY
    tail -3 $logs/tp-greedy.log | grep -iE 'error|Traceback' >> $results ;;
  handoff)  # 3. prefill pool on GPU 0, decode pool on GPU 1, per backend, against a plain GPU 0 -> GPU 1 copy
    note $'\n## KV handoff, P on cuda:0 -> D on cuda:1 (x copy: over the contiguous cross-GPU copy; goal >= 0.8)'
    run_step handoff 130 python3 bench/kv_handoff_gpu.py --devices 0,1 --backends nixl,ipc --repeats 10 --warmup 2 \
      --json $OUT/handoff.json
    table $logs/handoff.log
    if [ $mooncake = yes ]; then
      run_step handoff-mooncake 70 bash -c ". /tmp/mc/env.sh && python3 bench/kv_handoff_gpu.py --devices 0,1 \
        --backends mooncake --mooncake-protocol nvlink_intra --repeats 5 --warmup 1 \
        --variant 'name=nvlink_intra env:MC_INTRANODE_NVLINK=1' --json $OUT/handoff-mooncake.json"
      table $logs/handoff-mooncake.log
    else note "- mooncake: skipped (no .carry-mooncake, or its setup failed: logs/mooncake-setup.log)"; fi ;;
  serving)  # 4. 1P1D on two GPUs vs two colocated engines on the same two GPUs, through the proxy
    note $'\n## Serving through the proxy: 1P1D (P cuda:0, D cuda:1) vs two colocated decode nodes (cuda:0, cuda:1)'
    left=$((budget_end - SECONDS - 40))
    run_step serving 330 python3 bench/gpu_cluster.py --out /tmp/mgpu-serving --gpus 2 --kv-backend ipc --skip-hf \
      --short-concurrency 16,64 --long-concurrency 4,16 --latency-runs 3 --goodput ttft:2000 tpot:50 \
      --time-budget-s $(( left < 300 ? (left > 60 ? left : 60) : 300 ))
    [ -f /tmp/mgpu-serving/results.md ] && cat /tmp/mgpu-serving/results.md >> $results
    [ -f /tmp/mgpu-serving/results.json ] && cp /tmp/mgpu-serving/results.json $OUT/serving.json ;;
  moe)  # 5. Qwen3-MoE shape (dummy bf16): expert parallelism over 2 GPUs against tensor parallelism
    for mode in tp ep; do
      note $'\n'"## Qwen3-30B-A3B shape (dummy bf16), $( [ $mode = ep ] && echo 'EP=2 (all-to-all)' || echo 'TP=2')"
      run_step moe-$mode 150 python3 bench/decode_step.py --shape qwen3-30b-a3b --tensor-parallel-size 2 \
        --batches 1,64 --context 1024 --steps 20 --out $logs/moe-$mode.md \
        $( [ $mode = ep ] && echo --enable-expert-parallel --all2all-backend all_to_all )
      [ -f $logs/moe-$mode.md ] && cat $logs/moe-$mode.md >> $results || tail -5 $logs/moe-$mode.log >> $results
    done ;;
  tests)  # 6. the GPU tests marked for several GPUs
    note $'\n## pytest -m multi_gpu'
    run_step tests 150 python3 -m pytest -q -m multi_gpu -p no:cacheprovider -rs --no-header \
      tests/unit/test_multi_gpu.py tests/kvtransfer/test_ipc_gpu.py
    tail -12 $logs/tests.log >> $results ;;
  *) note "- unknown step $step (steps: tp-step tp-greedy handoff serving moe tests)" ;;
  esac
done

cp -r /tmp/mgpu-serving/logs $logs/serving-logs 2>/dev/null
tar -czf $OUT/logs.tar.gz -C /tmp mgpu-logs
echo; echo "==== results.md ===="; cat $results
