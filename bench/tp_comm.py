"""What tensor parallelism costs in communication per decode step: collectives and bytes, counted by the
ParallelContext of rank 0 (engine/parallel/context.py) while the engine decodes a batch.

    python bench/tp_comm.py --model DIR [--tp 2] [--batch 8] [--steps 16] [--dtype float32] [--device cpu]

DIR needs only a config.json (weights are dummy). Bytes are what rank 0 puts into each collective (for an
all-reduce, its tensor; for the logits' all-gather, its slice; for the step command, the pickle). The analytic
count for a dense model of L layers, hidden size h, vocabulary V, batch B, element size s, TP N:
all-reduces 2L + 1 (attention, MLP, embedding) of B*h*s bytes each, one all-gather of B*ceil(V/N)*4 bytes (float32
logits), one command broadcast (host inputs, tens of bytes a sequence), and with asynchronous scheduling one
broadcast of the B input ids (8 B each).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", skip_tokenizer_init=True,
                                    tensor_parallel_size=args.tp, dtype=args.dtype, device=args.device,
                                    num_kv_blocks=args.batch * (-(-(args.prompt_len + args.steps + 4) // 16)),
                                    max_num_seqs=args.batch, async_scheduling=args.async_scheduling))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(str(i), [1 + (i + j) % 100 for j in range(args.prompt_len)], params)
        engine.step()  # every prompt's prefill
        engine.step()
        stats = engine.runner.parallel.stats
        stats.reset()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = time.perf_counter() - started
        cfg = engine.model_config
        result = {
            "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                      "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads},
            "tp": args.tp, "batch": args.batch, "dtype": args.dtype, "device": args.device,
            "per_decode_step": {"collectives": stats.num_collectives / args.steps,
                                "bytes_sent_by_rank0": stats.num_bytes / args.steps,
                                "by_kind": {k: v / args.steps for k, v in sorted(stats.by_kind.items())}},
            "step_ms": 1e3 * elapsed / args.steps,
        }
        print(json.dumps(result, indent=2))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
