#!/usr/bin/env bash
# `tandem serve` end to end, started the way a user starts it: `python -m cluster.cli serve` brings up a local Ray
# instance, its own redis-server (the registry), one prefill and one decode node as Ray actors (--kv-backend ipc,
# both sharing the one GPU: --node-gpus 0.5), and the proxy; then two greedy completions (a prompt of token ids and
# a text prompt; temperature 0, 16 tokens, ignore_eos) must equal transformers' greedy tokens of the same tiny
# random-weight Llama (float32, the dtype the nodes serve it in; tests/fixtures/tiny_models.py's hf_greedy), and both
# must have gone prefill node -> ipc KV handoff -> decode node (the proxy runs with --colocate-max-tokens 0).
# Prints PASS or FAIL with both texts, and the last Traceback of each node, proxy or Ray log that has one; always
# stops the cluster (an EXIT trap), within 8 minutes in all.
#
# On the GPU machine (no Ray, no redis-server, no network there), from the repository root:
#     bash bench/h200/serve_smoke.sh        with carry [".carry-gpu"]
# .carry-gpu (git-ignored; bench/h200/make_gpu_carry.sh rebuilds it) holds a trimmed, stripped Ray 2.60.0 (cp312), the
# cp312 wheels the GPU image lacks (grpcio, protobuf, redis, starlette, uvicorn, grpcio-health-checking, jsonschema
# and its dependencies) and Debian 12's redis-server with its shared libraries. They install into /tmp/site and
# /tmp/redis, unless `ray` and the rest already import (a warm machine).
# Without nvidia-smi (a dry run on a CPU box) the same flow runs on CPU with the repository's .venv and the
# machine's redis-server:  OUT=/tmp/smoke-out bash bench/h200/serve_smoke.sh
# What comes back in $OUT: serve.log (the CLI's own output), node-prefill.log, node-decode.log, proxy.log,
# tandem-other.log (redis), ray-daemons.log and ray-workers.log (Ray's session logs, tails).
set -u
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-/tmp/serve-smoke-out}
CARRY=${CARRY:-$REPO/.carry-gpu}
PORT=${PORT:-8000}
MODEL=${MODEL:-/tmp/tiny}
MAX_TOKENS=16
START=$SECONDS
DEADLINE=$((SECONDS + ${BUDGET_S:-450}))  # the whole script, stop included, stays under 8 minutes
mkdir -p "$OUT"
say() { echo "[smoke +$((SECONDS - START))s] $*"; }

if command -v nvidia-smi >/dev/null 2>&1; then
  GPU=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  PY=${PY:-python3}
  "$PY" -c "import torch" 2>/dev/null || { [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3; }
  export PYTHONPATH=/tmp/site:$REPO
  GPU_FLAGS=(--node-gpus 0.5)  # one prefill + one decode node share the GPU (also the default on one GPU)
else
  GPU=0
  echo "no nvidia-smi: a CPU dry run with $REPO/.venv"
  PY=${PY:-$REPO/.venv/bin/python}
  export PYTHONPATH=$REPO
  GPU_FLAGS=()
fi
PY=$(command -v "$PY")
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
# this run's own Ray temp dir and Tandem cache dir: its session logs, and the processes to stop, are these alone
RUN_DIR=/tmp/serve-smoke
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
export RAY_TMPDIR=$RUN_DIR/rt TANDEM_CACHE_DIR=$RUN_DIR/cache
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

# ---- install what the machine lacks (skipped when it all imports already) ----
IMPORTS="import ray, redis, starlette, uvicorn, jsonschema, grpc_health.v1.health, protos.tandem_pb2_grpc"
if ! "$PY" -c "$IMPORTS" 2>/dev/null; then
  say "installing $CARRY into /tmp/site"
  mkdir -p /tmp/site
  if ! timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/site "$CARRY"/wheels/*.whl; then
    for w in "$CARRY"/wheels/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site || exit 1; done  # no pip: wheels are zips
  fi
  for t in "$CARRY"/ray-*.tar.xz; do
    tar -xJf "$t" -C /tmp/site 2>/dev/null \
      || "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" /tmp/site || exit 1
  done
  "$PY" -c "$IMPORTS" || { echo "FAIL: the carry does not import"; exit 1; }
fi
"$PY" -c "import ray, grpc, google.protobuf as p, torch, transformers; print('ray', ray.__version__, 'grpcio',
grpc.__version__, 'protobuf', p.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
if ! command -v redis-server >/dev/null 2>&1; then
  # Debian 12's redis-server with the libraries it links (besides glibc, libstdc++, libgcc_s), for redis alone
  mkdir -p /tmp/redis/bin
  for t in "$CARRY"/redis-*.tar.xz; do  # lib/: redis-server, redis-cli and the libraries
    tar -xJf "$t" -C /tmp/redis 2>/dev/null \
      || "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" /tmp/redis || exit 1
  done
  for b in redis-server redis-cli; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /tmp/redis/lib/%s "$@"\n' \
      "$b" > /tmp/redis/bin/$b
    chmod +x /tmp/redis/bin/$b
  done
  export PATH=/tmp/redis/bin:$PATH
fi
say "$(redis-server --version)"

# ---- the model: tiny random-weight Llama with its tokenizer, built offline ----
if [ ! -f "$MODEL/config.json" ]; then
  timeout 120 "$PY" -c "import sys; from pathlib import Path; from tests.fixtures.tiny_models import build_tiny_model
build_tiny_model('llama', Path(sys.argv[1]))" "$MODEL" || { echo "FAIL: cannot build the model"; exit 1; }
fi
say "model: $MODEL ($(du -sh "$MODEL" | cut -f1))"

# ---- Tracebacks: Tandem's logs (nodes, proxy, redis) and Ray's session logs ----
find_logs() {
  LOG_DIR=$(ls -d "$TANDEM_CACHE_DIR"/logs/serve-* 2>/dev/null | tail -1)
  RAY_LOGS=$RAY_TMPDIR/ray/session_latest/logs
}
declare -A SEEN=()
tracebacks() {  # prints the last Traceback of each log with more of them than when last called
  local f n found=0
  for f in "$LOG_DIR"/*.log "$RAY_LOGS"/*.err "$RAY_LOGS"/*.out "$RAY_LOGS"/*.log "$OUT/serve.log"; do
    [ -f "$f" ] || continue
    n=$(grep -c "Traceback" "$f")
    [ "$n" -gt "${SEEN[$f]:-0}" ] || continue
    SEEN[$f]=$n
    found=1
    echo "---- $f: $n Traceback(s); the last:"
    tac "$f" | grep -m1 -B40 "Traceback" | tac | head -40
  done
  [ $found = 0 ] && echo "(none new in $LOG_DIR or $RAY_LOGS)"
}
# ---- stop: SIGTERM unwinds tandem serve (nodes, proxy, redis, Ray); then its group, then this run's Ray ----
# (run at exit, whatever ended the script)
stop_cluster() {
  trap - EXIT INT TERM
  if kill -0 $SERVE 2>/dev/null; then
    kill -TERM $SERVE
    for _ in $(seq 1 60); do kill -0 $SERVE 2>/dev/null || break; sleep 0.5; done
  fi
  kill -KILL -- -$SERVE 2>/dev/null
  wait $SERVE 2>/dev/null
  say "tandem serve exited with code $? (0 or 130: a clean stop)"
  if [ $GPU = 1 ]; then
    timeout 30 "$PY" -m ray.scripts.scripts stop --force > /dev/null 2>&1  # the GPU machine is ours alone
  fi
  # whatever of this run outlived it (a node, the proxy, redis, a Ray daemon): each process started under this
  # run's RAY_TMPDIR, by its pid (this shell has it too)
  local p cmd
  for p in $(grep -l -s -a -e "RAY_TMPDIR=$RAY_TMPDIR" /proc/[0-9]*/environ | cut -d/ -f3); do
    [ "$p" = $$ ] && continue
    cmd=$( (tr '\0' ' ' < /proc/$p/cmdline) 2>/dev/null | cut -c1-100)
    [ -n "$cmd" ] && kill -KILL "$p" 2>/dev/null && echo "stopped leftover pid $p: $cmd"
  done
  find_logs
  say "Tracebacks since, in the stop:"
  tracebacks

  # logs into $OUT: 7 files in all, with serve.log
  cat_tail "$LOG_DIR"/prefill-*.log > "$OUT/node-prefill.log"
  cat_tail "$LOG_DIR"/decode-*.log > "$OUT/node-decode.log"
  cat_tail "$LOG_DIR"/proxy.log > "$OUT/proxy.log"
  cat_tail $(ls "$LOG_DIR"/*.log 2>/dev/null | grep -v -e /prefill- -e /decode- -e /proxy.log) "$RUN_DIR/oracle.log" \
    > "$OUT/tandem-other.log"
  cat_tail "$RAY_LOGS"/raylet.* "$RAY_LOGS"/gcs_server.* "$RAY_LOGS"/dashboard_agent.* "$RAY_LOGS"/runtime_env_agent.* \
    "$RAY_LOGS"/monitor.* "$RAY_LOGS"/dashboard.* "$RAY_LOGS"/log_monitor.* | tail -c 3000000 > "$OUT/ray-daemons.log"
  cat_tail "$RAY_LOGS"/worker-* "$RAY_LOGS"/python-core-* | tail -c 3000000 > "$OUT/ray-workers.log"
  echo "tail of serve.log:"
  tail -12 "$OUT/serve.log" | tr '\r' '\n' | grep -v -e "^loading the model" -e "^ *$"
  say "$RESULT ($((SECONDS - START)) s in all)"
  [ $RESULT = PASS ] && exit 0
  exit 1
}
cat_tail() { local f; for f in "$@"; do [ -f "$f" ] && { echo "==== $f"; tail -c 400000 "$f"; }; done; }

# ---- tandem serve, in its own process group ----
# --colocate-max-tokens 0: every prompt is prefilled on the prefill node and its KV pulled over ipc (by default an
# idle decode node prefills short prompts itself, and the handoff would go untested). $SERVE_EXTRA: more flags.
# shellcheck disable=SC2206
SERVE_ARGS=(--model "$MODEL" --kv-backend ipc --port "$PORT" "${GPU_FLAGS[@]}" --startup-timeout 240
            --proxy-args "--colocate-max-tokens 0" ${SERVE_EXTRA:-})
setsid "$PY" -m cluster.cli serve "${SERVE_ARGS[@]}" > "$OUT/serve.log" 2>&1 < /dev/null &
SERVE=$!
say "tandem serve (pid $SERVE) ${SERVE_ARGS[*]}"
RESULT=FAIL
trap stop_cluster EXIT
trap 'exit 1' INT TERM

# the oracle's tokens (transformers on CPU, float32, eager attention) while the cluster starts
CHECK_PY='
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
from tests.fixtures.tiny_models import hf_greedy
model, n = sys.argv[1], int(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model)
cases = {"ids": list(range(30, 46)), "text": "The license of the Python software"}
expected = {}
for name, prompt in cases.items():
    ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
    (tokens,) = hf_greedy(Path(model), [ids], n)
    expected[name] = {"prompt": prompt, "tokens": tokens, "text": tokenizer.decode(tokens)}
json.dump(expected, open(sys.argv[3], "w"))
'
timeout 120 "$PY" -c "$CHECK_PY" "$MODEL" "$MAX_TOKENS" "$RUN_DIR/expected.json" > "$RUN_DIR/oracle.log" 2>&1 \
  || { say "the oracle failed:"; tail -20 "$RUN_DIR/oracle.log"; }

# ---- wait (bounded) until the proxy reaches both pools ----
HEALTH_PY='
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
'
WAIT_UNTIL=$((SECONDS + 240))
[ $WAIT_UNTIL -gt $((DEADLINE - 90)) ] && WAIT_UNTIL=$((DEADLINE - 90))
HEALTHY=0
while [ $SECONDS -lt $WAIT_UNTIL ]; do
  if ! kill -0 $SERVE 2>/dev/null; then say "tandem serve exited early"; break; fi
  if "$PY" -c "$HEALTH_PY" "http://127.0.0.1:$PORT/health" \
     && "$PY" -c "$HEALTH_PY" "http://127.0.0.1:$PORT/v1/models"; then HEALTHY=1; break; fi
  sleep 2
done
say "healthy=$HEALTHY"

# ---- the completions against the oracle ----
ASK_PY='
import json, sys, time, httpx
url, n = sys.argv[1], int(sys.argv[2])
expected = json.load(open(sys.argv[3]))
models = httpx.get(url + "/v1/models", timeout=10).json()
name = models["data"][0]["id"]
print("served model:", name)
ok = True
for case, want in expected.items():
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": name, "prompt": want["prompt"], "max_tokens": n, "temperature": 0, "ignore_eos": True})
    body = r.json()
    got = body["choices"][0]["text"] if r.status_code == 200 else None
    same = got == want["text"]
    ok &= same
    verdict, usage, text = ("same" if same else "DIFFERENT"), body.get("usage"), want["text"]
    print(f"{case}: {verdict}  (HTTP {r.status_code}, usage {usage})")
    print(f"  tandem:       {got!r}")
    print(f"  transformers: {text!r}")
    if r.status_code != 200:
        print("  ", json.dumps(body)[:2000])
# the proxy routed both to the prefill node (disaggregated), and the decode node pulled their KV
time.sleep(3)  # node counters arrive with the stats polls of the proxy
metrics = httpx.get(url + "/metrics", timeout=10).text.splitlines()
wanted = ("tandem:pd_decisions", "tandem:kv_transfer_bytes", "tandem:kv_transfer_failures")
for line in metrics:
    if line.startswith(wanted):
        print("  metric", line)
disaggregated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics
                    if line.startswith("tandem:pd_decisions") and "disaggregated" in line)
if disaggregated < len(expected):
    print(f"DIFFERENT path: {disaggregated:g} disaggregated requests, expected {len(expected)}")
    ok = False
sys.exit(0 if ok else 1)
'
if [ $HEALTHY = 1 ] && [ -f "$RUN_DIR/expected.json" ]; then
  ASK_S=$((DEADLINE - SECONDS)); [ $ASK_S -lt 30 ] && ASK_S=30
  timeout $ASK_S "$PY" -c "$ASK_PY" "http://127.0.0.1:$PORT" "$MAX_TOKENS" "$RUN_DIR/expected.json" && RESULT=PASS
fi
find_logs
grep -h "engine.runner: model " "$LOG_DIR"/*.log 2>/dev/null  # where each node runs the model, and in which dtype
[ $GPU = 1 ] && nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
say "Tracebacks while serving:"
tracebacks
