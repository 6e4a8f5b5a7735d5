"""Where a request's time goes: the phases the nodes report, and the request's trace at the proxy.

Each node measures its own part of a disaggregated request (wire.timings) and sends it back with its first token:
P its queue and prefill, D the handoff (its KV pull and the admission) and its first decode step. The pipeline
hands them to a `PhaseSink` (the proxy's histograms, proxy/api/metrics.py), traced or not.

With a tracer (--otlp-traces-endpoint), each request is one trace (docs/architecture.md#tracing):

    proxy.request                         the pipeline's whole stream of one choice
      proxy.prefill  (client)             one per Prefill attempt
        prefill_node.Prefill  (server)      prefill_node.queue, prefill_node.prefill
      proxy.decode  (client)              one per Generate attempt
        decode_node.Generate  (server)      decode_node.kv_handoff, decode_node.first_step

The node spans are children of the proxy's attempt spans through W3C `traceparent` gRPC metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Protocol

from node_common.tracing import NO_SPAN, NO_TRACER, Span, SpanKind, Tracer
from proxy.routing.clients import Decoded, NodeError, Prefilled
from proxy.routing.directory import NodeView
from wire import DecodeTimings, PrefillTimings, Role


class PhaseSink(Protocol):
    """Takes the phases nodes report (proxy.api.metrics.PhaseHistograms)."""

    def observe_prefill(self, timings: PrefillTimings) -> None: ...

    def observe_decode(self, timings: DecodeTimings) -> None: ...


class _NoSink:
    def observe_prefill(self, timings: PrefillTimings) -> None:
        pass

    def observe_decode(self, timings: DecodeTimings) -> None:
        pass


class Phases:
    """The pipeline's timing bookkeeping: each request's root span (by request id, while its stream runs), the
    attempt spans under it, and the reported phases passed on to `sink`."""

    def __init__(self, tracer: Tracer = NO_TRACER) -> None:
        self.tracer = tracer
        self.sink: PhaseSink = _NoSink()
        self._roots: dict[str, Span] = {}

    @contextlib.contextmanager
    def request(self, request_id: str, num_prompt_tokens: int) -> Iterator[Span]:
        """The request's root span, from now to the end of its stream."""
        if not self.tracer.enabled:
            yield NO_SPAN
            return
        root = self.tracer.start("proxy.request", SpanKind.INTERNAL,
                                 attributes={"tandem.request_id": request_id,
                                             "tandem.num_prompt_tokens": num_prompt_tokens})
        self._roots[request_id] = root
        try:
            yield root
        except Exception as e:  # (a client gone or a stop string closes the stream: no error)
            root.set_error(_describe(e))
            raise
        finally:
            del self._roots[request_id]
            root.end()

    def attempt(self, request_id: str, role: Role, node: NodeView, attempt_id: str) -> Span:
        """The span of an RPC to `node` (its trace context goes along as `span.metadata()`); `prefilled` or
        `decoded` ends it."""
        return self._roots.get(request_id, NO_SPAN).child(
            f"proxy.{role.value}", SpanKind.CLIENT, {"tandem.node_id": node.node_id,
                                                     "tandem.node_address": node.address,
                                                     "tandem.attempt_id": attempt_id})

    async def prefilled(self, span: Span, call: Awaitable[Prefilled]) -> Prefilled:
        """The answer of `call` (a Prefill) in its attempt's span; P's timings go to the sink."""
        try:
            prefilled = await call
        except Exception as e:
            span.set_error(_describe(e))
            raise
        finally:
            span.end()
        if prefilled.timings is not None:
            self.sink.observe_prefill(prefilled.timings)
        return prefilled

    async def decoded(self, span: Span, stream: AsyncIterator[Decoded]) -> AsyncIterator[Decoded]:
        """The outputs of `stream` (a Generate), in its attempt's span until the stream ends; D's timings (a
        handed-off request's first output) go to the sink."""
        ended = False
        try:
            async for out in stream:
                if out.timings is not None:
                    self.sink.observe_decode(out.timings)
                if out.finish_reason is not None:  # its consumer may never resume it (a generator left unclosed)
                    ended = True
                    span.end()
                yield out
        except Exception as e:
            span.set_error(_describe(e))
            raise
        finally:
            if not ended:
                span.end()
            aclose = getattr(stream, "aclose", None)  # cancels the RPC
            if aclose is not None:
                await aclose()


def _describe(error: Exception) -> str:
    return error.message if isinstance(error, NodeError) else str(error) or type(error).__name__
