"""No client ever learns a node's address (issue 13, item 5): every error body and every SSE error event, whether
the node failed the request with a message naming addresses, was killed mid-stream, froze, or was never there, is
free of host:port patterns; so are /health and /v1/models. The proxy's real app, pipeline and gRPC clients, in
front of a real in-process gRPC decode node whose behaviour each test scripts."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from proxy.api.app import create_app
from proxy.api.serving import ProxyState
from proxy.routing.attempts import AttemptLimits
from proxy.routing.directory import NodeDirectory
from proxy.routing.pd import PDPipeline
from proxy.routing.router import Router, RouterConfig, RoutingPolicy

# what an address looks like: a dotted or single-label host with a port, an IPv4 address, a bracketed IPv6 one
ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b|\[[0-9a-fA-F:]+\]|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*:\d{2,5}\b")
PEERS = "peer 10.0.0.8:15002, decode-1.tandem.svc.cluster.local:50052 and tandem-prefill-0:50051"


class ScriptedDecode(tandem_pb2_grpc.DecodeServiceServicer):
    """A decode node that streams `num_tokens` tokens, then does what `then` says: "finish", "fail" (an error
    naming its own and its peers' addresses), "die" (the server is stopped under the stream), "freeze"."""

    def __init__(self, then: str, num_tokens: int = 2) -> None:
        self.then = then
        self.num_tokens = num_tokens
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.frozen = False  # a frozen node answers nothing more, health checks included
        self.stopping: asyncio.Future[None] | None = None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        for i in range(self.num_tokens):
            yield pb.GenerateResponse(token_ids=[65 + i], stop_token_id=-1)
        if self.then == "fail":
            await context.abort(grpc.StatusCode.INTERNAL, f"KV transfer failed on {self.address}: {PEERS}")
        elif self.then == "die":
            assert self.server is not None
            self.stopping = asyncio.ensure_future(self.server.stop(0))  # cancels this stream too
            await asyncio.sleep(30)
        elif self.then == "freeze":
            self.frozen = True
            await asyncio.sleep(30)
        yield pb.GenerateResponse(token_ids=[], finish_reason="length", stop_token_id=-1)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        if self.frozen:
            await asyncio.sleep(30)
        return pb.HealthResponse(ready=True, node_id=f"decode-{self.address}", role="decode", layout_hash="layout")

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse()


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def through_proxy(tokenizer_dir: Path, node: ScriptedDecode | None,
                  requests: Callable[[httpx.AsyncClient], Awaitable[list[str]]]) -> tuple[str, list[str]]:
    """The decode node's address and the texts the client got, with `node` serving (None: nothing listens)."""
    from transformers import AutoTokenizer

    async def run() -> tuple[str, list[str]]:
        server = None
        address = unused_address()
        if node is not None:
            server = grpc.aio.server()
            tandem_pb2_grpc.add_DecodeServiceServicer_to_server(node, server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            node.address, node.server = address, server
            await server.start()
        directory = NodeDirectory([], [address], health_interval_s=0.1, health_timeout_s=0.3)
        pipeline = PDPipeline(directory, Router(directory, RouterConfig(policy=RoutingPolicy.ROUND_ROBIN)),
                              max_retries=1, limits=AttemptLimits(first_token_timeout_s=1.0))
        state = ProxyState(pipeline, AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m", request_timeout_s=8)
        try:
            await directory.check_health()
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=20) as http:
                return address, await requests(http)
        finally:
            await pipeline.close()
            state.close()
            if server is not None:
                await server.stop(0)

    return asyncio.run(run())


REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8}),
    "streamed completion": ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True}),
    "streamed chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                               "stream": True}),
}


def one_request(kind: str) -> Callable[[httpx.AsyncClient], Awaitable[list[str]]]:
    """The request of `kind` (first: the node fails it), then /health and /v1/models."""
    async def send(http: httpx.AsyncClient) -> list[str]:
        path, body = REQUESTS[kind]
        answer = await http.post(path, json=body)
        return [answer.text, (await http.get("/health")).text, (await http.get("/v1/models")).text]

    return send


def check_no_address(address: str, texts: list[str]) -> list[dict[str, Any]]:
    """The error objects the client got (bodies and SSE events), after checking none names an address."""
    port = address.rsplit(":", 1)[1]
    for text in texts:  # the port alone, too (":port": its digits may be in a request id or a timestamp)
        assert f":{port}" not in text and not ADDRESS.search(text), text
    errors = []
    for text in texts:
        for line in text.splitlines() or [text]:
            payload = line.removeprefix("data: ")
            if payload.startswith("{") and '"error"' in payload:
                errors.append(json.loads(payload)["error"])
    return errors


@pytest.mark.parametrize("kind", sorted(REQUESTS))
@pytest.mark.parametrize("then", ["fail", "die", "freeze"])
def test_a_node_that_fails_dies_or_freezes_mid_stream_is_never_named_to_the_client(tokenizer_dir: Path, then: str,
                                                                                    kind: str) -> None:
    address, texts = through_proxy(tokenizer_dir, ScriptedDecode(then), one_request(kind))
    (error,) = check_no_address(address, texts)  # the whole request's error body, or the stream's error event
    if kind != "completion":
        assert texts[0].startswith("data: ") and texts[0].rstrip().endswith("data: [DONE]")  # after 2 tokens
    if then == "fail":  # the node's own words reach the client, scrubbed
        assert error["message"].startswith("the decode node failed the request: KV transfer failed on <node>")
    else:
        assert error["code"] in ("unavailable", "deadline_exceeded"), error


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_node_that_is_not_there_is_never_named_to_the_client(tokenizer_dir: Path, kind: str) -> None:
    address, texts = through_proxy(tokenizer_dir, None, one_request(kind))
    (error,) = check_no_address(address, texts)
    assert error["code"] in ("no_healthy_nodes", "unavailable"), error


def test_a_node_that_fails_before_its_first_token_gets_an_http_error_without_its_address(tokenizer_dir: Path
                                                                                         ) -> None:
    address, texts = through_proxy(tokenizer_dir, ScriptedDecode("fail", num_tokens=0),
                                   one_request("streamed chat"))
    (error,) = check_no_address(address, texts)
    assert error["code"] == "internal" and not texts[0].startswith("data: "), texts
