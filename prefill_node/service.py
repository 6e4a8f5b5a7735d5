"""The prefill node's gRPC edge: protobuf in, PrefillLoop calls, protobuf out."""

from __future__ import annotations

import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from kvtransfer.ticket import KVTicket
from prefill_node.loop import PrefillError, PrefillLoop
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import engine_stats, logprobs_to_proto, params_from_proto

logger = logging.getLogger(__name__)


def ticket_to_proto(ticket: KVTicket, prefill_address: str) -> pb.KVTicket:
    return pb.KVTicket(
        ticket_id=ticket.ticket_id, prefill_node_id=ticket.prefill_node_id, incarnation=ticket.incarnation,
        transfer_metadata=ticket.transfer_endpoint, block_ids=list(ticket.block_ids), num_tokens=ticket.num_tokens,
        layout_hash=ticket.layout_hash, lease_deadline=ticket.lease_deadline, checksum=ticket.checksum,
        block_checksums=list(ticket.block_checksums), prefill_address=prefill_address)


class PrefillService(tandem_pb2_grpc.PrefillServiceServicer):
    def __init__(self, loop: PrefillLoop, engine: AsyncEngine, address: str, layout_hash: str, model: str,
                 kv_backend: str) -> None:
        self.loop = loop
        self.engine = engine
        self.address = address
        self.layout_hash = layout_hash
        self.model = model
        self.kv_backend = kv_backend

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = params_from_proto(request.params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        deadline = request.deadline or None
        if deadline is not None and deadline <= time.time():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline has already passed")
        try:
            result = await self.loop.prefill(request.request_id, list(request.prompt_token_ids), params, deadline)
        except PrefillError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        response = pb.PrefillResponse(first_token=result.first.token_id, num_cached_tokens=result.num_cached_tokens,
                                      finish_reason=str(result.first.finish_reason or ""))
        first_logprobs = logprobs_to_proto(result.first.logprobs)
        if first_logprobs is not None:
            response.first_logprobs.CopyFrom(first_logprobs)
        if result.ticket is not None:
            response.ticket.CopyFrom(ticket_to_proto(result.ticket, self.address))
        return response

    async def Release(self, request: pb.TicketRef, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        return pb.LeaseResponse(ok=await self.loop.release(request.ticket_id, request.incarnation))

    async def ExtendLease(self, request: pb.ExtendLeaseRequest, context: grpc.aio.ServicerContext
                          ) -> pb.LeaseResponse:
        deadline = await self.loop.extend(request.ticket.ticket_id, request.ticket.incarnation, request.seconds)
        return pb.LeaseResponse(ok=deadline is not None, lease_deadline=deadline or 0.0)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.loop.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ready=self.engine.healthy, node_id=self.loop.node_id,
                                 incarnation=self.loop.incarnation, role="prefill", layout_hash=self.layout_hash,
                                 model=self.model, kv_backend=self.kv_backend)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        def stats(engine: LLMEngine) -> pb.StatsResponse:
            response = engine_stats(engine)
            response.num_pinned_tickets = self.loop.num_pinned
            response.num_leases_expired = self.loop.num_leases_expired
            return response

        return await self.engine.call(stats)
