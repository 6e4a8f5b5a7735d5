"""Offline throughput: 64 prompts x 256 random tokens in, 128 out, greedy, ignore_eos.

    python bench/offline.py --model DIR [--dtype float32|bfloat16] [--load-format dummy] [--sync] [--peer vllm]
                            [--temperature T --top-p P --top-k K]

With --temperature > 0 every request samples with that top_p / top_k, as a chat client's requests do.

Prints output tokens/s for Tandem's engine. With --peer vllm it then runs the same workload through vLLM in
its own virtualenv (VLLM_PYTHON, default /work/vllm-venv/bin/python) and prints both, measured back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402

GREEDY = {"temperature": 0.0}


def run_tandem(model: str, dtype: str, num_prompts: int, prompt_len: int, output_len: int,
               max_num_batched_tokens: int, async_scheduling: bool | None = None,
               load_format: str = "auto", block_size: int | None = None,
               sampling: dict[str, float] | None = None) -> dict[str, float]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=num_prompts, max_num_batched_tokens=max_num_batched_tokens,
              skip_tokenizer_init=True, async_scheduling=async_scheduling, load_format=load_format,
              **({} if block_size is None else {"block_size": block_size}))
    vocab = llm.engine.model_config.vocab_size
    prompts = workload.prompts(vocab, num_prompts, prompt_len)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **(sampling or GREEDY))
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == num_prompts * output_len, f"expected {num_prompts * output_len} tokens, got {num_out}"
    return {"seconds": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed}


def run_peer(model: str, dtype: str, num_prompts: int, prompt_len: int, output_len: int,
             max_num_batched_tokens: int, sampling: dict[str, float] | None = None) -> dict[str, float]:
    python = os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python")
    script = Path(__file__).resolve().parent / "vllm_offline.py"
    cmd = [python, str(script), "--model", model, "--dtype", dtype, "--num-prompts", str(num_prompts),
           "--prompt-len", str(prompt_len), "--output-len", str(output_len),
           "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--sampling", json.dumps(sampling or GREEDY)]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    # vLLM logs to stdout too: the result is the last JSON line
    return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=workload.NUM_PROMPTS)
    parser.add_argument("--prompt-len", type=int, default=workload.PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=workload.OUTPUT_LEN)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (default: on a GPU, async)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a shape-only model directory)")
    parser.add_argument("--block-size", type=int, default=None, help="Tandem's KV block size (default: the engine's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: every request samples")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    sampling = ({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
                if args.temperature > 0 else GREEDY)
    shape = (args.model, args.dtype, args.num_prompts, args.prompt_len, args.output_len,
             args.max_num_batched_tokens)
    results = {"tandem": run_tandem(*shape, async_scheduling=False if args.sync else None,
                                    load_format=args.load_format, block_size=args.block_size, sampling=sampling)}
    if args.peer == "vllm":
        results["vllm"] = run_peer(*shape, sampling=sampling)
    for name, r in results.items():
        print(f"{name:8s} {r['output_tokens_per_s']:9.1f} output tok/s  "
              f"({r['output_tokens']} tokens in {r['seconds']:.2f} s)")
    if len(results) == 2:
        ratio = results["tandem"]["output_tokens_per_s"] / results["vllm"]["output_tokens_per_s"]
        print(f"tandem / vllm = {ratio:.2f}")


if __name__ == "__main__":
    main()
