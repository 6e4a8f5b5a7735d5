"""TLS and mutual TLS between the proxy and the nodes, and from a decode node to prefill nodes (issue 13, item 5):
real handshakes over loopback with certificates made at test time. The servers are in-process gRPC servers bound
by the nodes' own code (node_common.server.add_port with node_common.tls credentials) and serving scripted
services; the callers are the proxy's DecodeClient and the decode node's PrefillLeaseClient."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from decode_node.clients import PrefillLeaseClient
from engine.types import SamplingParams
from node_common.server import add_port
from node_common.tls import PLAINTEXT, ChannelSecurity, TLSFileError, server_credentials
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from proxy.routing.clients import DecodeClient, NodeError
from settings import ConfigError
from settings.tls import ClientTLSSettings, ServerTLSSettings
from tests.fixtures.certificates import Certificates, Pair, make_certificates
from wire import KVTicket

T = TypeVar("T")
TOKENS = [11, 12, 13]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


class ScriptedDecode(tandem_pb2_grpc.DecodeServiceServicer):
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        for i, token in enumerate(TOKENS):
            yield pb.GenerateResponse(token_ids=[token], stop_token_id=-1,
                                      finish_reason="length" if i == len(TOKENS) - 1 else "")


class ScriptedPrefill(tandem_pb2_grpc.PrefillServiceServicer):
    async def Release(self, request: pb.TicketRef, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        return pb.LeaseResponse(ok=request.ticket_id == "t-1")


def serving(node: Pair, client_ca: Path | None, call: Callable[[str], Awaitable[T]]) -> T:
    """`call(address)`'s result, with a decode and a prefill service on a TLS port of a fresh server."""
    async def run() -> T:
        server = grpc.aio.server()
        tandem_pb2_grpc.add_DecodeServiceServicer_to_server(ScriptedDecode(), server)
        tandem_pb2_grpc.add_PrefillServiceServicer_to_server(ScriptedPrefill(), server)
        settings = ServerTLSSettings(str(node.cert), str(node.key), str(client_ca) if client_ca else None)
        port = add_port(server, "127.0.0.1:0", server_credentials(settings))
        assert port
        await server.start()
        try:
            return await call(f"127.0.0.1:{port}")
        finally:
            await server.stop(0)

    return asyncio.run(run())


def security(ca: Path, client: Pair | None = None, server_name: str | None = None) -> ChannelSecurity:
    return ChannelSecurity.from_settings(ClientTLSSettings(
        str(ca), str(client.cert) if client else None, str(client.key) if client else None, server_name))


def decode_tokens(security: ChannelSecurity) -> Callable[[str], Awaitable[list[int]]]:
    async def call(address: str) -> list[int]:
        client = DecodeClient(address, security)
        try:
            outputs = client.generate("r-1", [1, 2, 3], SamplingParams(max_tokens=3), None, time.time() + 10)
            return [token for out in [o async for o in outputs] for token in out.token_ids]
        finally:
            await client.close()

    return call


def refused(security: ChannelSecurity) -> Callable[[str], Awaitable[grpc.StatusCode]]:
    async def call(address: str) -> grpc.StatusCode:
        client = DecodeClient(address, security)
        try:
            await client.health(timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
        finally:
            await client.close()
        raise AssertionError("the handshake was expected to fail")

    return call


def test_under_mutual_tls_the_proxy_streams_tokens_and_a_decode_node_releases_on_a_prefill_node(
        certs: Certificates) -> None:
    assert serving(certs.server, certs.ca, decode_tokens(security(certs.ca, certs.client))) == TOKENS

    async def release(address: str) -> bool:
        ticket = KVTicket("t-1", "prefill-0", address, 1, b"x", (0,), 4, "layout", time.time() + 10, ("crc32:0",))
        return await PrefillLeaseClient(security(certs.ca, certs.client)).release(ticket)

    assert serving(certs.server, certs.ca, release)


def test_tls_without_client_certificates_serves_a_client_that_trusts_the_ca(certs: Certificates) -> None:
    assert serving(certs.server, None, decode_tokens(security(certs.ca))) == TOKENS


@pytest.mark.parametrize("who", ["no client certificate", "a certificate of another CA", "plaintext"])
def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(certs: Certificates, who: str) -> None:
    client = {"no client certificate": security(certs.ca), "a certificate of another CA":
              security(certs.ca, certs.stranger), "plaintext": PLAINTEXT}[who]
    assert serving(certs.server, certs.ca, refused(client)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_trusts_another_ca_refuses_the_node(certs: Certificates) -> None:
    assert serving(certs.server, None, refused(security(certs.other_ca))) == grpc.StatusCode.UNAVAILABLE


def test_the_node_certificate_must_name_the_address_unless_a_server_name_is_given(certs: Certificates) -> None:
    """named_server holds DNS:tandem-node only: 127.0.0.1 is not in it."""
    assert serving(certs.named_server, None, refused(security(certs.ca))) == grpc.StatusCode.UNAVAILABLE
    assert serving(certs.named_server, None, decode_tokens(security(certs.ca, server_name="tandem-node"))) == TOKENS


def test_a_refused_handshake_reaches_the_proxy_as_an_unreachable_node(certs: Certificates) -> None:
    async def call(address: str) -> NodeError:
        client = DecodeClient(address, PLAINTEXT)
        try:
            async for _ in client.generate("r-1", [1], SamplingParams(max_tokens=1), None, time.time() + 10):
                pass
        except NodeError as e:
            return e
        finally:
            await client.close()
        raise AssertionError("expected a NodeError")

    error = serving(certs.server, certs.ca, call)
    assert error.unreachable and error.try_another_node


@pytest.mark.parametrize("settings, message", [
    ({"tls_cert": "a.pem"}, "go together"),
    ({"tls_client_ca": "ca.pem"}, "needs the node's own"),
])
def test_incomplete_server_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerTLSSettings(**settings)


@pytest.mark.parametrize("settings, message", [
    ({"node_tls_ca": "ca.pem", "node_tls_cert": "c.pem"}, "go together"),
    ({"node_tls_cert": "c.pem", "node_tls_key": "k.pem"}, "need --node-tls-ca"),
    ({"node_tls_server_name": "tandem-node"}, "need --node-tls-ca"),
])
def test_incomplete_client_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ClientTLSSettings(**settings)


def test_a_missing_or_non_pem_file_is_named(tmp_path: Path, certs: Certificates) -> None:
    with pytest.raises(TLSFileError, match="nodes' CA"):
        security(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TLSFileError, match="not PEM"):
        server_credentials(ServerTLSSettings(str(certs.server.cert), str(garbage)))
