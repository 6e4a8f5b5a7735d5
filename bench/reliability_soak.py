"""The reliability soak (issue 13, item 3): a cluster on this machine under bounded load for a long time (30 minutes by
default), showing flat memory and zero leaks.

    .venv/bin/python bench/reliability_soak.py [--minutes 30] [--clients 4] [--sample-seconds 60]

It starts redis-server, two prefill nodes, two decode nodes (registered there) and a proxy that finds them in
Redis, all on loopback with the demo model (built on first use, as `tandem serve` does), then runs `--clients`
streaming greedy clients one request after another (bounded: at most that many requests in flight). Each sample
(every `--sample-seconds`) records the resident memory (VmRSS) of every process and the free/total KV blocks of every
node. When the time is up the load stops and, once the nodes are idle, every block must be free again.

Pass/fail (exit status 1 on fail), written with the samples to bench/results/reliability-soak-<date>.md:
- zero leaked blocks (free == total, nothing running, no ticket pinned on any node after the load);
- no request failed or changed its answer (each prompt's greedy output is taken once, before the load);
- flat memory: from the first sample after warm-up (a quarter of the run) to the last, no process grew more than
  `--max-growth-mib` (default 32 MiB) - a leak of a few KiB per request grows without bound over thousands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_procs import ROOT, Child, child_env, free_port  # noqa: E402
from protos import tandem_pb2 as pb  # noqa: E402
from protos import tandem_pb2_grpc  # noqa: E402

NODE_FLAGS = ["--dtype", "float32", "--kv-backend", "nixl", "--num-kv-blocks", "256", "--max-num-seqs", "8",
              "--ucx-devices", "lo", "--log-level", "WARNING"]
LOOPBACK_ENV = {"UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


@dataclass
class Node:
    name: str
    role: str
    address: str
    child: Child


@dataclass
class Sample:
    minute: float
    rss_mib: dict[str, float]
    free_blocks: dict[str, str]  # "free/total"
    ok: int
    failed: int


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    mismatched: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            if detail and len(self.errors) < 10:
                self.errors.append(detail)


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def stats(node: Node) -> pb.StatsResponse | None:
    with grpc.insecure_channel(node.address) as channel:
        stub = (tandem_pb2_grpc.PrefillServiceStub if node.role == "prefill"
                else tandem_pb2_grpc.DecodeServiceStub)(channel)
        try:
            return stub.Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None


def leftover(node: Node) -> int:
    """Blocks still taken, requests still there and tickets still pinned (-1: the node does not answer)."""
    s = stats(node)
    if s is None:
        return -1
    return s.total_kv_blocks - s.free_kv_blocks + s.num_running + s.num_waiting + s.num_pinned_tickets


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> str:
    """One greedy streaming completion's text; raises on any failure."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, done = "", False
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                text += "".join(c.get("text", "") for c in event.get("choices", []))
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return text


def start_cluster(model: Path, log_dir: Path, redis_url: str) -> tuple[list[Node], Child, str]:
    nodes = []
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        role = name.split("-")[0]
        port = free_port()
        flags = [*NODE_FLAGS, *(["--lease-seconds", "5"] if role == "prefill" else [])]
        command = [sys.executable, "-m", f"{role}_node", "--model", str(model), "--host", "127.0.0.1", "--port",
                   str(port), "--node-id", name, "--registry", redis_url, *flags]
        nodes.append(Node(name, role, f"127.0.0.1:{port}",
                          Child(name, command, log_dir / f"{name}.log", child_env(LOOPBACK_ENV))))
    for node in nodes:
        node.child.wait_for_line("READY", 300)
    port = free_port()
    command = [sys.executable, "-m", "proxy", "--model", str(model), "--registry", redis_url, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", "--request-timeout", "60",
               "--colocate-max-tokens", "0"]  # every request moves its KV from P to D
    proxy = Child("proxy", command, log_dir / "proxy.log", child_env({}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            ready = httpx.get(f"{url}/health", timeout=5).json().get("ready_nodes")
            if ready == {"prefill": 2, "decode": 2}:
                return nodes, proxy, url
        except (httpx.HTTPError, ValueError):
            pass
        proxy.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not see the four nodes; log {proxy.log_path}")
        time.sleep(0.5)


def run(args: argparse.Namespace) -> bool:
    from cluster.demo_model import ensure_demo_model

    model = ensure_demo_model()
    log_dir = Path(args.log_dir or f"/tmp/reliability-soak-{int(time.time())}")
    log_dir.mkdir(parents=True, exist_ok=True)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                              "--appendonly", "no", "--logfile", str(log_dir / "redis.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    nodes: list[Node] = []
    proxy: Child | None = None
    try:
        time.sleep(0.5)
        nodes, proxy, url = start_cluster(model, log_dir, f"redis://127.0.0.1:{redis_port}")
        rng = random.Random(0)
        prompt_list = [[rng.randrange(10, 1000) for _ in range(rng.randrange(8, 96))] for _ in range(16)]
        with httpx.Client(timeout=90) as client:  # each prompt's answer, once, before any concurrency
            references = [complete(client, url, p, args.max_tokens) for p in prompt_list]
        processes = {"redis": redis.pid, "proxy": proxy.popen.pid, **{n.name: n.child.popen.pid for n in nodes}}
        tally = Tally()
        stop = threading.Event()

        def client_loop(seed: int) -> None:
            local = random.Random(seed)
            with httpx.Client(timeout=90) as client:
                while not stop.is_set():
                    i = local.randrange(len(prompt_list))
                    try:
                        text = complete(client, url, prompt_list[i], args.max_tokens)
                    except (httpx.HTTPError, RuntimeError, ValueError) as e:
                        tally.add("failed", repr(e))
                        continue
                    tally.add("ok" if text == references[i] else "mismatched",
                              "" if text == references[i] else f"prompt {i}: {text!r}")

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        samples: list[Sample] = []
        end = started + args.minutes * 60
        while True:
            now = time.monotonic()
            blocks = {}
            for node in nodes:
                s = stats(node)
                blocks[node.name] = "-" if s is None else f"{s.free_kv_blocks}/{s.total_kv_blocks}"
            samples.append(Sample((now - started) / 60, {name: rss_mib(pid) for name, pid in processes.items()},
                                  blocks, tally.ok, tally.failed + tally.mismatched))
            print(f"{samples[-1].minute:6.1f} min  ok {tally.ok}  failed {tally.failed}  mismatched "
                  f"{tally.mismatched}  rss " + " ".join(f"{k}={v:.0f}" for k, v in samples[-1].rss_mib.items())
                  + "  free " + " ".join(f"{k}={v}" for k, v in blocks.items()), flush=True)
            if now >= end:
                break
            time.sleep(min(args.sample_seconds, max(0.0, end - now)))
        stop.set()
        for thread in threads:
            thread.join(120)
        deadline = time.monotonic() + 30  # leases (5 s) and reads in flight end
        while any(leftover(n) for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        leaked = {n.name: leftover(n) for n in nodes}
        return report(args, samples, tally, leaked)
    finally:
        if proxy is not None:
            proxy.stop()
        for node in nodes:
            node.child.stop()
        redis.terminate()
        redis.wait(10)


def report(args: argparse.Namespace, samples: list[Sample], tally: Tally, leaked: dict[str, int]) -> bool:
    warm = next((s for s in samples if s.minute >= args.minutes / 4), samples[0])
    last = samples[-1]
    growth = {name: last.rss_mib[name] - warm.rss_mib[name] for name in last.rss_mib}
    flat = all(g <= args.max_growth_mib for g in growth.values())
    no_leaks = not any(leaked.values())
    passed = flat and no_leaks and tally.failed == 0 and tally.mismatched == 0
    names = list(last.rss_mib)
    nodes = list(last.free_blocks)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    lines = [
        f"# Reliability soak ({today}): {'PASS' if passed else 'FAIL'}",
        "",
        f"`bench/reliability_soak.py --minutes {args.minutes:g} --clients {args.clients} --max-tokens "
        f"{args.max_tokens}`: redis, 2 prefill + 2 decode nodes (demo model, CPU, NIXL on loopback) and a proxy; "
        f"{args.clients} greedy streaming clients back to back.",
        "",
        f"- requests: {tally.ok} ok, {tally.failed} failed, {tally.mismatched} with another answer than before the "
        "load" + (f" (e.g. {tally.errors[:3]})" if tally.errors else ""),
        f"- leaked after the load (blocks + requests + pinned tickets per node): {leaked}",
        f"- RSS growth from minute {warm.minute:.1f} to {last.minute:.1f} (MiB, limit {args.max_growth_mib:g}): "
        + ", ".join(f"{k} {v:+.1f}" for k, v in growth.items()) + f" -> {'flat' if flat else 'GROWING'}",
        "",
        "| minute | ok | failed | " + " | ".join(f"{n} RSS MiB" for n in names) + " | "
        + " | ".join(f"{n} free/total" for n in nodes) + " |",
        "|" + "---|" * (3 + len(names) + len(nodes)),
        *(f"| {s.minute:.1f} | {s.ok} | {s.failed} | " + " | ".join(f"{s.rss_mib[n]:.0f}" for n in names) + " | "
          + " | ".join(s.free_blocks[n] for n in nodes) + " |" for s in samples),
        "",
    ]
    out = Path(args.out or ROOT / "bench" / "results" / f"reliability-soak-{today}.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines[:8]))
    print(f"written to {out}")
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (the load's bound)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument("--max-growth-mib", type=float, default=32.0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--out", default=None, help="default: bench/results/reliability-soak-<date>.md")
    args = parser.parse_args()
    sys.exit(0 if run(args) else 1)


if __name__ == "__main__":
    main()
