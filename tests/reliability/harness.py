"""The fault suite's harness: one real cluster (Redis, two prefill nodes, two decode nodes, a proxy), a load of
concurrent streaming clients whose every answer is classified against an oracle, and one row per scenario.

The cluster: the nodes register in Redis and the proxy finds them there; decode-1 is the production decode node
started through tests/reliability/faulty_node.py, whose connector injects the transfer faults a scenario writes
into its fault plan (none by default). Every node and the proxy keep their port across restarts, so a killed
process comes back where it was. The proxy disaggregates every request (--colocate-max-tokens 0: every request
moves KV from P to D) and sends them to the nodes in turn, which spreads each burst over every node.

A request's outcome (`Kind`): OK (the greedy reference, exactly: transformers' output), CORRUPTED (a success with
any other text), FAILED (an OpenAI error object with a message, type and code: before the stream as the HTTP
body, or in it as an error event), UNCLEAR (any other failure: a dropped connection, a stream without [DONE], an
error without the OpenAI shape), HUNG (not over by the deadline plus a margin), CUT (the connection to the proxy
was lost while the proxy itself was killed: only the proxy-restart scenario expects those), LEFT (the client
itself went away, as the disconnect scenario asks).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import grpc
import httpx

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.integration.processes import ROOT, MooncakeMaster, Process, RedisServer, free_port, node_args
from tests.reliability.faults import FAULT_LOG_MARK, FaultPlan

REQUEST_TIMEOUT_S = 15.0  # the proxy's deadline for every request
HUNG_MARGIN_S = 5.0  # a request still open this long past its deadline is hung
LEASE_S = 3.0  # prefill nodes' lease: a ticket nobody pulls is freed this long after it was issued
NUM_KV_BLOCKS = 256
PROMPT_LENGTH = 32
NUM_PROMPTS = 8
MAX_TOKENS = 12  # the ordinary load's; longer streams for the scenarios that need them
LONG_MAX_TOKENS = 96  # the longest any request asks for (the reference is computed this long)
NODE_FLAGS = ["--num-kv-blocks", str(NUM_KV_BLOCKS), "--heartbeat-seconds", "0.5", "--registry-ttl-seconds", "2"]
# every node has both KV tiers (docs/architecture.md#kv-tiers), so that every scenario runs with them: a small host
# tier and the cluster's Mooncake Store (the harness's own mooncake_master), each node lending it 32 MiB
TIER_FLAGS = ["--kv-offloading-size", "0.01", "--kv-store-segment-size", "0.03125"]
PROXY_FLAGS = ["--block-size", "4", "--routing", "round_robin", "--colocate-max-tokens", "0",
               "--health-check-interval", "0.25", "--health-check-timeout", "1.0", "--prefill-attempt-timeout", "5",
               "--decode-first-token-timeout", "5", "--request-timeout", str(REQUEST_TIMEOUT_S)]
SHORT_DEADLINE_S = 0.5  # the second proxy's, for the deadline scenario
NODE_NAMES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
FAULTY_NODE = "decode-1"


def prompts() -> list[list[int]]:
    """Distinct prompts (token ids), each with its own greedy continuation."""
    return [list(range(100 + 37 * i, 100 + 37 * i + PROMPT_LENGTH)) for i in range(NUM_PROMPTS)]


class Kind(Enum):
    OK = "ok"
    CORRUPTED = "corrupted"
    FAILED = "failed"
    UNCLEAR = "unclear"
    HUNG = "hung"
    CUT = "cut"
    LEFT = "left"


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    kind: Kind
    status: int  # the HTTP status (0: none came)
    detail: str  # an error's message, or what was wrong
    server_error: bool = False  # HTTP 5xx, or an error event of type server_error

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Node:
    name: str  # "prefill-0"
    port: int
    module: str
    args: list[str]
    process: Process | None = None

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    def start(self, log_dir: Path) -> None:
        self.process = Process(self.module, self.args, log_dir)

    def log(self) -> str:
        return self.process.log() if self.process is not None else ""


@dataclass
class Cluster:
    model: Path
    log_dir: Path
    redis: RedisServer
    store: MooncakeMaster
    nodes: dict[str, Node]
    fault_plan: Path
    proxy_port: int
    references: dict[tuple[int, ...], list[int]]  # prompt -> its greedy tokens (LONG_MAX_TOKENS of them)
    tokenizer: Any
    proxy: Process | None = None
    short_proxy: Process | None = None  # a second proxy whose deadline is SHORT_DEADLINE_S
    short_proxy_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def expected_text(self, prompt: list[int], max_tokens: int) -> str:
        return str(self.tokenizer.decode(self.references[tuple(prompt)][:max_tokens], skip_special_tokens=True))

    # -- processes -------------------------------------------------------------------------------------------------
    @property
    def short_url(self) -> str:
        return f"http://127.0.0.1:{self.short_proxy_port}"

    def start_proxy(self) -> None:
        self.proxy = Process("proxy", ["--model", str(self.model), "--registry", self.redis.url, "--port",
                                       str(self.proxy_port), "--log-level", "warning", *PROXY_FLAGS], self.log_dir)

    def start_short_proxy(self) -> None:
        self.short_proxy_port = free_port()
        self.short_proxy = Process("proxy", ["--model", str(self.model), "--registry", self.redis.url, "--port",
                                             str(self.short_proxy_port), "--log-level", "warning", *PROXY_FLAGS,
                                             "--request-timeout", str(SHORT_DEADLINE_S)], self.log_dir)

    def kill(self, name: str, sig: int = signal.SIGKILL, restart: bool = True) -> None:
        """Stops the node with `sig` and, with `restart`, starts it again at once (it loads while the scenario
        goes on; `restore` waits for it)."""
        node = self.nodes[name]
        assert node.process is not None
        node.process.stop(sig)
        if restart:
            node.start(self.log_dir)

    def restore(self, timeout: float = 120.0) -> None:
        """Back to full strength: every dead process restarted, no fault planned, every node thawed, and the
        proxy seeing all four nodes ready and serving each of them."""
        FaultPlan().write(self.fault_plan)
        if not self.store.alive:  # an empty store on the same address: the nodes reconnect by themselves
            self.store.start()
        for node in self.nodes.values():
            if node.process is not None and node.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.process.popen.pid, signal.SIGCONT)
        dead = [node for node in self.nodes.values() if not node.alive]
        for node in dead:
            if node.process is not None:
                node.process.stop()
            node.start(self.log_dir)
        for node in dead:
            assert node.process is not None
            node.process.wait_for_line("READY", timeout=timeout)
        if self.proxy is None or not self.proxy.alive:
            if self.proxy is not None:
                self.proxy.stop()
            self.start_proxy()
        wait_for(lambda: self.ready_nodes() == {"prefill": 2, "decode": 2}, timeout, "all nodes ready at the proxy")
        # round robin: a burst as large as the nodes of a role reaches each of them once
        for _ in range(2):
            for outcome in burst(self, prompts()[:2], MAX_TOKENS):
                assert outcome.kind is Kind.OK, f"the restored cluster failed a request: {outcome}"

    def ready_nodes(self, url: str | None = None) -> dict[str, int]:
        """The nodes ready by role in the view of the proxy at `url` (default: the cluster's)."""
        try:
            response = httpx.get(f"{url or self.url}/health", timeout=2)
            return dict(response.json().get("ready_nodes", {}))
        except (httpx.HTTPError, ValueError):
            return {}

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.process.popen.pid, signal.SIGCONT)
        processes = [p for p in (self.proxy, self.short_proxy, *(n.process for n in self.nodes.values()))
                     if p is not None]
        for process in processes:  # all at once: each node drains for a while
            if process.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.popen.pid, signal.SIGTERM)
        for process in processes:
            process.stop()
        self.redis.stop()
        self.store.kill()

    # -- what the nodes say ----------------------------------------------------------------------------------------
    def stats(self, name: str, timeout: float = 3.0) -> pb.StatsResponse | None:
        """The node's Stats, None when it does not answer."""
        node = self.nodes[name]
        with grpc.insecure_channel(node.address) as channel:
            stub = (tandem_pb2_grpc.PrefillServiceStub if node.role == "prefill"
                    else tandem_pb2_grpc.DecodeServiceStub)(channel)
            try:
                return stub.Stats(pb.StatsRequest(), timeout=timeout)
            except grpc.RpcError:
                return None

    def leaked_blocks(self, timeout: float) -> dict[str, int]:
        """Once load has stopped: KV blocks still taken on each live node (plus requests still there and tickets
        still pinned) once they are all idle or `timeout` has passed (leases expire within LEASE_S)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():  # a node restarted by the scenario is checked too, once it serves
            if node.process is not None and node.alive:
                node.process.wait_for_line("READY", timeout=120)
        while True:
            leaked = {}
            for name, node in self.nodes.items():
                if not node.alive:
                    continue
                stats = self.stats(name)
                if stats is None:
                    leaked[name] = -1  # a live node that does not answer: counted, and reported
                    continue
                taken = stats.total_kv_blocks - stats.free_kv_blocks
                leaked[name] = taken + stats.num_running + stats.num_waiting + stats.num_pinned_tickets
            if not any(leaked.values()) or time.monotonic() > deadline:
                return leaked
            time.sleep(0.2)

    def fault_log_lines(self, name: str, what: str) -> int:
        return sum(1 for line in self.nodes[name].log().splitlines() if FAULT_LOG_MARK in line and what in line)

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
            if match and match[1] == name and all(f'{k}="{v}"' in (match[2] or "") for k, v in labels.items()):
                total += float(match[3])
        return total


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached in {timeout} s: {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def started_cluster(model: Path, log_dir: Path, oracle: Callable[[Path, list[list[int]], int], list[list[int]]]
                    ) -> Iterator[Cluster]:
    """The cluster at full strength; `oracle(model, prompts, max_new_tokens)` gives the greedy references (it runs
    while the nodes load)."""
    from transformers import AutoTokenizer

    redis = RedisServer(log_dir)
    store = MooncakeMaster(log_dir)
    fault_plan = log_dir / "fault-plan.json"
    FaultPlan().write(fault_plan)
    nodes = {}
    for name in NODE_NAMES:
        port = free_port()
        module = f"{name.split('-')[0]}_node"
        args = [*node_args(model, port), *NODE_FLAGS, *TIER_FLAGS, "--kv-store", store.url, "--node-id", name,
                "--registry", redis.url]
        if module == "prefill_node":
            args += ["--lease-seconds", str(LEASE_S)]
        if name == FAULTY_NODE:
            module, args = "tests.reliability.faulty_node", ["--fault-plan", str(fault_plan), *args]
        nodes[name] = Node(name, port, module, args)
    cluster = Cluster(model, log_dir, redis, store, nodes, fault_plan, free_port(), {},
                      AutoTokenizer.from_pretrained(str(model)))
    try:
        for node in nodes.values():  # started together: they load at the same time
            node.start(log_dir)
        cluster.start_short_proxy()
        all_prompts = prompts()
        cluster.references = dict(zip(map(tuple, all_prompts), oracle(model, all_prompts, LONG_MAX_TOKENS),
                                      strict=True))
        cluster.restore()
        yield cluster
    finally:
        cluster.stop()


# -- the clients -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientBehaviour:
    max_tokens: int = MAX_TOKENS
    leave_share: float = 0.0  # of requests the client abandons after a few streamed events
    read_pause_s: float = 0.0  # a slow reader: this long between reading two events


def stream_once(cluster: Cluster, prompt: list[int], behaviour: ClientBehaviour, rng: random.Random,
                proxy_killed: Callable[[], bool] = lambda: False, url: str | None = None,
                deadline_s: float = REQUEST_TIMEOUT_S) -> Outcome:
    """One greedy streaming completion to `url` (the cluster's proxy by default, whose deadline is `deadline_s`),
    classified."""
    started = time.monotonic()
    hung_at = started + deadline_s + HUNG_MARGIN_S
    leave_after = rng.randint(0, 4) if rng.random() < behaviour.leave_share else None
    body = {"prompt": prompt, "max_tokens": behaviour.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, events, done, error = "", 0, False, None
    status, completion_id = 0, "?"

    def outcome(kind: Kind, detail: str = "", server_error: bool = False) -> Outcome:
        return Outcome(started, time.monotonic(), kind, status, detail, server_error)

    timeout = httpx.Timeout(deadline_s + HUNG_MARGIN_S, connect=5.0)
    try:
        with httpx.Client(timeout=timeout) as client, \
                client.stream("POST", f"{url or cluster.url}/v1/completions", json=body) as response:
            status = response.status_code
            if status != 200:
                return _error_outcome(outcome, response.read(), status)
            for line in response.iter_lines():
                if time.monotonic() > hung_at:
                    return outcome(Kind.HUNG, f"still streaming {HUNG_MARGIN_S} s past the deadline")
                if behaviour.read_pause_s:
                    time.sleep(behaviour.read_pause_s)
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error = event
                    continue
                events += 1
                completion_id = event.get("id", completion_id)
                text += "".join(choice.get("text", "") for choice in event.get("choices", []))
                if leave_after is not None and events > leave_after:
                    return outcome(Kind.LEFT)
    except httpx.TimeoutException as e:
        if time.monotonic() >= hung_at - 1:
            return outcome(Kind.HUNG, repr(e))
        return outcome(Kind.CUT if proxy_killed() else Kind.UNCLEAR, repr(e))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return outcome(Kind.CUT if proxy_killed() else Kind.UNCLEAR, repr(e))
    if time.monotonic() > hung_at:
        return outcome(Kind.HUNG, "ended past the deadline")
    if error is not None:
        return _error_outcome(outcome, json.dumps(error).encode(), status)
    if not done:
        return outcome(Kind.CUT if proxy_killed() else Kind.UNCLEAR, "the stream ended without [DONE]")
    expected = cluster.expected_text(prompt, behaviour.max_tokens)
    if text != expected:
        return outcome(Kind.CORRUPTED, f"{completion_id}: got {text!r}, expected {expected!r}")
    return outcome(Kind.OK)


def _error_outcome(outcome: Callable[..., Outcome], raw: bytes, status: int) -> Outcome:
    """FAILED when the body is an OpenAI error with a message, type and code; UNCLEAR otherwise."""
    try:
        error = json.loads(raw)["error"]
        clear = all(isinstance(error.get(k), str) and error[k] for k in ("message", "type", "code"))
    except (ValueError, KeyError, TypeError):
        error, clear = None, False
    if not clear or error is None:
        return outcome(Kind.UNCLEAR, f"HTTP {status}: {raw[:300]!r}", status >= 500)
    server_error = status >= 500 or error["type"] in ("server_error", "service_unavailable")
    return outcome(Kind.FAILED, f"HTTP {status} {error['code']}: {error['message']}", server_error)


class Load:
    """`num_clients` threads, each streaming one request after another (prompts in a seeded random order) until
    stopped; every outcome recorded."""

    def __init__(self, cluster: Cluster, num_clients: int, behaviour: ClientBehaviour | None = None,
                 proxy_killed: Callable[[], bool] = lambda: False, seed: int = 0, url: str | None = None,
                 deadline_s: float = REQUEST_TIMEOUT_S) -> None:
        self.cluster = cluster
        self.url = url
        self.deadline_s = deadline_s
        self.behaviour = behaviour or ClientBehaviour()
        self.proxy_killed = proxy_killed
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
                         for i in range(num_clients)]

    def _run(self, rng: random.Random) -> None:
        all_prompts = prompts()
        while not self._stop.is_set():
            outcome = stream_once(self.cluster, rng.choice(all_prompts), self.behaviour, rng, self.proxy_killed,
                                  self.url, self.deadline_s)
            self.outcomes.append(outcome)
            if outcome.kind is Kind.CUT:  # the proxy is down: no point in hammering its port
                time.sleep(0.2)

    def successes_after(self, moment: float) -> int:
        return sum(1 for o in self.outcomes if o.kind is Kind.OK and o.started >= moment)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.deadline_s + 2 * HUNG_MARGIN_S)
        assert not any(t.is_alive() for t in self._threads), "a client thread outlived its request's hung margin"


def burst(cluster: Cluster, prompt_list: list[list[int]], max_tokens: int) -> list[Outcome]:
    results: list[Outcome] = [None] * len(prompt_list)  # type: ignore[list-item]

    def one(i: int) -> None:
        results[i] = stream_once(cluster, prompt_list[i], ClientBehaviour(max_tokens), random.Random(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompt_list))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# -- a scenario's row ------------------------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    outcomes: list[Outcome]
    leaked: dict[str, int]
    recovery_s: float | None
    notes: str = ""

    def count(self, kind: Kind) -> int:
        return sum(1 for o in self.outcomes if o.kind is kind)

    @property
    def num_5xx(self) -> int:
        return sum(1 for o in self.outcomes if o.server_error)

    @property
    def leaked_blocks(self) -> int:
        return sum(abs(v) for v in self.leaked.values())

    def latency(self, quantile: float) -> float | None:
        seconds = sorted(o.seconds for o in self.outcomes if o.kind is Kind.OK)
        if not seconds:
            return None
        if len(seconds) == 1:
            return seconds[0]
        return statistics.quantiles(seconds, n=100, method="inclusive")[round(quantile * 100) - 1]

    def failures(self, *kinds: Kind) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind in kinds]

    def cells(self) -> list[str]:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        return [self.scenario, str(len(self.outcomes)), str(self.count(Kind.OK)), str(self.count(Kind.FAILED)),
                str(self.count(Kind.UNCLEAR)), str(self.count(Kind.HUNG)), str(self.num_5xx),
                str(self.count(Kind.CORRUPTED)), str(self.leaked_blocks), str(self.count(Kind.CUT)),
                str(self.count(Kind.LEFT)), seconds(self.recovery_s), seconds(self.latency(0.5)),
                seconds(self.latency(0.99)), self.notes]


HEADER = ["scenario", "sent", "ok", "failed (clear error)", "unclear error", "hung", "5xx", "corrupted",
          "leaked blocks", "cut (proxy killed)", "left by client", "recovery s", "p50 s", "p99 s", "notes"]


def recovery_seconds(outcomes: list[Outcome], fault_at: float) -> float | None:
    """From the fault to the end of the first success among the requests sent after it."""
    ends = [o.ended for o in outcomes if o.kind is Kind.OK and o.started >= fault_at]
    return min(ends) - fault_at if ends else None


def write_report(rows: list[Row], path: Path | None = None) -> Path:
    """bench/results/reliability-<date>.md: one row per scenario, merged into the day's file (a row of the same
    scenario replaced), so that a run of some scenarios keeps the others' rows."""
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    path = path or ROOT / "bench" / "results" / f"reliability-{today}.md"
    table: dict[str, list[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == len(HEADER) and cells[0] not in (HEADER[0], "---"):
                table[cells[0]] = cells
    for row in rows:
        table[row.scenario] = row.cells()
    lines = [
        f"# Reliability: the fault suite ({today})",
        "",
        "Written by `tests/reliability/` (`pytest tests/reliability --reliability-report PATH`; part of `make test`) "
        f"on {socket.gethostname()}: a real cluster on loopback (Redis, 2 prefill + 2 decode nodes of the tiny test "
        "model, CPU, NIXL, both KV tiers on every node; a proxy routing round robin, every request disaggregated), "
        "concurrent greedy streaming clients, each fault injected under load. Must be zero in every row: unclear "
        "error, hung, corrupted, leaked blocks; 5xx too except where the scenario's notes say the fault is the error "
        "(deadlines). `ok` means the transformers greedy reference, token for token. Recovery: from the fault to the "
        "end of the first success among requests sent after it. Latencies are of the successes, on a shared 2-core "
        "box.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(cells) + " |" for cells in table.values()),
        "",
    ]
    path.write_text("\n".join(lines))
    return path
