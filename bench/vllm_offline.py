"""The peer's side of bench/offline.py: the same workload through vLLM (run in vLLM's own virtualenv).

Prints one JSON line: seconds, output_tokens, output_tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=workload.NUM_PROMPTS)
    parser.add_argument("--prompt-len", type=int, default=workload.PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=workload.OUTPUT_LEN)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--sampling", default='{"temperature": 0.0}', help="SamplingParams keywords, as JSON")
    args = parser.parse_args()

    from transformers import AutoConfig
    from vllm import LLM, SamplingParams, TokensPrompt

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.num_prompts, skip_tokenizer_init=True,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048, seed=0,
              gpu_memory_utilization=0.5)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts(vocab, args.num_prompts,
                                                                           args.prompt_len)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                            **json.loads(args.sampling))
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"seconds": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed}))


if __name__ == "__main__":
    main()
