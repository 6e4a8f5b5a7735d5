"""The decode node's gRPC edge: protobuf in, DecodeLoop calls, protobuf out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import grpc

from decode_node.loop import DecodeError, DecodeLoop, DecodeOutput
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from node_common.limits import DEFAULT_MAX_LOGPROBS, check_limits, check_position_logprobs
from node_common.load import engine_stats
from node_common.tracing import NO_SPAN, NO_TRACER, Span, SpanKind, Tracer, now_ns, seconds_to_ns
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import (
    deadline_from_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    stats_to_proto,
    ticket_from_proto,
)
from wire import RETRYABLE_KEY, InvalidTicketError, NodeStats


class DecodeService(tandem_pb2_grpc.DecodeServiceServicer):
    def __init__(self, loop: DecodeLoop, engine: AsyncEngine, node_id: str, model: str, kv_backend: str,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, tracer: Tracer = NO_TRACER) -> None:
        self.loop = loop
        self.tracer = tracer
        self.engine = engine
        self.node_id = node_id
        self.model = model
        self.kv_backend = kv_backend
        self.max_logprobs = max_logprobs

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        colocated = not request.HasField("ticket")  # no ticket: prefill here
        if not colocated and request.output_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "output_token_ids continue a colocated request "
                                                                  "only: a request with a ticket starts after its "
                                                                  "first token")
        try:
            params = params_from_proto(request.params)
            check_limits(params, self.max_logprobs)
            check_position_logprobs(len(request.first_logprobs.entries), self.max_logprobs)
            deadline = deadline_from_proto(request.deadline)
            ticket = None if colocated else ticket_from_proto(request.ticket)
        except (ValueError, InvalidTicketError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if deadline is not None and deadline <= time.time():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline has already passed")
        prompt = list(request.prompt_token_ids)
        started_ns = now_ns()
        span = self._span(request, context, colocated, started_ns)
        if ticket is None:
            outputs = self.loop.generate_local(request.request_id, prompt, params, deadline,
                                               list(request.output_token_ids))
        else:
            outputs = self.loop.generate(request.request_id, prompt, params, ticket, request.first_token,
                                         logprobs_from_proto(request.first_logprobs), deadline)
        try:
            async for out in outputs:
                response = pb.GenerateResponse(token_ids=out.token_ids,
                                               finish_reason=str(out.finish_reason or ""),
                                               stop_token_id=-1 if out.stop_token_id is None else out.stop_token_id,
                                               num_cached_tokens=out.num_cached_tokens or 0)
                if out.timings is not None:
                    response.handoff_seconds = out.timings.handoff_seconds
                    response.first_step_seconds = out.timings.first_step_seconds
                    _record_phases(span, started_ns, out)
                for position in out.logprobs:
                    response.logprobs.append(logprobs_to_proto(position))
                if out.prompt_logprobs is not None:
                    response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
                if out.finish_reason is not None:  # the span ends with the last token sent, as the caller's
                    span.end()
                    span = NO_SPAN
                yield response
        except DecodeError as e:
            span.set_error(str(e))
            context.set_trailing_metadata(((RETRYABLE_KEY, "1" if e.retryable else "0"),))
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        finally:
            span.end()
            await outputs.aclose()

    def _span(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, colocated: bool,
              started_ns: int) -> Span:
        if not self.tracer.enabled:  # no metadata read, no attributes built
            return NO_SPAN
        return self.tracer.start(
            "decode_node.Generate", SpanKind.SERVER, parent=tuple(context.invocation_metadata() or ()),
            attributes={"tandem.request_id": request.request_id, "tandem.node_id": self.node_id,
                        "tandem.colocated": colocated, "tandem.num_prompt_tokens": len(request.prompt_token_ids)},
            start_ns=started_ns)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.loop.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ready=self.engine.healthy, node_id=self.node_id, role="decode",
                                 layout_hash=self.loop.layout_hash, model=self.model, kv_backend=self.kv_backend)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        def stats(engine: LLMEngine) -> NodeStats:
            return dataclasses.replace(engine_stats(engine, self.loop.store),
                                       num_transfer_failures=self.loop.num_transfer_failures,
                                       kv_transfer_bytes=self.loop.num_transferred_bytes,
                                       kv_transfer_count=self.loop.num_transfers,
                                       kv_transfer_seconds_sum=self.loop.transfer_seconds)

        return stats_to_proto(await self.engine.call(stats))


def _record_phases(span: Span, started_ns: int, out: DecodeOutput) -> None:
    """A handed-off request's phases here, from the RPC's start, as children of its span."""
    if not span.recording or out.timings is None:
        return
    admitted_ns = started_ns + seconds_to_ns(out.timings.handoff_seconds)
    span.record_child("decode_node.kv_handoff", started_ns, admitted_ns)
    first_token_ns = admitted_ns + seconds_to_ns(out.timings.first_step_seconds)
    span.record_child("decode_node.first_step", admitted_ns, first_token_ns)
