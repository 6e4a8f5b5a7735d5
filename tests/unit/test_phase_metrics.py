"""Where a request's time goes: the phase histograms the proxy serves, spans linked across processes by W3C trace
context (the OpenTelemetry SDK's InMemorySpanExporter), and a process without tracing importing no OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from node_common.tracing import NO_SPAN, NO_TRACER, SpanKind, tracer_with, traces_url
from proxy.api.metrics import PHASE_BUCKETS, ProxyMetrics
from wire import DecodeTimings, PrefillTimings

ROOT = Path(__file__).resolve().parents[2]


def _samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_reported_phases_become_histograms_under_vllm_names_with_the_model_label() -> None:
    metrics = ProxyMetrics("tiny")
    metrics.phases.observe_prefill(PrefillTimings(queue_seconds=0.002, prefill_seconds=0.3))
    metrics.phases.observe_prefill(PrefillTimings(queue_seconds=1.5, prefill_seconds=0.05))
    metrics.phases.observe_decode(DecodeTimings(handoff_seconds=0.004, first_step_seconds=0.02))
    samples = _samples(metrics)
    model = (("model_name", "tiny"),)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({**dict(model), **labels}.items())))]

    assert value("tandem:request_queue_time_seconds_count") == 2
    assert abs(value("tandem:request_queue_time_seconds_sum") - 1.502) < 1e-9
    assert abs(value("tandem:request_prefill_time_seconds_sum") - 0.35) < 1e-9
    # cumulative buckets: 0.002 falls in le=0.0025, 1.5 in le=2.5 (and none in between reaches 1.5)
    assert value("tandem:request_queue_time_seconds_bucket", le="0.001") == 0
    assert value("tandem:request_queue_time_seconds_bucket", le="0.0025") == 1
    assert value("tandem:request_queue_time_seconds_bucket", le="1.0") == 1
    assert value("tandem:request_queue_time_seconds_bucket", le="2.5") == 2
    assert value("tandem:kv_handoff_seconds_count") == 1
    assert value("tandem:kv_handoff_seconds_bucket", le="0.005") == 1
    assert value("tandem:kv_handoff_seconds_bucket", le="0.0025") == 0
    assert abs(value("tandem:first_decode_step_seconds_sum") - 0.02) < 1e-9
    assert value("tandem:first_decode_step_seconds_bucket", le="+Inf") == 1
    assert len([k for k in samples if k[0] == "tandem:kv_handoff_seconds_bucket"]) == len(PHASE_BUCKETS) + 1


def test_a_span_started_from_anothers_metadata_joins_its_trace_as_its_child() -> None:
    # two tracers, two exporters: a proxy and a node as two processes would have them
    proxy_spans, node_spans = InMemorySpanExporter(), InMemorySpanExporter()
    proxy = tracer_with("tandem-proxy", SimpleSpanProcessor(proxy_spans))
    node = tracer_with("tandem-prefill", SimpleSpanProcessor(node_spans))
    root = proxy.start("proxy.request")
    call = root.child("proxy.prefill", SpanKind.CLIENT, {"tandem.node_id": "p0"})
    metadata = call.metadata()
    assert [key for key, _ in metadata] == ["traceparent"]
    start_ns = 1_000_000_000_000
    served = node.start("prefill_node.Prefill", SpanKind.SERVER, parent=metadata, start_ns=start_ns)
    served.record_child("prefill_node.queue", start_ns, start_ns + 2_000_000)
    served.end(start_ns + 5_000_000)
    call.end()
    root.end()
    proxy.shutdown()
    node.shutdown()

    by_name = {s.name: s for s in [*proxy_spans.get_finished_spans(), *node_spans.get_finished_spans()]}
    assert set(by_name) == {"proxy.request", "proxy.prefill", "prefill_node.Prefill", "prefill_node.queue"}
    trace_ids = {s.context.trace_id for s in by_name.values()}
    assert len(trace_ids) == 1
    assert by_name["proxy.request"].parent is None
    assert by_name["proxy.prefill"].parent.span_id == by_name["proxy.request"].context.span_id
    assert by_name["prefill_node.Prefill"].parent.span_id == by_name["proxy.prefill"].context.span_id
    assert by_name["prefill_node.Prefill"].parent.is_remote
    assert by_name["prefill_node.queue"].parent.span_id == by_name["prefill_node.Prefill"].context.span_id
    queue = by_name["prefill_node.queue"]
    assert (queue.start_time, queue.end_time) == (start_ns, start_ns + 2_000_000)
    assert by_name["prefill_node.Prefill"].resource.attributes["service.name"] == "tandem-prefill"
    assert by_name["proxy.prefill"].attributes["tandem.node_id"] == "p0"


def test_without_an_endpoint_nothing_is_traced_and_no_span_is_made() -> None:
    span = NO_TRACER.start("proxy.request", parent=(("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),))
    assert span is NO_SPAN and not span.recording
    assert span.child("proxy.prefill").metadata() == ()


def test_an_endpoint_without_a_path_gets_otlp_https_traces_path() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/custom/traces") == "http://collector:4318/custom/traces"


def test_a_proxy_or_node_without_tracing_loads_no_tracing_sdk_or_exporter() -> None:
    # (redis 8 imports the OpenTelemetry API and its metrics SDK on its own: only the tracing parts are ours)
    code = ("import sys; import node_common.tracing, proxy.routing.pd, proxy.api.metrics, prefill_node.service, "
            "decode_node.service; print(sorted(m for m in sys.modules if m.startswith(("
            "'opentelemetry.sdk.trace', 'opentelemetry.exporter', 'opentelemetry.propagators'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"
