"""Tensor parallelism on GPUs (NCCL): greedy tokens of tiny random models (Llama with a replicated KV head and
biases, Qwen2, Qwen3) with TP=1 and TP=2 against transformers in float32 (TP=2 runs eager, with asynchronous
scheduling: the input ids are broadcast over NCCL).

    python bench/tp_gpu_check.py [--out DIR]      # needs 2 GPUs; torch 2.11 / python 3.12, no internet

Prints one JSON line per check; exits 1 when a token differs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model, hf_greedy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu runs the same checks over gloo")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="tp-gpu-"))
    ok = True
    for arch, overrides in (("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
                            ("qwen2", {}), ("qwen3", {})):
        model = build_tiny_model(arch, root / arch, **overrides)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 900) for _ in range(n)] for n in (1, 9, 30)]
        expected = hf_greedy(model, prompts, 8)
        for tp in (1, 2):
            llm = LLM(model=str(model), dtype="float32", device=args.device, tensor_parallel_size=tp, block_size=16)
            try:
                got = [o.outputs[0].token_ids for o in
                       llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
            finally:
                llm.close()
            ok &= got == expected
            print(json.dumps({"arch": arch, "tp": tp, "token_exact": got == expected}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
