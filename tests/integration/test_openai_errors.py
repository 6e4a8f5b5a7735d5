"""The OpenAI API's failures against a live cluster: every error status with the OpenAI envelope, clients
that go away (nothing leaks on the nodes), and the /metrics series."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from engine.tokenizer import load_tokenizer
from proxy.api.app import ProxyState, create_app
from proxy.routing.directory import NodeDirectory
from proxy.routing.pd import PDPipeline
from proxy.routing.router import Router, RouterConfig
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.openai_cluster import (
    API_KEY,
    CHAT,
    Cluster,
    all_resources_free,
    node_stats,
    running_cluster,
    wait_until,
)
from tests.integration.processes import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model("llama"), tmp_path_factory.mktemp("openai-logs")) as cluster:
        yield cluster


# ---- errors ----

def test_bad_requests_get_400_with_the_openai_envelope_and_the_proxy_survives(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=cluster.model.name, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=cluster.model.name, messages=CHAT,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "schema" in e.value.message and e.value.param == "response_format"
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


def test_a_prompt_beyond_the_context_gets_400_with_openais_message(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # max_position_embeddings = 256
        cluster.client().completions.create(model=cluster.model.name, prompt=[5] * 250, max_tokens=10)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    # OpenAI's wording, numbers from arithmetic on the request
    assert e.value.response.json()["error"]["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 260 tokens (250 in the prompt, "
        "10 in the completion). Please reduce the length of the prompt or completion.")
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
            assert "127.0.0.1" not in str(e.value.body)  # the proxy's log has the address, the client not
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
            while (await node_stats(cluster.decode_address, "decode")).num_running == 0:
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
