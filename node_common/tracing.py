"""OpenTelemetry traces of a request across proxy -> prefill node -> decode node (docs/architecture.md#tracing).

Off by default. With `--otlp-traces-endpoint URL` a process sends its spans to that OTLP/HTTP collector. The SDK's
tracing, its exporter and the propagator are imported here, and only then: a process without the flag loads none of
them and makes no span. A span's parent crosses a gRPC call as W3C `traceparent` metadata: `Span.metadata()` on the
caller's side, `Tracer.start(..., parent=metadata)` on the node's.

Spans are made through this module's `Tracer` and `Span` only, never OpenTelemetry's "current span": a
request's work runs in async generators, across which a context variable does not follow it. Phases measured as
durations (wire.timings) become child spans with explicit start and end times (`Span.record_child`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Span as OTelSpan
    from opentelemetry.trace import Tracer as SDKTracer

logger = logging.getLogger(__name__)

TRACER_NAME = "tandem"
Metadata = Sequence[tuple[str, str]]  # gRPC metadata: (key, value) pairs
Attributes = Mapping[str, str | int | float | bool]


class SpanKind(Enum):
    SERVER = "SERVER"  # a node serving an RPC
    CLIENT = "CLIENT"  # the proxy calling a node
    INTERNAL = "INTERNAL"  # a request's own work, or a phase of it


class Span:
    """A span, or the no-op span of a process that does not trace (every method does nothing then)."""

    recording = False

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None) -> Span:
        """A child span started now; the caller ends it."""
        return self

    def record_child(self, name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
        """A child span that already happened, from `start_ns` to `end_ns` (unix nanoseconds)."""

    def set_attributes(self, attributes: Attributes) -> None:
        pass

    def set_error(self, description: str) -> None:
        pass

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The W3C trace context that makes this span the parent of the callee's (gRPC metadata)."""
        return ()

    def end(self, end_ns: int | None = None) -> None:
        pass


NO_SPAN = Span()


class Tracer:
    """What a process traces with; this base class is the one of a process that does not (`NO_TRACER`)."""

    enabled = False

    def start(self, name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Metadata = (),
              attributes: Attributes | None = None, start_ns: int | None = None) -> Span:
        """A span started at `start_ns` (default: now), the child of the span whose trace context `parent`
        (incoming gRPC metadata) carries, else a trace's root."""
        return NO_SPAN

    def shutdown(self) -> None:
        """Sends the spans still buffered (a process that exits calls it)."""


NO_TRACER = Tracer()


class _OTelSpan(Span):
    recording = True

    def __init__(self, tracer: SDKTracer, span: OTelSpan) -> None:
        self._tracer = tracer
        self._span = span

    def _start_child(self, name: str, kind: SpanKind, attributes: Attributes | None, start_ns: int | None
                     ) -> OTelSpan:
        from opentelemetry import trace

        return self._tracer.start_span(name, context=trace.set_span_in_context(self._span),
                                       kind=trace.SpanKind[kind.value], attributes=attributes, start_time=start_ns)

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None) -> Span:
        return _OTelSpan(self._tracer, self._start_child(name, kind, attributes, None))

    def record_child(self, name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
        self._start_child(name, SpanKind.INTERNAL, attributes, start_ns).end(end_time=max(start_ns, end_ns))

    def set_attributes(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def set_error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(self._span))
        return tuple(sorted(carrier.items()))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_time=end_ns)


class OTelTracer(Tracer):
    """Spans through an OpenTelemetry SDK tracer provider of this process's own (never the global one)."""

    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME)

    def start(self, name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Metadata = (),
              attributes: Attributes | None = None, start_ns: int | None = None) -> Span:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {key.lower(): value for key, value in parent}
        context = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        span = self._tracer.start_span(name, context=context, kind=trace.SpanKind[kind.value], attributes=attributes,
                                       start_time=start_ns)
        return _OTelSpan(self._tracer, span)

    def shutdown(self) -> None:
        self.provider.shutdown()


def tracer_with(service_name: str, processor: SpanProcessor, attributes: Attributes | None = None) -> OTelTracer:
    """A tracer whose finished spans go to `processor` (tests hand it the SDK's InMemorySpanExporter)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": service_name, **(attributes or {})}))
    provider.add_span_processor(processor)
    return OTelTracer(provider)


def make_tracer(endpoint: str | None, service_name: str, attributes: Attributes | None = None) -> Tracer:
    """`NO_TRACER` without an endpoint; else a tracer that batches its spans to the OTLP/HTTP collector at
    `endpoint` (e.g. http://collector:4318, or its full /v1/traces URL), as vLLM's --otlp-traces-endpoint."""
    if not endpoint:
        return NO_TRACER
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = traces_url(endpoint)
    logger.info("tracing: %s sends its spans to %s", service_name, url)
    return tracer_with(service_name, BatchSpanProcessor(OTLPSpanExporter(endpoint=url)), attributes)


def now_ns() -> int:
    """Unix time in nanoseconds: a span's start and end (time.time_ns, as OpenTelemetry's own)."""
    return time.time_ns()


def seconds_to_ns(seconds: float) -> int:
    return int(seconds * 1e9)


def traces_url(endpoint: str) -> str:
    """The collector's URL for spans: an endpoint given without a path gets OTLP/HTTP's /v1/traces."""
    from urllib.parse import urlsplit

    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"
