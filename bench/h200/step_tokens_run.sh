#!/usr/bin/env bash
# Issue 12: the engine's GPU tests with the inverse-transform sampler, the sampler on CUDA against the CPU's choice,
# and the offline run at a prefill step of 8192 and of 16384 tokens (vLLM's default for its offline LLM class on
# large GPUs), each in a fresh engine.
#   bash bench/h200/step_tokens_run.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
bash bench/h200/gpu_tests.sh
timeout 60 python3 - <<'PY'
import time, torch
from engine.sampler import Sampler, SamplingRow, noise_seed
from engine.types import SamplingParams
torch.manual_seed(0)
logits = torch.randn(256, 128256) * 3
rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95 if i % 2 else 1.0), noise_seed(i, 5), [], [], frozenset())
        for i in range(256)]
cpu = [t.token_id for t in Sampler()(logits, rows)]
gpu_logits = logits.cuda()
sampler = Sampler()
gpu = [t.token_id for t in sampler(gpu_logits, rows)]
torch.cuda.synchronize(); start = time.perf_counter()
for _ in range(20):
    sampler.sample(gpu_logits, rows)
torch.cuda.synchronize()
print(f"sampler cuda vs cpu: {sum(a == b for a, b in zip(cpu, gpu))}/256 rows equal; "
      f"cuda 256 x 128256 random rows {(time.perf_counter() - start) / 20 * 1e3:.2f} ms a step")
PY
for tokens in 8192 16384; do
  timeout 200 python3 bench/offline_gpu.py --max-num-batched-tokens $tokens --out $OUT/offline-$tokens.md \
    > $OUT/offline-$tokens.log 2>&1
  echo "offline $tokens rc=$?"; grep -v Warn $OUT/offline-$tokens.log | tail -8
done
