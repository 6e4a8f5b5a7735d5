"""The prefill node's gRPC edge: protobuf in, PrefillLoop calls, protobuf out."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from node_common.limits import DEFAULT_MAX_LOGPROBS, check_limits
from node_common.load import engine_stats
from node_common.tracing import NO_SPAN, NO_TRACER, Span, SpanKind, Tracer, now_ns, seconds_to_ns
from prefill_node.loop import PrefillError, PrefillLoop, PrefillResult
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import (
    deadline_from_proto,
    logprobs_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    stats_to_proto,
    ticket_to_proto,
)
from wire import NodeStats

logger = logging.getLogger(__name__)


class PrefillService(tandem_pb2_grpc.PrefillServiceServicer):
    def __init__(self, loop: PrefillLoop, engine: AsyncEngine, layout_hash: str, model: str, kv_backend: str,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, tracer: Tracer = NO_TRACER) -> None:
        self.loop = loop
        self.tracer = tracer
        self.engine = engine
        self.layout_hash = layout_hash
        self.model = model
        self.kv_backend = kv_backend
        self.max_logprobs = max_logprobs

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = params_from_proto(request.params)
            check_limits(params, self.max_logprobs)
            deadline = deadline_from_proto(request.deadline)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if deadline is not None and deadline <= time.time():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline has already passed")
        started_ns = now_ns()
        span = self._span(request, context, started_ns)
        try:
            result = await self.loop.prefill(request.request_id, list(request.prompt_token_ids), params, deadline)
        except PrefillError as e:
            span.set_error(str(e))
            span.end()
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except BaseException:
            span.set_error("cancelled")
            span.end()
            raise
        _record_phases(span, started_ns, result)
        timings = result.timings
        response = pb.PrefillResponse(first_token=result.first.token_id, num_cached_tokens=result.num_cached_tokens,
                                      finish_reason=str(result.first.finish_reason or ""),
                                      queue_seconds=timings.queue_seconds, prefill_seconds=timings.prefill_seconds)
        first_logprobs = logprobs_to_proto(result.first.logprobs)
        if first_logprobs is not None:
            response.first_logprobs.CopyFrom(first_logprobs)
        if result.first.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(result.first.prompt_logprobs))
        if result.ticket is not None:
            response.ticket.CopyFrom(ticket_to_proto(result.ticket))
        return response

    def _span(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, started_ns: int) -> Span:
        if not self.tracer.enabled:  # no metadata read, no attributes built
            return NO_SPAN
        return self.tracer.start(
            "prefill_node.Prefill", SpanKind.SERVER, parent=tuple(context.invocation_metadata() or ()),
            attributes={"tandem.request_id": request.request_id, "tandem.node_id": self.loop.node_id,
                        "tandem.num_prompt_tokens": len(request.prompt_token_ids)}, start_ns=started_ns)

    async def Release(self, request: pb.TicketRef, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        return pb.LeaseResponse(ok=await self.loop.release(request.ticket_id, request.incarnation))

    async def ExtendLease(self, request: pb.ExtendLeaseRequest, context: grpc.aio.ServicerContext
                          ) -> pb.LeaseResponse:
        deadline = self.loop.extend(request.ticket.ticket_id, request.ticket.incarnation, request.seconds)
        return pb.LeaseResponse(ok=deadline is not None, lease_deadline=deadline or 0.0)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.loop.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ready=self.engine.healthy, node_id=self.loop.node_id,
                                 incarnation=self.loop.incarnation, role="prefill", layout_hash=self.layout_hash,
                                 model=self.model, kv_backend=self.kv_backend)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        def stats(engine: LLMEngine) -> NodeStats:
            return dataclasses.replace(engine_stats(engine, self.loop.store), num_pinned_tickets=self.loop.num_pinned,
                                       num_leases_expired=self.loop.num_leases_expired)

        return stats_to_proto(await self.engine.call(stats))


def _record_phases(span: Span, started_ns: int, result: PrefillResult) -> None:
    """The request's phases on this node as children of its span (from its start: the loop's arrival is a few
    checks later), which ends now, once the first token and the ticket are ready."""
    if not span.recording:
        return
    prefill_start = started_ns + seconds_to_ns(result.timings.queue_seconds)
    span.record_child("prefill_node.queue", started_ns, prefill_start)
    first_token_ns = prefill_start + seconds_to_ns(result.timings.prefill_seconds)
    span.record_child("prefill_node.prefill", prefill_start, first_token_ns,
                      {"tandem.num_cached_tokens": result.num_cached_tokens})
    span.set_attributes({"tandem.num_cached_tokens": result.num_cached_tokens,
                         "tandem.ticket_issued": result.ticket is not None})
    span.end()
