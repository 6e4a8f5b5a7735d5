"""The proxy's request edge against hostile and huge bodies (issue 13, defects 1 and 5): a body over the limit gets
413 before it is read, a big body is tokenized off the event loop (streams, new requests and /health go on), and
malformed text (lone UTF-16 surrogates in any field, JSON nested thousands deep, integers of thousands of digits)
gets a 400 with the OpenAI envelope, never a 500. Real nodes behind the proxy, so that what the edge lets through
is served for real."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from engine.tokenizer import load_tokenizer
from proxy.api.app import ProxyState, create_app
from proxy.routing.directory import NodeDirectory
from proxy.routing.pd import PDPipeline
from proxy.routing.router import Router, RouterConfig
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.openai_cluster import Cluster, all_resources_free, running_cluster, wait_until
from tests.integration.processes import free_port, start_proxy

pytestmark = pytest.mark.integration

ENVELOPE = {"message", "type", "param", "code"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model("llama"), tmp_path_factory.mktemp("edge-logs"), with_guarded_proxy=False) as c:
        yield c


def proxy_state(cluster: Cluster, **kwargs: Any) -> ProxyState:
    """An in-process proxy (its app is served by the test) in front of the cluster's nodes."""
    directory = NodeDirectory([cluster.prefill_address], [cluster.decode_address], block_size=4)
    router = Router(directory, RouterConfig(block_size=4))
    return ProxyState(PDPipeline(directory, router), load_tokenizer(cluster.model), "tiny", max_model_len=256,
                      **kwargs)


def with_app(state: ProxyState, test: Callable[[httpx.AsyncClient], Any]) -> None:
    """Runs `test` with an HTTP client of the state's app (in memory: no server), then closes the proxy."""
    async def run() -> None:
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60) as http:
            await test(http)
        await state.pipeline.close()
        state.close()

    asyncio.run(run())


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == ENVELOPE, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- defect 1: body size ----

def test_a_body_over_the_limit_gets_413_before_it_is_read(cluster: Cluster) -> None:
    limit = 64 * 1024
    body = json.dumps({"prompt": "word " * 50_000, "max_tokens": 2}).encode()  # about 250 KB of valid JSON
    pieces = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    num_sent = 0

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the proxy counts as the bytes come
        nonlocal num_sent
        for piece in pieces:
            num_sent += 1
            yield piece

    async def test(http: httpx.AsyncClient) -> None:
        error = assert_error(await http.post("/v1/completions", content=body), 413)
        assert error["code"] == "request_too_large" and str(limit) in error["message"]
        assert_error(await http.post("/v1/chat/completions", content=chunked()), 413)
        # it stopped reading just past the limit: 17 pieces of 4 KiB, of 62
        assert num_sent == limit // 4096 + 1 < len(pieces)
        small = await http.post("/v1/completions", json={"prompt": "word " * 10, "max_tokens": 2})
        assert small.status_code == 200, small.text

    with_app(proxy_state(cluster, max_request_body_bytes=limit), test)


def test_the_body_limit_is_a_proxy_flag_and_a_served_proxy_answers_413_then_serves_on(
        cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    proxy, url = start_proxy(cluster.model, cluster.prefill_address, cluster.decode_address,
                             tmp_path_factory.mktemp("edge-proxy"), ["--max-request-body-bytes", "65536"])
    try:
        big = {"prompt": "word " * 200_000, "max_tokens": 2}  # 1 MB: the client is still sending when refused
        with httpx.Client(base_url=url, timeout=60) as http:
            assert_error(http.post("/v1/completions", json=big), 413)
            assert_error(http.post("/v1/completions", content=(c for c in [json.dumps(big).encode()] * 4)), 413)
            r = http.post("/v1/completions", json={"prompt": "word", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proxy.stop()


# ---- defect 1: tokenization off the event loop ----

def test_a_big_body_being_tokenized_stalls_no_stream_no_new_request_and_no_health_check(cluster: Cluster) -> None:
    """A chat body of 1.5 MB takes seconds to tokenize (then gets 400: far over the context). Meanwhile a running
    stream goes on, a new request is served and /health answers: each finishes before the big request does."""
    state = proxy_state(cluster)
    big = {"messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. Ünï 漢字 " * 30_000}],
           "max_tokens": 2}
    finished: dict[str, float] = {}

    async def timed(name: str, request: Any) -> httpx.Response:
        response: httpx.Response = await request
        finished[name] = time.monotonic()
        return response

    async def run() -> httpx.Response:
        server = uvicorn.Server(uvicorn.Config(create_app(state), port=free_port(), log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.port}", timeout=120) as http:
                body = {"prompt": "hold", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as stream:
                    events = stream.aiter_lines()
                    await _next_token(events)  # the stream runs
                    big_request = asyncio.create_task(timed("big", http.post("/v1/chat/completions", json=big)))
                    await asyncio.sleep(0.2)  # its body is in: it is being tokenized
                    health = await timed("health", http.get("/health"))
                    small = await timed("small", http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
                    for _ in range(20):
                        await _next_token(events)
                    finished["stream"] = time.monotonic()
                    assert health.status_code == 200 and small.status_code == 200, (health.text, small.text)
                    return await big_request
        finally:
            server.should_exit = True
            await serving
            state.close()

    response = asyncio.run(run())
    assert finished["health"] < finished["big"], finished
    assert finished["small"] < finished["big"] and finished["stream"] < finished["big"], finished
    error = assert_error(response, 400, "messages")
    assert error["code"] == "context_length_exceeded"
    wait_until(lambda: all_resources_free(cluster))


async def _next_token(events: AsyncIterator[str]) -> None:
    async for line in events:
        if line.startswith("data: {"):
            return
    raise AssertionError("the stream ended early")


# ---- defect 5: hostile input ----

SURROGATE = "\ud800"

# field -> (endpoint, body with the text in that field, the param the 400 names)
FIELDS: dict[str, tuple[str, Callable[[str], dict[str, Any]], str]] = {
    "prompt": ("/v1/completions", lambda s: {"prompt": s}, "prompt"),
    "one of the prompts": ("/v1/completions", lambda s: {"prompt": ["fine", s]}, "prompt"),
    "model": ("/v1/completions", lambda s: {"model": s, "prompt": "x"}, "model"),
    "stop": ("/v1/completions", lambda s: {"prompt": "x", "stop": s}, "stop"),
    "one of the stops": ("/v1/completions", lambda s: {"prompt": "x", "stop": ["\n", s]}, "stop"),
    "user": ("/v1/completions", lambda s: {"prompt": "x", "user": s}, "user"),
    "suffix": ("/v1/completions", lambda s: {"prompt": "x", "suffix": s}, "suffix"),
    "chat content": ("/v1/chat/completions", lambda s: {"messages": [{"role": "user", "content": s}]}, "messages"),
    "chat role": ("/v1/chat/completions", lambda s: {"messages": [{"role": s, "content": "x"}]}, "messages"),
    "chat name": ("/v1/chat/completions", lambda s: {"messages": [{"role": "user", "content": "x", "name": s}]},
                  "messages"),
    "chat text part": ("/v1/chat/completions",
                       lambda s: {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
                       "messages"),
    "chat model": ("/v1/chat/completions", lambda s: {"model": s, "messages": CHAT}, "model"),
    "chat stop": ("/v1/chat/completions", lambda s: {"messages": CHAT, "stop": [s]}, "stop"),
    "chat user": ("/v1/chat/completions", lambda s: {"messages": CHAT, "user": s}, "user"),
    "response format": ("/v1/chat/completions", lambda s: {"messages": CHAT, "response_format": {"type": s}},
                        "response_format"),
    "a field's name": ("/v1/completions", lambda s: {"prompt": "x", s: 1}, ""),
    "a stream option's name": ("/v1/completions", lambda s: {"prompt": "x", "stream": True,
                                                              "stream_options": {s: True}}, "stream_options"),
}


def test_a_lone_surrogate_in_any_field_is_a_400_naming_the_field(cluster: Cluster) -> None:
    async def test(http: httpx.AsyncClient) -> None:
        for name, (path, body, param) in FIELDS.items():
            # json.dumps writes the lone surrogate as the escape "\ud800", as a hostile client would
            r = await http.post(path, content=json.dumps(body(f"a{SURROGATE}b")).encode())
            error = assert_error(r, 400, param or None)
            assert "surrogate" in error["message"], (name, error)
        # the model name in a 404 (another place that quotes the request) renders whatever it holds
        r = await http.get("/v1/models/%ED%A0%80")  # the surrogate's bytes in UTF-8 (CESU), not valid UTF-8
        assert_error(r, 404, "model")

    with_app(proxy_state(cluster), test)


def test_json_nested_thousands_deep_and_huge_numbers_are_400s(cluster: Cluster) -> None:
    bodies = {
        "nested prompt": b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "nested body": b"[" * 100_000 + b"]" * 100_000,
        "nested objects": b'{"a":' * 5000 + b"1" + b"}" * 5000,
        "an integer of 5000 digits": b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        "a float beyond double": b'{"prompt": "x", "temperature": 1e400}',
        "not UTF-8": b'{"prompt": "\xff\xfe"}',
        "truncated": b'{"prompt": "x", "max_tokens": ',
    }

    async def test(http: httpx.AsyncClient) -> None:
        for name, raw in bodies.items():
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = await http.post(path, content=raw)
                assert r.status_code == 400 and set(r.json()["error"]) == ENVELOPE, (name, path, r.text)

    with_app(proxy_state(cluster), test)


# valid Unicode that is odd for a tokenizer, a chat template or an error message
ODD_TEXT = ["\x00", "a\x00b", "<|im_start|>", "<|endoftext|>", "\u202eevil", "😀" * 30, "{{ 7 * 7 }}",
            "{% for x in y %}", "\ufeff", "\r\n\t", "\U0010ffff", "e\u0301", " " * 300]


def test_odd_but_valid_text_in_any_field_is_served_or_refused_never_a_5xx(cluster: Cluster) -> None:
    async def test(http: httpx.AsyncClient) -> None:
        statuses = set()
        for name, (path, body, _) in FIELDS.items():
            for text in ODD_TEXT:
                r = await http.post(path, json={"max_tokens": 2, **body(text)})
                statuses.add(r.status_code)
                assert r.status_code in (200, 400, 404), (name, text, r.text)
                if r.status_code != 200:
                    assert set(r.json()["error"]) == ENVELOPE
        assert 200 in statuses and 400 in statuses

    with_app(proxy_state(cluster), test)
    wait_until(lambda: all_resources_free(cluster))


def test_random_text_in_any_field_never_gets_a_5xx(cluster: Cluster) -> None:
    """Hypothesis draws any code point, lone surrogates included, into each field in turn."""
    hypothesis = pytest.importorskip("hypothesis")
    strategies = pytest.importorskip("hypothesis.strategies")
    names = list(FIELDS)
    state = proxy_state(cluster)
    app = create_app(state)
    loop = asyncio.new_event_loop()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60)

    # any code point, and lone surrogates often (they are 2,048 of 1,114,112)
    alphabet = strategies.one_of(strategies.characters(exclude_categories=()), strategies.characters(categories=["Cs"]))

    @hypothesis.settings(max_examples=150, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(strategies.sampled_from(names), strategies.text(alphabet, max_size=20))
    def check(name: str, text: str) -> None:
        path, body, param = FIELDS[name]
        r = loop.run_until_complete(http.post(path, content=json.dumps({"max_tokens": 2, **body(text)}).encode()))
        assert r.status_code in (200, 400, 404), (name, text, r.text)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            assert r.status_code == 400 and r.json()["error"]["param"] == (param or None), (name, text, r.text)

    try:
        check()
    finally:
        loop.run_until_complete(http.aclose())
        loop.run_until_complete(state.pipeline.close())
        loop.close()
        state.close()
    wait_until(lambda: all_resources_free(cluster))
