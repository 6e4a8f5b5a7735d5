"""The OpenAI API through the official `openai` SDK against a live cluster (one prefill node, one decode
node and the proxy as processes on loopback): chat and completions, streaming with usage, n, stop strings,
seeds, logprobs, the prefix hit in usage, every error status, client disconnects, and /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from engine.tokenizer import load_tokenizer
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from proxy.app import ProxyState, create_app
from proxy.directory import NodeDirectory
from proxy.pd import PDPipeline
from proxy.router import Router, RouterConfig
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import Process, free_port, start_node, start_proxy

pytestmark = pytest.mark.integration

API_KEY = "sk-tandem-test"
CHAT: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@dataclass
class Cluster:
    model: Path
    prefill_address: str
    decode_address: str
    url: str  # an open proxy
    guarded_url: str  # a proxy with --api-key and --max-num-requests 1
    processes: list[Process]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def stats(self, role: str) -> pb.StatsResponse:
        return asyncio.run(_stats(self.prefill_address if role == "prefill" else self.decode_address, role))

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` (on the open proxy) whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
            if line.startswith("#") or match is None or match[1] != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match[3])
        return total


async def _stats(address: str, role: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = (tandem_pb2_grpc.PrefillServiceStub if role == "prefill" else tandem_pb2_grpc.DecodeServiceStub)(channel)
        return await stub.Stats(pb.StatsRequest(), timeout=5)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("openai-logs")
    processes: list[Process] = []
    try:
        prefill, prefill_address = start_node("prefill", model, "nixl", log_dir)
        processes.append(prefill)
        decode, decode_address = start_node("decode", model, "nixl", log_dir)
        processes.append(decode)
        # every request disaggregated: the first token (and its logprobs, and the prefix hit) come from P
        proxy, url = start_proxy(model, prefill_address, decode_address, log_dir,
                                 ["--block-size", "4", "--colocate-max-tokens", "0"])
        processes.append(proxy)
        # the router's default: short prompts run on D alone
        guarded, guarded_url = start_proxy(model, prefill_address, decode_address, log_dir,
                                           ["--block-size", "4", "--api-key", API_KEY, "--max-num-requests", "1"])
        processes.append(guarded)
        yield Cluster(model, prefill_address, decode_address, url, guarded_url, processes)
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Any:
    return AutoTokenizer.from_pretrained(str(cluster.model))


def all_resources_free(cluster: Cluster) -> bool:
    p, d = cluster.stats("prefill"), cluster.stats("decode")
    return (d.num_running == 0 and d.num_waiting == 0 and p.num_pinned_tickets == 0
            and p.free_kv_blocks == p.total_kv_blocks and d.free_kv_blocks == d.total_kv_blocks)


# ---- the happy paths ----

def test_models_lists_the_served_model(cluster: Cluster) -> None:
    client = cluster.client()
    assert [m.id for m in client.models.list().data] == [cluster.model.name]
    assert client.models.retrieve(cluster.model.name).id == cluster.model.name


def test_chat_answers_with_an_assistant_message_and_counts_the_templated_prompt(cluster: Cluster, tokenizer: Any
                                                                                ) -> None:
    r = cluster.client().chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == cluster.model.name
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert r.usage is not None and r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    # the same prompt through /v1/completions gives the same greedy text
    same = cluster.client().completions.create(model=cluster.model.name, prompt=prompt, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert same.choices[0].text == choice.message.content


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(cluster: Cluster) -> None:
    client = cluster.client()
    kwargs: dict[str, Any] = {"model": cluster.model.name, "prompt": "The license", "max_tokens": 10,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text_chunks, last = chunks[:-1], chunks[-1]
    assert len(text_chunks) >= 2 and all(c.usage is None for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert whole.usage is not None and last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_sends_the_role_first_and_usage_last(cluster: Cluster) -> None:
    client = cluster.client()
    whole = client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_samples_are_seeded_seed_plus_index_and_reproducible(cluster: Cluster) -> None:
    client = cluster.client()
    kwargs: dict[str, Any] = {"model": cluster.model.name, "prompt": "Python", "max_tokens": 12, "temperature": 1.0,
                              "extra_body": {"ignore_eos": True}}
    both = client.completions.create(**kwargs, n=2, seed=7)
    assert sorted(c.index for c in both.choices) == [0, 1]
    assert both.usage is not None and both.usage.completion_tokens == 24
    texts = {c.index: c.text for c in both.choices}
    assert texts[0] != texts[1]
    assert client.completions.create(**kwargs, seed=7).choices[0].text == texts[0]
    assert client.completions.create(**kwargs, seed=8).choices[0].text == texts[1]
    again = client.completions.create(**kwargs, n=2, seed=7)
    assert {c.index: c.text for c in again.choices} == texts
    # chat streams n choices too, each with its role chunk first
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=5, n=2,
                                                 seed=3, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finishes) == {0, 1}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_a_stop_string_ends_the_text_before_it(cluster: Cluster) -> None:
    client = cluster.client()
    kwargs: dict[str, Any] = {"model": cluster.model.name, "prompt": "The license", "max_tokens": 16,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    expected = text[:text.index(stop)]
    r = client.completions.create(**kwargs, stop=[stop, "never appears"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_until(lambda: all_resources_free(cluster))


def test_logprobs_have_one_entry_per_token_with_the_top_alternatives(cluster: Cluster) -> None:
    client = cluster.client()
    r = client.completions.create(model=cluster.model.name, prompt="The license", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == 5 and "".join(logprobs.tokens) == r.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs,
                                   strict=True):
        assert len(top) == 3 and logprob <= 0 and top[token] == logprob == max(top.values())  # greedy: the best
    chat = client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 4
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(bytes(e.bytes or []) == e.token.encode() for e in content)
    # streamed, each chunk's logprobs are those of its tokens
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_usage_reports_the_prefix_hit_of_a_repeated_prompt(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks of 4
    first = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens == 30 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 28  # the prefill node's hit: 7 blocks of 4


def test_a_colocated_request_reports_the_decode_nodes_prefix_hit(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompt = list(range(100, 122))  # 22 tokens, short enough to run on D alone
    first = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=1)
    second = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=1)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 20  # D's own hit: 5 blocks of 4
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].logprobs is not None and len(second.choices[0].logprobs.tokens or []) == 3


# ---- errors ----

def test_bad_requests_get_400_with_the_openai_envelope_and_the_proxy_survives(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=cluster.model.name, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=cluster.model.name, messages=CHAT,
                                       response_format={"type": "json_object"})
    assert "not supported" in e.value.message and e.value.param == "response_format"
    bad_bodies: list[Any] = [
        [], "text", {"prompt": ""}, {"prompt": 3}, {"prompt": [[]]}, {"prompt": "x", "max_tokens": "many"},
        {"prompt": "x", "n": 0}, {"prompt": "x", "n": 10_000}, {"prompt": "x", "logprobs": 99},
        {"prompt": "x", "stop": [""]}, {"prompt": [1, 2, 10**9]}, {"prompt": "x", "top_p": 0},
        {"prompt": "x", "stream_options": {"include_usage": True}}, {"prompt": "x", "seed": "7"},
        {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, {"prompt": "x", "temperature": True},
    ]
    for body in bad_bodies:
        r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
    chat_bodies: list[Any] = [
        {}, {"messages": []}, {"messages": [{"content": "no role"}]}, {"messages": "hi"},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": CHAT, "logprobs": False, "top_logprobs": 2}, {"messages": CHAT, "tools": [{"type": "function"}]},
    ]
    for body in chat_bodies:
        r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    r = httpx.post(f"{cluster.url}/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400
    r = httpx.get(f"{cluster.url}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.completions.create(model=cluster.model.name, prompt="still", max_tokens=2).choices


def test_an_unknown_model_gets_404(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        cluster.client().chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.code == "model_not_found"


def test_a_prompt_beyond_the_context_gets_413(cluster: Cluster) -> None:
    with pytest.raises(openai.APIStatusError) as e:  # max_position_embeddings = 256
        cluster.client().completions.create(model=cluster.model.name, prompt=[5] * 250, max_tokens=10)
    assert e.value.status_code == 413 and e.value.code == "context_length_exceeded"
    r = cluster.client().completions.create(model=cluster.model.name, prompt=[5] * 240, max_tokens=10,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 10


def test_a_wrong_api_key_gets_401(cluster: Cluster) -> None:
    wrong = openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=cluster.model.name, prompt="x", max_tokens=2)
    assert e.value.code == "invalid_api_key"
    assert httpx.post(f"{cluster.guarded_url}/v1/completions", json={"prompt": "x"}).status_code == 401
    right = openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0)
    assert right.completions.create(model=cluster.model.name, prompt="x", max_tokens=2).choices
    assert httpx.get(f"{cluster.guarded_url}/health").status_code == 200  # probes need no key


def test_requests_beyond_the_proxy_limit_get_429_with_retry_after(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with client.completions.create(model=cluster.model.name, prompt="hold", max_tokens=200, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}) as held:
        next(iter(held))  # in flight now: the limit is 1
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=cluster.model.name, prompt="x", max_tokens=2)
        assert int(e.value.response.headers["Retry-After"]) >= 1
    wait_until(lambda: all_resources_free(cluster))
    assert client.completions.create(model=cluster.model.name, prompt="x", max_tokens=2).choices


def test_no_reachable_nodes_gets_503(tiny_model: TinyModelFactory) -> None:
    dead_prefill, dead_decode = "127.0.0.1:1", "127.0.0.1:2"  # nothing listens there (privileged ports)
    tokenizer = load_tokenizer(tiny_model("llama"))

    async def run(directory: NodeDirectory, code: str) -> None:
        app = create_app(ProxyState(PDPipeline(directory, Router(directory)), tokenizer, "tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
            client = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="x", http_client=http, max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                await client.chat.completions.create(model="tiny", messages=CHAT)
            assert e.value.status_code == 503 and e.value.code == code
            with pytest.raises(openai.InternalServerError):
                await client.completions.create(model="tiny", prompt="x", stream=True)
            assert (await http.get("/health")).status_code == 503
            assert "tandem:node_up" in (await http.get("/metrics")).text
        await directory.close()

    asyncio.run(run(NodeDirectory([dead_prefill], [dead_decode]), "unavailable"))  # listed, but down
    asyncio.run(run(NodeDirectory(), "no_healthy_nodes"))  # none at all


def test_a_saturated_cluster_gets_429_from_the_router(cluster: Cluster) -> None:
    """A router that counts one running request as a full decode node refuses the next one."""
    directory = NodeDirectory([cluster.prefill_address], [cluster.decode_address], block_size=4)
    router = Router(directory, RouterConfig(block_size=4, colocate_max_tokens=0, max_queue_factor=0.1))
    app = create_app(ProxyState(PDPipeline(directory, router), load_tokenizer(cluster.model), "tiny"))

    async def run() -> None:
        server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1", api_key="x",
                                    max_retries=0)
        try:
            held = await client.completions.create(model="tiny", prompt="hold", max_tokens=200, stream=True,
                                                   extra_body={"ignore_eos": True})
            chunks = aiter(held)
            await anext(chunks)
            await anext(chunks)  # from D: the request runs there now
            with pytest.raises(openai.RateLimitError) as e:
                await client.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert e.value.code == "overloaded" and int(e.value.response.headers["Retry-After"]) >= 1
            await held.close()
        finally:
            server.should_exit = True
            await serving

    asyncio.run(run())
    assert router.decision_counts["disaggregated"] == 1
    wait_until(lambda: all_resources_free(cluster))


# ---- disconnects and metrics ----

def test_a_client_that_goes_away_aborts_every_choice_on_the_nodes(cluster: Cluster) -> None:
    aborted_before = cluster.metric("tandem:request_success_total", finished_reason="abort")
    # streaming: gone once both choices stream from D
    num_chunks: Counter[int] = Counter()
    with cluster.client().completions.create(model=cluster.model.name, prompt="long", max_tokens=100, n=2,
                                             stream=True, extra_body={"ignore_eos": True}) as stream:
        for chunk in stream:
            num_chunks[chunk.choices[0].index] += 1
            if min(num_chunks[0], num_chunks[1]) >= 2:
                break
    wait_until(lambda: all_resources_free(cluster))

    # not streaming: the proxy notices the closed connection while it waits for the tokens
    async def leave_while_decoding() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt": "long", "max_tokens": 240, "ignore_eos": True}
            waiting = asyncio.create_task(http.post(f"{cluster.url}/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while (await _stats(cluster.decode_address, "decode")).num_running == 0:
                assert not waiting.done() and time.monotonic() < deadline, "the request never reached D"
                await asyncio.sleep(0.01)
            waiting.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await waiting

    asyncio.run(leave_while_decoding())
    wait_until(lambda: all_resources_free(cluster))
    # each choice is counted once its stream is closed, just after the nodes were told
    wait_until(lambda: cluster.metric("tandem:request_success_total", finished_reason="abort") - aborted_before == 3)


def test_metrics_expose_the_request_and_node_series(cluster: Cluster) -> None:
    cluster.client().completions.create(model=cluster.model.name, prompt="count me", max_tokens=3)
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for name in ("tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
                 "tandem:e2e_request_latency_seconds", "tandem:request_success_total", "tandem:prompt_tokens_total",
                 "tandem:generation_tokens_total", "tandem:num_requests_running", "tandem:pd_decisions_total",
                 "tandem:kv_cache_usage_perc", "tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total",
                 "tandem:kv_transfer_failures_total", "tandem:prefill_leases_expired_total",
                 "tandem:num_requests_waiting", "tandem:kv_transfer_bytes_total", "tandem:kv_transfer_seconds"):
        assert f"# TYPE {name} " in text, name
    model = {"model_name": cluster.model.name}
    assert cluster.metric("tandem:time_to_first_token_seconds_count", **model) >= 1
    assert cluster.metric("tandem:request_success_total", finished_reason="length", **model) >= 1
    assert cluster.metric("tandem:generation_tokens_total", **model) >= 3
    assert cluster.metric("tandem:num_requests_running", **model) == 0
    assert cluster.metric("tandem:node_up", role="prefill") == cluster.metric("tandem:node_up", role="decode") == 1
    assert cluster.metric("tandem:pd_decisions_total", mode="disaggregated", **model) >= 1
    assert cluster.metric("tandem:pd_decisions_total", mode="colocated", **model) == 0  # --colocate-max-tokens 0
    assert cluster.metric("tandem:prefix_cache_queries_total", role="prefill") >= 3
    assert 0 <= cluster.metric("tandem:kv_cache_usage_perc", role="decode") <= 1
    # the disaggregated requests pulled their prompts' blocks
    assert cluster.metric("tandem:kv_transfer_seconds_count", role="decode") >= 1
    assert cluster.metric("tandem:kv_transfer_bytes_total", role="decode") > 0


def test_a_client_that_goes_away_during_prefill_leaks_nothing(cluster: Cluster) -> None:
    client = cluster.client()
    for _ in range(8):
        with client.completions.create(model=cluster.model.name, prompt="long", max_tokens=100, n=2,
                                       stream=True, extra_body={"ignore_eos": True}) as stream:
            next(iter(stream))  # the other choice may still be prefilling, or reserving blocks on D
    wait_until(lambda: all_resources_free(cluster), timeout=5)
