"""A full decode step of a Llama-3.1-8B-shaped model (random bf16 weights) against the bandwidth floor.

    python3 bench/decode_step.py [--batches 1,64] [--context 1024] [--kv-cache-dtype auto|fp8] [--sync] [--hf]
                                 [--out results.md]

The floor of a step is the bytes it must read (all weights + every sequence's K/V) over the HBM read
bandwidth measured in the same run. Tandem's step is timed through the engine (CUDA graphs on, unless
--eager; asynchronous scheduling on, unless --sync), sampling and host work included. --hf also times
transformers' `generate` on the same shape. --kv-cache-dtype fp8 stores the KV cache as e4m3 with a scale byte
per token and KV head (engine/layers/kv_fp8.py); the floor then counts those bytes. FP8 against bf16 KV at the
issue's shape (batch 64, context 8k), one process each (each takes the GPU's memory):

    python3 bench/decode_step.py --batches 64 --context 8192 --kv-cache-dtype auto
    python3 bench/decode_step.py --batches 64 --context 8192 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "bfloat16",
}


MAX_STEP_TOKENS = 8192


def hbm_read_bandwidth() -> float:
    """Bytes/s of a large bf16 reduction (reads dominate), best of several."""
    x = torch.empty(4 << 30 >> 1, dtype=torch.bfloat16, device="cuda").normal_()
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del x
    return (4 << 30) / best


def prefill_steps(batch: int, context: int) -> int:
    return -(-batch * context // MAX_STEP_TOKENS)


def time_engine_steps(llm, batch: int, context: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    engine = llm.engine
    # the first requests decode while the last ones prefill (8192 prompt tokens a step): they must not reach
    # max_tokens before the timing starts
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10 + prefill_steps(batch, context), ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [(7 * i + j) % 1000 + 10 for j in range(context)], params)
    while any(engine.requests[r].num_output_tokens == 0 for r in ids):  # prefill (and first token)
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    gpu = _time_forward_only(engine, batch, steps)
    for request_id in ids:
        engine.abort(request_id)
    return elapsed, gpu


def _time_forward_only(engine, batch: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    """GPU time of the step's device work alone (graph replay + lm_head), no host work: what the step
    would cost if scheduling and sampling were hidden behind the GPU."""
    runner = engine.runner
    if runner.graphs is None:
        return float("nan")
    graph = runner.graphs.graphs[runner.graphs.bucket(batch)]
    logits = runner.graphs.logits[:batch]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()  # the model and the lm_head
        logits.argmax(-1)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def time_hf(config_dir: Path, batch: int, context: int, steps: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(10, 1000, (batch, context), device="cuda")

    def run(new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    # per-step time of the decode part: the difference of two runs cancels the prefill
    per_step = (run(steps + 1) - run(1)) / steps
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (each step waits for its tokens)")
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from engine import LLM

    bandwidth = hbm_read_bandwidth()
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    llm = LLM(model=str(config_dir), dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
              max_num_batched_tokens=MAX_STEP_TOKENS,
              max_model_len=args.context + args.steps + 64 + prefill_steps(max(batches), args.context),
              skip_tokenizer_init=True, enforce_eager=args.eager, async_scheduling=not args.sync,
              kv_cache_dtype=args.kv_cache_dtype)
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the floor counts every weight; a step reads one row of the (untied) embedding table, so the
    # strict floor leaves the table out
    embedding = model.model.embed_tokens.weight
    embedding_bytes = embedding.numel() * embedding.element_size()
    cfg = LLAMA_31_8B
    kv_rows_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"]
    fp8 = llm.engine.kv_cache_dtype == "fp8_e4m3"
    # bf16: 2 bytes a value; e4m3: 1 byte a value and 1 scale byte a row (block padding left out)
    kv_bytes_per_token = kv_rows_per_token * (cfg["head_dim"] + 1 if fp8 else cfg["head_dim"] * 2)
    lines = [f"HBM read bandwidth (bf16 sum of 4 GiB): {bandwidth / 1e12:.2f} TB/s",
             f"weights: {weight_bytes / 1e9:.2f} GB; context {args.context}; KV cache: {llm.engine.kv_cache_dtype} "
             f"({llm.engine.runner.num_blocks} blocks); CUDA graphs: {not args.eager}; "
             f"asynchronous scheduling: {not args.sync}; strict floor: without the {embedding_bytes / 1e9:.2f} GB "
             "embedding table", "",
             "| batch | tandem ms/step | device work alone ms | floor ms/step | tandem/floor | strict floor ms "
             "| tandem/strict floor | transformers ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        step, gpu = time_engine_steps(llm, batch, args.context, args.steps)
        avg_context = args.context + 3 + args.steps / 2
        floor = (weight_bytes + batch * avg_context * kv_bytes_per_token) / bandwidth
        strict = floor - embedding_bytes / bandwidth
        hf = "-"
        lines.append(f"| {batch} | {step * 1e3:.2f} | {gpu * 1e3:.2f} | {floor * 1e3:.2f} "
                     f"| {step / floor:.2f} | {strict * 1e3:.2f} | {step / strict:.2f} | {hf} |")
        print(lines[-1], flush=True)
    if args.hf:
        del llm
        torch.cuda.empty_cache()
        for i, batch in enumerate(batches):
            hf_step = time_hf(config_dir, batch, args.context, 16)
            row = lines[5 + i].rsplit("|", 2)
            lines[5 + i] = f"{row[0]}| {hf_step * 1e3:.1f} |"
            print(lines[5 + i], flush=True)
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
