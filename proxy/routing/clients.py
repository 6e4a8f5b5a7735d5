"""gRPC clients of the prefill and decode nodes. Protobuf stays here: callers get our own types (wire, engine.types)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from engine.types import FinishReason, PositionLogprobs, PromptLogprobs, SamplingParams
from node_common.tls import PLAINTEXT, ChannelSecurity
from node_common.tracing import Metadata
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import (
    logprobs_from_proto,
    params_to_proto,
    prompt_logprobs_from_proto,
    stats_from_proto,
    ticket_from_proto,
    ticket_to_proto,
)
from wire import RETRYABLE_KEY, DecodeTimings, InvalidTicketError, KVTicket, NodeStats, PrefillTimings

# A node that restarts is reachable again within a second: gRPC's default reconnect backoff grows to 2 minutes,
# and a channel in backoff fails calls at once. A long prompt's prompt logprobs outgrow gRPC's default 4 MiB
# message (8k positions of 21 entries are about 3.5 MiB): answers up to the nodes' own send limit are taken.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_receive_message_length", 64 << 20)]


class NodeError(Exception):
    """A node refused or failed a request. `retryable`: prefilling again (maybe elsewhere) may succeed;
    `unreachable`: the node did not answer at all (connection refused or lost), so routing should leave it out.
    `node` ("prefill HOST:PORT") and the string form are for logs: clients get `message` (proxy.api.serving)."""

    def __init__(self, node: str, code: grpc.StatusCode, message: str, retryable: bool,
                 unreachable: bool = False) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.code = code
        self.message = message
        self.retryable = retryable
        self.unreachable = unreachable

    @property
    def role(self) -> str:
        return self.node.split(" ", 1)[0]

    @property
    def try_another_node(self) -> bool:
        """Whether another node of the role may do better: this one was unreachable, or the proxy gave up on it
        (proxy.routing.attempts). A node's own errors would repeat elsewhere."""
        return self.code == grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    first_logprobs: PositionLogprobs | None
    finish_reason: FinishReason | None
    num_cached_tokens: int
    ticket: KVTicket | None  # None when the first token finished the request
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs asked
    timings: PrefillTimings | None = None  # where the time went on P (None: a fresh ticket's, not the request's)


@dataclass(frozen=True)
class Decoded:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None
    stop_token_id: int | None
    num_cached_tokens: int | None = None  # a colocated request's prefix hit on D (first output only)
    prompt_logprobs: PromptLogprobs | None = None  # a colocated request's, when asked (first output only)
    timings: DecodeTimings | None = None  # a handed-off request's, on D's first output


@dataclass(frozen=True)
class NodeHealth:
    """A node's answer to Health."""

    ready: bool
    node_id: str
    layout_hash: str


def _error(node: str, e: grpc.aio.AioRpcError) -> NodeError:
    trailers = dict(e.trailing_metadata() or ())
    # the node's own errors carry our trailer; UNAVAILABLE without it comes from the transport (nobody answered)
    unreachable = e.code() == grpc.StatusCode.UNAVAILABLE and RETRYABLE_KEY not in trailers
    retryable = trailers.get(RETRYABLE_KEY) == "1" or e.code() == grpc.StatusCode.UNAVAILABLE
    return NodeError(node, e.code(), e.details() or str(e.code()), retryable, unreachable)


class NodeClient:
    """A node's address and, once first used (inside the event loop that will use it), its channel: plaintext, or
    TLS as `security` says (--node-tls-*)."""

    def __init__(self, address: str, security: ChannelSecurity = PLAINTEXT) -> None:
        self.address = address
        self.security = security
        self._channel: grpc.aio.Channel | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = self.security.channel(self.address, _CHANNEL_OPTIONS)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> tandem_pb2_grpc.PrefillServiceStub | tandem_pb2_grpc.DecodeServiceStub:
        raise NotImplementedError

    async def health(self, timeout: float = 2.0) -> NodeHealth:
        """Raises grpc.aio.AioRpcError when the node does not answer. The node answers from its gRPC edge, without
        its engine thread: a busy node answers at once."""
        health = await self.stub.Health(pb.HealthRequest(), timeout=timeout)
        return NodeHealth(health.ready, health.node_id, health.layout_hash)

    async def stats(self, timeout: float = 2.0) -> NodeStats:
        """Raises grpc.aio.AioRpcError when the node does not answer."""
        return stats_from_proto(await self.stub.Stats(pb.StatsRequest(), timeout=timeout))


class PrefillClient(NodeClient):
    @property
    def stub(self) -> tandem_pb2_grpc.PrefillServiceStub:
        return tandem_pb2_grpc.PrefillServiceStub(self.channel)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      deadline: float, metadata: Metadata = ()) -> Prefilled:
        """`metadata`: gRPC metadata sent along (the trace context of the caller's span)."""
        message = pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                    params=params_to_proto(params), deadline=deadline)
        try:
            r = await self.stub.Prefill(message, timeout=max(0.1, deadline - time.time()), metadata=metadata or None)
        except grpc.aio.AioRpcError as e:
            raise _error(f"prefill {self.address}", e) from e
        try:
            ticket = ticket_from_proto(r.ticket) if r.HasField("ticket") else None
        except InvalidTicketError as e:  # a bug on P: no other node would do better
            raise NodeError(f"prefill {self.address}", grpc.StatusCode.INTERNAL, f"malformed KV ticket: {e}",
                            retryable=False) from e
        return Prefilled(r.first_token, logprobs_from_proto(r.first_logprobs),
                         FinishReason(r.finish_reason) if r.finish_reason else None, r.num_cached_tokens, ticket,
                         prompt_logprobs_from_proto(r.prompt_logprobs) if r.HasField("prompt_logprobs") else None,
                         PrefillTimings(r.queue_seconds, r.prefill_seconds))

    async def release(self, ticket: KVTicket, timeout: float = 2.0) -> None:
        ref = pb.TicketRef(ticket_id=ticket.ticket_id, incarnation=ticket.incarnation)
        try:
            await self.stub.Release(ref, timeout=timeout)
        except grpc.aio.AioRpcError:
            pass  # the lease frees the blocks anyway

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        try:
            await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout)
        except grpc.aio.AioRpcError:
            pass


class DecodeClient(NodeClient):
    @property
    def stub(self) -> tandem_pb2_grpc.DecodeServiceStub:
        return tandem_pb2_grpc.DecodeServiceStub(self.channel)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prefilled: Prefilled | None, deadline: float, output_token_ids: Sequence[int] = (),
                       metadata: Metadata = ()) -> AsyncIterator[Decoded]:
        """Streams the request's tokens from D. Without `prefilled` (colocated), D prefills the prompt itself
        and the stream starts with the first token; its first output carries D's prefix hit. `output_token_ids`
        (colocated only): the tokens the request already generated elsewhere; the stream starts after them. A handed-off
        request's first output carries D's timings. `metadata`: gRPC metadata sent along (the trace context)."""
        message = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                     params=params_to_proto(params), deadline=deadline,
                                     output_token_ids=output_token_ids)
        if prefilled is not None:
            assert prefilled.ticket is not None, "a prefilled request reaches D only with its ticket"
            message.ticket.CopyFrom(ticket_to_proto(prefilled.ticket))
            message.first_token = prefilled.first_token
        call = self.stub.Generate(message, timeout=max(0.1, deadline - time.time()), metadata=metadata or None)
        first = True
        try:
            async for r in call:
                yield Decoded(list(r.token_ids), [p for p in map(logprobs_from_proto, r.logprobs) if p],
                              FinishReason(r.finish_reason) if r.finish_reason else None,
                              r.stop_token_id if r.stop_token_id >= 0 else None,
                              r.num_cached_tokens if first and prefilled is None else None,
                              prompt_logprobs_from_proto(r.prompt_logprobs) if r.HasField("prompt_logprobs") else None,
                              DecodeTimings(r.handoff_seconds, r.first_step_seconds)
                              if first and prefilled is not None else None)
                first = False
        except grpc.aio.AioRpcError as e:
            raise _error(f"decode {self.address}", e) from e
        finally:
            call.cancel()

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        try:
            await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout)
        except grpc.aio.AioRpcError:
            pass
