"""What bench/gpu_cluster.py measures against a running cluster: greedy outputs through the OpenAI API, the
first-to-second-token latency on the nodes' gRPC services, `tandem bench serve` runs, and the nodes' KV
transfer counters."""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.cluster_procs import ROOT
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc

TEXT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
                "Once upon a time, in a land far away, there lived")


@dataclass(frozen=True)
class Completion:
    """One greedy completion as the proxy returned it: the sampled tokens' texts and logprobs, and the text."""

    prompt: str  # what was sent, shortened for the report
    text: str
    tokens: list[str]
    token_logprobs: list[float]


def correctness_prompts(vocab_size: int, seed: int = 7) -> list[str | list[int]]:
    """Text prompts (the proxy tokenizes them) and token-id prompts of odd lengths (a partial last block)."""
    rng = random.Random(seed)
    ids = [[rng.randrange(10, vocab_size) for _ in range(n)] for n in (97, 701)]
    return [*TEXT_PROMPTS, *ids]


def complete(url: str, model: str, prompt: str | list[int], max_tokens: int) -> Completion:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:500]}")
    choice = response.json()["choices"][0]
    logprobs = choice.get("logprobs") or {}
    shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
    return Completion(shown[:40], choice["text"], list(logprobs.get("tokens") or []),
                      [float(x) for x in logprobs.get("token_logprobs") or []])


def greedy_outputs(url: str, model: str, prompts: list[str | list[int]], max_tokens: int) -> list[Completion]:
    # one at a time: each request runs alone on the GPU, so both modes compute it with the same batch shapes
    return [complete(url, model, prompt, max_tokens) for prompt in prompts]


def compare_outputs(pd_outputs: list[Completion], colocated: list[Completion], max_tokens: int,
                    logprob_tolerance: float) -> tuple[bool, list[str]]:
    """OK when every prompt's sampled tokens and text are the same in both modes, all `max_tokens` of them, and
    the sampled tokens' logprobs agree within the tolerance. Returns (ok, report lines)."""
    lines, ok = [], len(pd_outputs) == len(colocated)
    for a, b in zip(pd_outputs, colocated, strict=False):
        same = a.tokens == b.tokens and a.text == b.text and len(a.tokens) == max_tokens
        diff = max((abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs, strict=False)), default=0.0)
        good = same and diff <= logprob_tolerance
        ok = ok and good
        first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), None)
        where = "" if first is None else f", first differing token at {first}"
        lines.append(f"{'OK  ' if good else 'FAIL'} {a.prompt!r}: {len(a.tokens)} tokens, "
                     f"{len(set(a.tokens))} distinct, max |logprob diff| {diff:.2e}{where}")
    # random weights: outputs that ignore their context would hide a wrong KV cache
    if pd_outputs and all(len(set(c.tokens)) <= 1 for c in pd_outputs):
        lines.append("WARNING: every output repeats one token: the random model hides differences")
    if len({tuple(c.tokens) for c in pd_outputs}) < len(pd_outputs):
        lines.append("WARNING: two prompts gave the same output: the random model hides differences")
    return ok, lines


def pd_decisions(url: str) -> dict[str, float]:
    """The proxy's routing decisions by mode (tandem:pd_decisions_total)."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'tandem:pd_decisions_total\{.*mode="(\w+)".*\} (\S+)', line)
        if match:
            counts[match[1]] = counts.get(match[1], 0.0) + float(match[2])
    return counts


# ---- first token -> second token on the nodes (bench/pd_latency.py's approach) ----

def _params() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=2, ignore_eos=True)


async def _handoff(prefill: str, decode: str, prompts: list[list[int]], tag: str) -> list[tuple[float, float]]:
    """(time to first token, first -> second token) per prompt, through P then D."""
    times = []
    async with grpc.aio.insecure_channel(prefill) as p_channel, grpc.aio.insecure_channel(decode) as d_channel:
        p_stub, d_stub = tandem_pb2_grpc.PrefillServiceStub(p_channel), tandem_pb2_grpc.DecodeServiceStub(d_channel)
        for i, prompt in enumerate(prompts):
            request_id = f"latency-{tag}-{i}"
            start = time.perf_counter()
            first = await p_stub.Prefill(pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                                           params=_params()))
            first_at = time.perf_counter()
            second_at = None
            async for out in d_stub.Generate(pb.GenerateRequest(
                    request_id=request_id, prompt_token_ids=prompt, params=_params(), ticket=first.ticket,
                    first_token=first.first_token)):
                if out.token_ids and second_at is None:
                    second_at = time.perf_counter()
            if second_at is None:
                raise RuntimeError(f"{request_id}: the decode node sent no token")
            times.append((first_at - start, second_at - first_at))
    return times


async def _colocated(decode: str, prompts: list[list[int]], tag: str) -> list[tuple[float, float]]:
    """(time to first token, first -> second token) per prompt, D alone (no ticket: D prefills)."""
    times = []
    async with grpc.aio.insecure_channel(decode) as channel:
        stub = tandem_pb2_grpc.DecodeServiceStub(channel)
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            stamps: list[float] = []
            async for out in stub.Generate(pb.GenerateRequest(request_id=f"latency-{tag}-{i}",
                                                              prompt_token_ids=prompt, params=_params())):
                stamps.extend(time.perf_counter() for _ in out.token_ids)
            if len(stamps) < 2:
                raise RuntimeError(f"latency-{tag}-{i}: {len(stamps)} tokens, expected 2")
            times.append((stamps[0] - start, stamps[1] - stamps[0]))
    return times


def measure_latency(prefill: str | None, decode: str, prompt_len: int, runs: int, vocab_size: int,
                    warmups: int = 2) -> dict[str, Any]:
    """Medians over `runs` distinct prompts (no prefix-cache hit) after `warmups` untimed ones."""
    rng = random.Random(prompt_len)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(runs + warmups)]
    tag = f"{'pd' if prefill else 'colocated'}-{prompt_len}"
    times = asyncio.run(_handoff(prefill, decode, prompts, tag) if prefill else _colocated(decode, prompts, tag))
    timed = times[warmups:]
    return {"mode": "P/D" if prefill else "colocated", "prompt_len": prompt_len, "runs": len(timed),
            "ttft_ms": statistics.median(t for t, _ in timed) * 1e3,
            "first_to_second_ms": statistics.median(s for _, s in timed) * 1e3}


def kv_transfer_stats(decode: str) -> dict[str, float]:
    async def stats() -> pb.StatsResponse:
        async with grpc.aio.insecure_channel(decode) as channel:
            return await tandem_pb2_grpc.DecodeServiceStub(channel).Stats(pb.StatsRequest(), timeout=10)

    s = asyncio.run(stats())
    seconds = s.kv_transfer_seconds_sum
    return {"transfers": s.kv_transfer_count, "bytes": s.kv_transfer_bytes, "seconds": seconds,
            "gb_per_s": s.kv_transfer_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "failures": s.num_transfer_failures}


# ---- tandem bench serve ----

@dataclass(frozen=True)
class BenchPoint:
    workload: str  # "1024/256"
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    seed: int  # the same in both modes: they serve the same prompts


def run_bench(point: BenchPoint, url: str, model: str, tokenizer: Path, result_path: Path | None, label: str,
              timeout_s: float, log_path: Path, goodput: tuple[str, ...] = ()) -> dict[str, Any]:
    """One `python -m benchmark serve` run; its result file's keys (vLLM's), or {"error": ...}. `goodput`: SLOs
    as `tandem bench serve --goodput` takes them ("ttft:MS", "tpot:MS", ...)."""
    command = [sys.executable, "-m", "benchmark", "serve", "--base-url", url, "--model", model,
               "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--random-input-len", str(point.input_len), "--random-output-len", str(point.output_len),
               "--num-prompts", str(point.num_prompts), "--max-concurrency", str(point.concurrency),
               "--seed", str(point.seed), "--request-timeout", str(int(timeout_s)), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--label", label]
    if goodput:
        command += ["--goodput", *goodput]
    if result_path is not None:
        command += ["--save-result", "--result-dir", str(result_path.parent), "--result-filename", result_path.name]
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
    if result_path is None:
        return {} if code == 0 else {"error": f"exit code {code}"}
    if not result_path.is_file():
        return {"error": f"exit code {code}, no result file (see {log_path})"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result.pop("errors", None)
    result.pop("latencies", None)
    if code != 0:
        result["error"] = f"exit code {code}: {result.get('failed')} requests failed"
    return result


def point_record(point: BenchPoint, mode: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"mode": mode, **asdict(point), **result}
