"""The handoff's added latency: time from the first token to the second through a prefill node and a decode
node (gRPC + KV pull + admission), against the same step in a colocated engine.

    python bench/pd_latency.py --model DIR [--backend nixl|mooncake] [--prompt-len 512] [--runs 10]

Starts one prefill and one decode node as processes on loopback (no proxy: the numbers are the nodes' own).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protos import tandem_pb2 as pb  # noqa: E402
from protos import tandem_pb2_grpc  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(role: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    process = subprocess.Popen(
        [sys.executable, "-m", f"{role}_node", "--model", args.model, "--dtype", args.dtype, "--port", str(port),
         "--kv-backend", args.backend, "--log-level", os.environ.get("TANDEM_LOG_LEVEL", "WARNING"),
         "--max-num-batched-tokens", "4096"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout = process.stdout
    assert stdout is not None
    for line in stdout:
        if line.startswith(b"READY"):
            if os.environ.get("TANDEM_LOG_LEVEL"):  # keep the node's log visible
                threading.Thread(target=lambda: [sys.stderr.write(x.decode()) for x in stdout],
                                 daemon=True).start()
            return process, f"127.0.0.1:{port}"
    raise RuntimeError(f"{role} node did not start")


async def handoff(prefill: str, decode: str, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    params = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=2, ignore_eos=True)
    ttft, second = [], []
    async with grpc.aio.insecure_channel(prefill) as p_channel, grpc.aio.insecure_channel(decode) as d_channel:
        p_stub, d_stub = tandem_pb2_grpc.PrefillServiceStub(p_channel), tandem_pb2_grpc.DecodeServiceStub(d_channel)
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            first = await p_stub.Prefill(pb.PrefillRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                                           params=params))
            t1 = time.perf_counter()
            async for _ in d_stub.Generate(pb.GenerateRequest(
                    request_id=f"r{i}", prompt_token_ids=prompt, params=params, ticket=first.ticket,
                    first_token=first.first_token)):
                second.append(time.perf_counter() - t1)
                break
            ttft.append(t1 - t0)
    return ttft, second


def colocated(args: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
                                    max_num_batched_tokens=4096))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    second = []
    for i, prompt in enumerate(prompts):
        request = engine.add_request(f"c{i}", prompt, params)
        while request.num_output_tokens < 1:
            engine.step()
        t1 = time.perf_counter()
        while request.num_output_tokens < 2:
            engine.step()
        second.append(time.perf_counter() - t1)
    return second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    rng = random.Random(0)
    # distinct prompts: no prefix-cache hit on either side
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_len)] for _ in range(args.runs + 2)]
    nodes: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        nodes.append(start("prefill", args))
        nodes.append(start("decode", args))
        ttft, second = asyncio.run(handoff(nodes[0][1], nodes[1][1], prompts))
    finally:
        for process, _ in nodes:
            process.terminate()
            process.wait()
    local = colocated(args, prompts)
    median = lambda xs: statistics.median(xs[2:]) * 1e3  # noqa: E731 - the first runs warm up
    print(f"backend {args.backend}, prompt {args.prompt_len} tokens, {args.dtype}, median of {args.runs}:")
    print(f"  P/D: time to first token {median(ttft):.1f} ms; first -> second token {median(second):.1f} ms")
    print(f"  colocated: first -> second token {median(local):.1f} ms")
    print(f"  added by the handoff: {median(second) - median(local):.1f} ms")


if __name__ == "__main__":
    main()
