"""A full decode step of a Llama-3.1-8B-shaped model (random bf16 weights) against the bandwidth floor.

    python3 bench/decode_step.py [--batches 1,64] [--context 1024] [--kv-cache-dtype auto|fp8] [--sync] [--hf]
                                 [--tensor-parallel-size N [--enable-expert-parallel]] [--shape NAME]
                                 [--num-layers L] [--device cuda|cpu] [--out results.md]

The floor of a step is the bytes it must read (all weights + every sequence's K/V) over the HBM read
bandwidth measured in the same run. Tandem's step is timed through the engine (CUDA graphs on, unless
--eager; asynchronous scheduling on, unless --sync), sampling and host work included. --hf also times
transformers' `generate` on the same shape. --kv-cache-dtype fp8 stores the KV cache as e4m3 with a scale byte
per token and KV head (engine/layers/kv_fp8.py); the floor then counts those bytes. FP8 against bf16 KV at the
issue's shape (batch 64, context 8k), one process each (each takes the GPU's memory):

    python3 bench/decode_step.py --batches 64 --context 8192 --kv-cache-dtype auto
    python3 bench/decode_step.py --batches 64 --context 8192 --kv-cache-dtype fp8

Several GPUs (`--tensor-parallel-size N`, rank r on cuda:r, NCCL; CUDA graphs are off with several ranks): the
floor is what one GPU must read, its own shard of the weights (rank 0's parameters: 1/N of them, plus the small
replicated norms) and its KV heads of every sequence (1/N of the K/V), at the bandwidth measured on cuda:0. The
step's collectives are replayed in the same run on the engine's own ranks and process group (bench/tp_step.py):
"all-reduce ms" is the time of the step's 2L + 1 all-reduces of [B, hidden], "all-gather ms" that of the logits'
all-gather; "collectives/step" is what rank 0 counted during the timed steps (the replay is skipped for a MoE
model, whose exchanges depend on the routing). `--shape qwen3-30b-a3b` is a Qwen3-MoE shape (128 experts, top-8):
`--enable-expert-parallel` puts whole experts on each rank instead of a slice of every expert; the floor columns are
left empty for a MoE model (the weights a step reads depend on the experts its tokens pick). The issue's runs:

    python3 bench/decode_step.py --tensor-parallel-size 2 --batches 1,64
    python3 bench/decode_step.py --shape qwen3-30b-a3b --tensor-parallel-size 2 [--enable-expert-parallel]

`--device cpu` with a tiny shape (`--shape tiny-llama` or `tiny-qwen3-moe`, float32, gloo between the ranks) is the
smoke run of the same code: its "HBM" is a host-memory reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tp_step import (  # noqa: E402
    SHAPES,
    decode_collectives,
    is_moe,
    read_bandwidth,
    shape_config,
)

MAX_STEP_TOKENS = 8192


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill_steps(batch: int, context: int) -> int:
    return -(-batch * context // MAX_STEP_TOKENS)


def time_engine_steps(llm, batch: int, context: int, steps: int  # type: ignore[no-untyped-def]
                      ) -> tuple[float, float, dict[str, float]]:
    """(seconds per step, device work alone per step, collectives per step by kind on rank 0)."""
    from engine import SamplingParams

    engine = llm.engine
    device = engine.runner.device
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
    synchronize(device)
    stats = engine.runner.parallel.stats
    stats.reset()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(device)
    elapsed = (time.perf_counter() - start) / steps
    collectives = {kind: count / steps for kind, count in sorted(stats.by_kind.items())}
    gpu = _time_forward_only(engine, batch, steps)
    for request_id in ids:
        engine.abort(request_id)
    return elapsed, gpu, collectives


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


def time_step_collectives(llm, config: dict[str, Any], batch: int, tp_size: int,  # type: ignore[no-untyped-def]
                          dtype: str, repeats: int) -> dict[str, float]:
    """The step's all-reduces and logits all-gather replayed on every rank (bench/tp_step.py); rank 0's seconds."""
    expected = decode_collectives(config, batch, tp_size)
    results = llm.engine.call_ranks(
        "bench.tp_step:time_collectives", batch, config["hidden_size"], expected["all_gather"]["bytes"] // batch // 4,
        expected["all_reduce"]["count"], dtype, repeats)
    return dict(results[0])


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (each step waits for its tokens)")
    parser.add_argument("--fused-gate-up-silu", action=argparse.BooleanOptionalAction, default=True,
                        help="the gate_up GEMM with SiLU-and-mul in one Hopper kernel (engine/kernels/hopper_mlp.py)")
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape's (faster load)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of the node, one GPU each")
    parser.add_argument("--enable-expert-parallel", action="store_true", help="MoE: whole experts per rank")
    parser.add_argument("--all2all-backend", default="allgather_reducescatter",
                        choices=("allgather_reducescatter", "all_to_all"))
    parser.add_argument("--comm-repeats", type=int, default=50, help="replays of the step's collectives")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.hf and (args.tensor_parallel_size > 1 or args.device != "cuda"):
        parser.error("--hf times transformers on one GPU: without --tensor-parallel-size and on cuda")
    if args.device == "cuda" and torch.cuda.device_count() < args.tensor_parallel_size:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size} needs as many GPUs; torch sees "
                     f"{torch.cuda.device_count()}")
    return args


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tp_size = args.tensor_parallel_size
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # the worker ranks import bench.tp_step (the collectives' replay) from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

    from engine import LLM

    bandwidth = read_bandwidth(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    cfg = {**shape_config(args.shape, args.num_layers), "dtype": dtype}
    moe = is_moe(cfg)
    config_dir = Path(tempfile.mkdtemp())
    (config_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(config_dir), dtype=dtype, device=args.device, load_format="dummy",
              max_num_seqs=max(batches), max_num_batched_tokens=MAX_STEP_TOKENS,
              max_model_len=args.context + args.steps + 64 + prefill_steps(max(batches), args.context),
              skip_tokenizer_init=True, enforce_eager=args.eager, async_scheduling=not args.sync,
              fused_gate_up_silu=args.fused_gate_up_silu,
              kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=tp_size,
              enable_expert_parallel=args.enable_expert_parallel, all2all_backend=args.all2all_backend)
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # rank 0's shard
    # the floor counts every weight; a step reads one row of the (untied) embedding table, so the
    # strict floor leaves the table out
    embedding = model.model.embed_tokens.weight
    embedding_bytes = embedding.numel() * embedding.element_size()
    kv_heads_per_rank = max(1, cfg["num_key_value_heads"] // tp_size)  # fewer KV heads than ranks: replicated
    kv_rows_per_token = cfg["num_hidden_layers"] * 2 * kv_heads_per_rank
    fp8 = llm.engine.kv_cache_dtype == "fp8_e4m3"
    # bf16: 2 bytes a value; e4m3: 1 byte a value and 1 scale byte a row (block padding left out)
    value_bytes = 2 if dtype == "bfloat16" else 4
    kv_bytes_per_token = kv_rows_per_token * (cfg["head_dim"] + 1 if fp8 else cfg["head_dim"] * value_bytes)
    parallel = (f"TP={tp_size}" + (f" with expert parallelism ({args.all2all_backend})" if args.enable_expert_parallel
                                    else "")) if tp_size > 1 else "one rank"
    lines = [f"{args.shape} ({cfg['num_hidden_layers']} layers, {dtype}) on {args.device}, {parallel}; "
             f"read bandwidth (sum of a large tensor, {'cuda:0' if args.device == 'cuda' else 'host'}): "
             f"{bandwidth / 1e12:.2f} TB/s",
             f"weights per rank: {weight_bytes / 1e9:.2f} GB; context {args.context}; KV cache: "
             f"{llm.engine.kv_cache_dtype} ({llm.engine.runner.num_blocks} blocks, {kv_heads_per_rank} KV heads a "
             f"rank); CUDA graphs: {llm.engine.runner.graphs is not None}; asynchronous scheduling: {not args.sync}; "
             f"strict floor: without the {embedding_bytes / 1e9:.2f} GB embedding table"
             + ("; MoE: no floor (the weights read depend on the experts picked)" if moe else ""), "",
             "| batch | tandem ms/step | tokens/s | device work alone ms | floor ms/step | tandem/floor "
             "| strict floor ms | tandem/strict floor | all-reduce ms/step | all-gather ms/step | collectives/step "
             "| transformers ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = {}
    for batch in batches:
        step, gpu, collectives = time_engine_steps(llm, batch, args.context, args.steps)
        avg_context = args.context + 3 + args.steps / 2
        floor = (weight_bytes + batch * avg_context * kv_bytes_per_token) / bandwidth
        strict = floor - embedding_bytes / bandwidth
        comm = {"all_reduce": float("nan"), "all_gather": float("nan")}
        if tp_size > 1 and not moe:
            comm = time_step_collectives(llm, cfg, batch, tp_size, dtype, args.comm_repeats)
            expected = decode_collectives(cfg, batch, tp_size)["all_reduce"]["count"]
            if collectives.get("all_reduce") != expected:
                print(f"note: rank 0 counted {collectives.get('all_reduce')} all-reduces a step, the replay "
                      f"assumes {expected}", flush=True)
        counted = ", ".join(f"{kind} {count:g}" for kind, count in collectives.items()) or "-"
        floor_cells = ["-"] * 4 if moe else [f"{floor * 1e3:.2f}", f"{step / floor:.2f}", f"{strict * 1e3:.2f}",
                                             f"{step / strict:.2f}"]
        device_work = "-" if gpu != gpu else f"{gpu * 1e3:.2f}"  # nan: no CUDA graph to replay alone
        lines.append(f"| {batch} | {step * 1e3:.2f} | {batch / step:.0f} | {device_work} | "
                     + " | ".join(floor_cells)
                     + "".join(f" | {comm[k] * 1e3:.3f}" if comm[k] == comm[k] else " | -" for k in comm)
                     + f" | {counted} | - |")
        rows[batch] = len(lines) - 1
        print(lines[-1], flush=True)
    if args.hf:
        llm.close()
        del llm
        torch.cuda.empty_cache()
        for batch in batches:
            hf_step = time_hf(config_dir, batch, args.context, 16)
            row = lines[rows[batch]].rsplit("|", 2)
            lines[rows[batch]] = f"{row[0]}| {hf_step * 1e3:.1f} |"
            print(lines[rows[batch]], flush=True)
    else:
        llm.close()
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
