"""Structured output's cost per token: decode steps of the engine with and without a constraint, same batch.

    python3 bench/structured_output.py [--model bench/models/llama8b-shape] [--batches 1,16,64] [--steps 64]
        [--context 256] [--out results.md]

The default model is Llama-3.1-8B's shape with random bf16 weights (`--load-format dummy`) and SmolLM2's real
byte-level BPE tokenizer (49,152 ids): xgrammar's masks are computed over a real vocabulary. For each batch size,
the same prompts decode `--steps` steps greedily four ways: unconstrained (ignore_eos), under a JSON schema whose
instances never end quickly (an array of objects with a free string, so the batch stays full: a random model
rarely closes it), under a regex, and under the structural tag tool_choice "auto" puts on a text answer.
Reported: ms per step and per generated token, and the difference from unconstrained, plus the host time to
fill the batch's masks alone (engine/structured_output.py), which the engine spends while the device runs the
forward pass. Timing starts once every request has its first token (prefill
excluded). A smoke run on CPU: --model a tiny model directory --dtype float32 --batches 1,4 --steps 8.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "array", "items": {"type": "object", "required": ["id", "name", "tags"],
                                     "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}
REGEX = r"([a-z]+ [0-9]+, )+"
# tool_choice "auto" as the proxy constrains it (proxy/api/tools.py, hermes): text is free until the model writes
# <tool_call>, then the call must be one of the tools'. A random model writes text: this is the cost the constraint
# adds to an answer that calls nothing, against vLLM's unconstrained auto
TOOL_TAG = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "end": "}\n</tool_call>",
     "schema": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}]}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode(llm: Any, params: Any, batch: int, context: int, steps: int, tag: str) -> tuple[float, float, int]:
    """(seconds per step, seconds per generated token, requests still running at the end) over `steps` steps."""
    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(10, vocab) for _ in range(context)], params)
    requests = [engine.requests[r] for r in ids]
    while any(r.num_output_tokens == 0 for r in requests):  # prefill and the first token
        engine.step()
    for _ in range(2):
        engine.step()
    synchronize()
    before = sum(r.num_output_tokens for r in requests)
    start = time.perf_counter()
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        engine.step()
    synchronize()
    elapsed = time.perf_counter() - start
    # with asynchronous scheduling the host reads each step's tokens one call later, at the start as at the end
    generated = sum(r.num_output_tokens for r in requests) - before
    running = sum(1 for r in requests if not r.status.is_finished)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps, elapsed / max(generated, 1), running


def time_mask_fill(llm: Any, spec: Any, batch: int, repeats: int = 20) -> float:
    """Host seconds to fill `batch` masks of fresh matchers of `spec` (what a step adds before sampling)."""
    from engine.structured_output import fill_token_bitmask

    compiler = llm.engine.structured_outputs
    grammars = [compiler.grammar(spec) for _ in range(batch)]
    fill_token_bitmask(grammars, llm.engine.model_config.vocab_size)
    start = time.perf_counter()
    for _ in range(repeats):
        fill_token_bitmask(grammars, llm.engine.model_config.vocab_size)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "bench" / "models" / "llama8b-shape"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from engine import LLM, SamplingParams
    from engine.types import StructuredOutputsParams

    llm = LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_num_seqs=max(batches),
              max_num_batched_tokens=max(8192, args.context * max(batches)),
              max_model_len=args.context + args.steps + 64)
    kinds = {"unconstrained": None, "json_schema": StructuredOutputsParams(json=SCHEMA),
             "regex": StructuredOutputsParams(regex=REGEX),
             "auto_tool_tag": StructuredOutputsParams(structural_tag=json.dumps(TOOL_TAG), disable_any_whitespace=True)}
    compile_start = time.perf_counter()
    for spec in kinds.values():
        if spec is not None:
            llm.engine.structured_outputs.compile(spec)
    compile_s = time.perf_counter() - compile_start
    engine = llm.engine
    lines = [f"model {Path(args.model).name} ({args.dtype}, vocabulary {engine.model_config.vocab_size}) on "
             f"{engine.runner.device}; context {args.context}, {args.steps} timed decode steps, greedy; "
             f"asynchronous scheduling: {engine.async_scheduling}; first compile of both constraints (tokenizer "
             f"info included): {compile_s * 1e3:.0f} ms", "",
             "| batch | constraint | ms/step | ms/token | overhead ms/token | host mask fill ms/step | running |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch in batches:
        base_token = 0.0
        for kind, spec in kinds.items():
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True,
                                    structured_outputs=spec)
            step_s, token_s, running = time_decode(llm, params, batch, args.context, args.steps, kind)
            if spec is None:
                base_token = token_s
            fill = "-" if spec is None else f"{time_mask_fill(llm, spec, batch) * 1e3:.3f}"
            overhead = "-" if spec is None else f"{(token_s - base_token) * 1e3:+.3f}"
            lines.append(f"| {batch} | {kind} | {step_s * 1e3:.2f} | {token_s * 1e3:.3f} | {overhead} | {fill} "
                         f"| {running}/{batch} |")
            print(lines[-1], flush=True)
    report = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(report + "\n")
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
