"""gRPC clients of the prefill and decode nodes. Protobuf stays here: callers get our own types."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.types import FinishReason, PositionLogprobs, SamplingParams
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import logprobs_from_proto, params_to_proto

RETRYABLE_KEY = "tandem-retryable"


class NodeError(Exception):
    """A node refused or failed a request. `retryable`: prefilling again (maybe elsewhere) may succeed."""

    def __init__(self, node: str, code: grpc.StatusCode, message: str, retryable: bool) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    first_logprobs: PositionLogprobs | None
    finish_reason: FinishReason | None
    num_cached_tokens: int
    ticket: pb.KVTicket | None  # opaque to the proxy: handed from P to D as it came


@dataclass(frozen=True)
class Decoded:
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason | None
    stop_token_id: int | None


def _error(node: str, e: grpc.aio.AioRpcError) -> NodeError:
    trailers = dict(e.trailing_metadata() or ())
    retryable = trailers.get(RETRYABLE_KEY) == "1" or e.code() == grpc.StatusCode.UNAVAILABLE
    return NodeError(node, e.code(), e.details() or str(e.code()), retryable)


class NodeClient:
    """A node's address and, once first used (inside the event loop that will use it), its channel."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def health(self, timeout: float = 2.0) -> pb.HealthResponse:
        raise NotImplementedError


class PrefillClient(NodeClient):
    @property
    def stub(self) -> tandem_pb2_grpc.PrefillServiceStub:
        return tandem_pb2_grpc.PrefillServiceStub(self.channel)

    async def health(self, timeout: float = 2.0) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      deadline: float) -> Prefilled:
        message = pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                    params=params_to_proto(params), deadline=deadline)
        try:
            r = await self.stub.Prefill(message, timeout=max(0.1, deadline - time.time()))
        except grpc.aio.AioRpcError as e:
            raise _error(f"prefill {self.address}", e) from e
        return Prefilled(r.first_token, logprobs_from_proto(r.first_logprobs),
                         FinishReason(r.finish_reason) if r.finish_reason else None, r.num_cached_tokens,
                         r.ticket if r.HasField("ticket") else None)

    async def release(self, ticket: pb.KVTicket) -> None:
        ref = pb.TicketRef(ticket_id=ticket.ticket_id, incarnation=ticket.incarnation)
        try:
            await self.stub.Release(ref, timeout=2.0)
        except grpc.aio.AioRpcError:
            pass  # the lease frees the blocks anyway

    async def abort(self, request_id: str) -> None:
        try:
            await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass


class DecodeClient(NodeClient):
    @property
    def stub(self) -> tandem_pb2_grpc.DecodeServiceStub:
        return tandem_pb2_grpc.DecodeServiceStub(self.channel)

    async def health(self, timeout: float = 2.0) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prefilled: Prefilled, deadline: float) -> AsyncIterator[Decoded]:
        message = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                     params=params_to_proto(params), ticket=prefilled.ticket,
                                     first_token=prefilled.first_token, deadline=deadline)
        call = self.stub.Generate(message, timeout=max(0.1, deadline - time.time()))
        try:
            async for r in call:
                yield Decoded(list(r.token_ids), [p for p in map(logprobs_from_proto, r.logprobs) if p],
                              FinishReason(r.finish_reason) if r.finish_reason else None,
                              r.stop_token_id if r.stop_token_id >= 0 else None)
        except grpc.aio.AioRpcError as e:
            raise _error(f"decode {self.address}", e) from e
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> None:
        try:
            await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass
