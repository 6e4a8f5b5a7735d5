"""Decode migration (issue 13, item 2): a decode node killed (kill -9) while it streams requests does not fail
them. The proxy continues each one on the other decode node from the prompt and the tokens already sent, and every
client gets one uninterrupted stream: the greedy output of an undisturbed run, each token once, usage counted once.

Real processes: one prefill node, two decode nodes and a proxy routing round robin (every request handed from P
to the decode nodes in turn). A streaming chat and two streaming completions start one after the other, so the
chat and the second completion share a decode node and the first completion has the other; once every stream has
received some tokens, the chat's decode node is killed.

The oracle: each request run undisturbed first (no failure, so no migration code runs), its first tokens checked
against transformers' greedy output. Transformers recomputes the whole sequence for each token: too slow on this
box for streams long enough to be killed midway (a tiny model streams some 300 tokens a second)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from engine.detokenizer import decode_token
from engine.types import SamplingParams
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import params_to_proto
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.openai_cluster import CHAT, node_stats, wait_until
from tests.integration.processes import Process, free_port, node_args, start_proxy

pytestmark = pytest.mark.integration

CONTEXT = 1024  # the tiny model's, raised so that streams last seconds
PROMPTS = [list(range(100 + 30 * i, 120 + 30 * i)) for i in range(2)]  # distinct: each its own output
MAX_TOKENS = 500  # of a completion
# the completion alone on its decode node: it must still run when the third stream has its first tokens, also on a
# box loaded by a second test worker (with 500 it once finished first); the survivor holds all three streams
LONE_MAX_TOKENS = 960
MAX_CHAT_TOKENS = 600  # the chat's: it starts first and must still run at the kill
KILL_AFTER = 3  # tokens each stream has received (the first from P, the others from its decode node) at the kill
HF_TOKENS = 12  # the first tokens of each output that transformers checks
NODE_FLAGS = ["--num-kv-blocks", "640"]  # every stream fits on one decode node
PROXY_FLAGS = ["--block-size", "4", "--routing", "round_robin"]


@dataclass
class MigrationCluster:
    model: Path
    url: str
    prefill_address: str
    decode: list[tuple[Process, str]]


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    model = tiny_model("llama", max_position_embeddings=CONTEXT)
    log_dir = tmp_path_factory.mktemp("decode-migration-logs")
    processes: list[Process] = []
    try:
        nodes = []
        for role in ("prefill", "decode", "decode"):  # started together: they load at the same time
            port = free_port()
            processes.append(Process(f"{role}_node", [*node_args(model, port), *NODE_FLAGS], log_dir))
            nodes.append((processes[-1], f"127.0.0.1:{port}"))
        for process, _ in nodes:
            process.wait_for_line("READY")
        listed = ["--prefill", nodes[0][1], "--decode", nodes[1][1], "--decode", nodes[2][1]]
        proxy, url = start_proxy(model, None, None, log_dir, [*listed, *PROXY_FLAGS])
        processes.append(proxy)
        yield MigrationCluster(model, url, nodes[0][1], nodes[1:])
    finally:
        for process in reversed(processes):
            process.stop()


@dataclass
class Stream:
    """One streaming request read as it comes: the text, the tokens counted by their logprobs, the usage."""

    path: str
    body: dict[str, Any]
    max_tokens: int = MAX_TOKENS
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # each token's text, from its logprobs
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.body = {**self.body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                     "ignore_eos": True, "max_tokens": self.max_tokens}

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def start(self, client: httpx.Client) -> Stream:
        self.thread = threading.Thread(target=self._read, args=(client,), daemon=True)
        self.thread.start()
        return self

    def _read(self, client: httpx.Client) -> None:
        try:
            with client.stream("POST", self.path, json=self.body) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode()}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.error = json.dumps(event["error"])
                    self.usage = event.get("usage") or self.usage
                    for choice in event.get("choices", []):
                        self._add(choice)
        except httpx.HTTPError as e:
            self.error = repr(e)

    def _add(self, choice: dict[str, Any]) -> None:
        logprobs = choice.get("logprobs") or {}
        if "delta" in choice:  # chat
            self.text += choice["delta"].get("content") or ""
            self.tokens += [entry["token"] for entry in logprobs.get("content") or []]
        else:
            self.text += choice["text"]
            self.tokens += logprobs.get("tokens") or []
        self.finish_reason = choice.get("finish_reason") or self.finish_reason


def undisturbed(client: httpx.Client, stream: Stream) -> tuple[str, list[str]]:
    """The text and the token texts of the same request, not streamed and not disturbed."""
    body = {**stream.body, "stream": False}
    del body["stream_options"]
    choice = client.post(stream.path, json=body).json()["choices"][0]
    if "message" in choice:
        return choice["message"]["content"], [entry["token"] for entry in choice["logprobs"]["content"]]
    return choice["text"], choice["logprobs"]["tokens"]


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def num_running(address: str) -> int:
    return int(asyncio.run(node_stats(address, "decode")).num_running)


def idle_with_every_block_free(address: str, role: str) -> bool:
    stats = asyncio.run(node_stats(address, role))
    return (stats.num_running == 0 and stats.num_waiting == 0 and stats.num_pinned_tickets == 0
            and stats.free_kv_blocks == stats.total_kv_blocks)


def test_streams_on_a_killed_decode_node_continue_on_the_other_one_with_the_greedy_output(
        cluster: MigrationCluster) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)
    prompts = [chat_prompt, *PROMPTS]
    chat = Stream("/v1/chat/completions", {"model": cluster.model.name, "messages": CHAT, "logprobs": True},
                  MAX_CHAT_TOKENS)
    completions = [Stream("/v1/completions", {"model": cluster.model.name, "prompt": p, "logprobs": 0}, max_tokens)
                   for p, max_tokens in zip(PROMPTS, (LONE_MAX_TOKENS, MAX_TOKENS), strict=True)]
    streams = [chat, *completions]
    with httpx.Client(base_url=cluster.url, timeout=60) as client, ThreadPoolExecutor(len(streams)) as pool:
        expected = list(pool.map(lambda stream: undisturbed(client, stream), streams))
        for (_, tokens), greedy in zip(expected, hf_greedy(cluster.model, prompts, HF_TOKENS), strict=True):
            assert tokens[:HF_TOKENS] == [decode_token(tokenizer, t) for t in greedy], "not transformers' output"
        migrated = metric(cluster.url, "tandem:decode_migrations_total", outcome="migrated")

        # one after the other (each routed once its first token came back from P): round robin hands the first
        # and the third to one decode node, the second to the other
        for stream in streams:
            stream.start(client)
            wait_until(lambda stream=stream: stream.num_tokens >= 1 or stream.error is not None,  # type: ignore[misc]
                       timeout=30)
        wait_until(lambda: all(s.num_tokens >= KILL_AFTER or s.error is not None for s in streams), timeout=30)
        running = {address: num_running(address) for _, address in cluster.decode}
        assert sorted(running.values()) == [1, 2], f"a stream ended before the kill: {running}"
        victim, victim_address = next((p, a) for p, a in cluster.decode if running[a] == 2)  # the chat's
        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in streams:
            stream.thread.join(60)

    for stream, prompt, (text, tokens) in zip(streams, prompts, expected, strict=True):
        assert stream.error is None, f"{stream.path} failed after the kill: {stream.error}"
        assert stream.tokens == tokens and stream.text == text, f"{stream.path}: not the undisturbed output"
        assert stream.num_tokens == stream.max_tokens and stream.finish_reason == "length"
        assert stream.usage is not None and stream.usage["prompt_tokens"] == len(prompt)
        assert stream.usage["completion_tokens"] == stream.max_tokens
    # the chat and the second completion migrated
    assert metric(cluster.url, "tandem:decode_migrations_total", outcome="migrated") == migrated + 2
    # none hung (each had 60 s after the kill); how long migration takes is a benchmark's question, not a test's: a
    # 30 s bound here failed on a loaded box at 37 s with every stream correct
    hung = [stream.path for stream in streams if stream.thread.is_alive()]
    assert not hung, f"{hung} still running {time.monotonic() - killed_at:.0f} s after the kill"
    # nothing leaked: the survivor and P end with every block free, every ticket released
    survivor_address = next(a for _, a in cluster.decode if a != victim_address)
    wait_until(lambda: idle_with_every_block_free(survivor_address, "decode"), timeout=10)
    wait_until(lambda: idle_with_every_block_free(cluster.prefill_address, "prefill"), timeout=10)


def test_a_decode_node_continues_a_request_after_its_output_tokens_and_checks_them(cluster: MigrationCluster
                                                                                    ) -> None:
    """The continuation at D's edge (what the proxy sends when it migrates): the tokens after the given output are
    those of the request run whole; a continuation with nothing left to generate, or with a ticket, is refused."""
    address = next(a for process, a in cluster.decode if process.alive)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    async def generate(**fields: Any) -> list[int] | tuple[grpc.StatusCode, str]:
        request = pb.GenerateRequest(request_id=f"edge-{time.monotonic_ns()}", prompt_token_ids=PROMPTS[0],
                                     params=params, **fields)
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                call = tandem_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=30)
                return [t async for r in call for t in r.token_ids]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""

    whole = asyncio.run(generate())
    assert isinstance(whole, list) and len(whole) == 6
    assert asyncio.run(generate(output_token_ids=whole[:2])) == whole[2:]
    refused = asyncio.run(generate(output_token_ids=whole))
    assert isinstance(refused, tuple) and refused[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "nothing is left to generate" in refused[1]
    refused = asyncio.run(generate(output_token_ids=whole[:2], ticket=pb.KVTicket(ticket_id="t")))
    assert isinstance(refused, tuple) and refused[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "colocated request only" in refused[1]
