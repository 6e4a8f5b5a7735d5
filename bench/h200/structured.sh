#!/usr/bin/env bash
# Structured output's cost per token on the H200 (issue 16's figure): bench/structured_output.py on Llama-3.1-8B's
# shape (random bf16 weights, SmolLM2's real tokenizer), batches 1, 16 and 64, with and without a JSON schema or a
# regex. The GPU machine has no xgrammar: carry its cp312 wheels in .whl (xgrammar 0.2.9, apache-tvm-ffi
# 0.1.15.post2, pydantic, pydantic-core, annotated-types, typing-inspection: about 7.5 MB).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
timeout 540 python3 bench/structured_output.py --batches 1,16,64 --steps 64 --context 256 \
  --out $OUT/structured_output.md > $OUT/structured_output.log 2>&1; echo "structured_output rc=$?"
cat $OUT/structured_output.md 2>/dev/null || tail -40 $OUT/structured_output.log
