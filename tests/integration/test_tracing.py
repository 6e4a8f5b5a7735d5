"""A request's trace and phase metrics through a real P/D cluster (proxy, prefill node, decode node as processes,
each with --otlp-traces-endpoint): the spans reach a collector over OTLP/HTTP, as one trace whose node spans are
children of the proxy's, in the order the request ran; the nodes' reported phases fit inside what the proxy
measured itself."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import pd_cluster

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes  # b"" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


class Collector:
    """An OTLP/HTTP trace receiver on loopback: what a real collector gets, decoded with OTLP's own messages."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    received.append(ReceivedSpan(resource["service.name"], s.name, s.trace_id, s.span_id,
                                                 s.parent_span_id, s.start_time_unix_nano, s.end_time_unix_nano,
                                                 attributes))
        with self._lock:
            self.spans.extend(received)

    def trace_of(self, request_id_prefix: str, names: set[str], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of the trace whose root names this request, once every name in `names` arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            roots = [s for s in spans if s.name == "proxy.request"
                     and str(s.attributes.get("tandem.request_id", "")).startswith(request_id_prefix)]
            if roots:
                trace = [s for s in spans if s.trace_id == roots[0].trace_id]
                if names <= {s.name for s in trace}:
                    return trace
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans {names} not all received: got {sorted({s.name for s in spans})}")
            time.sleep(0.2)

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def traced_cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory, collector: Collector
                   ) -> Iterator[str]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch processor sends every 100 ms (default 5 s)
    flag = ["--otlp-traces-endpoint", collector.url]
    try:
        with pd_cluster(tiny_model("llama"), "ipc", Path(tmp_path_factory.mktemp("logs-tracing")),
                        node_flags=flag, proxy_flags=[*flag, "--served-model-name", "tiny"]) as url:
            yield url
    finally:
        mp.undo()


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"([^{ ]+)(?:\{.*\})? (\S+)", line)
        if match is not None and match[1] == name:
            total += float(match[2])
    return total


NODE_SPANS = {"proxy.request", "proxy.prefill", "proxy.decode", "prefill_node.Prefill", "prefill_node.queue",
              "prefill_node.prefill", "decode_node.Generate", "decode_node.kv_handoff", "decode_node.first_step"}


def test_a_pd_request_is_one_trace_of_proxy_prefill_and_decode_spans_linked_and_in_order(
        traced_cluster: str, collector: Collector) -> None:
    response = httpx.post(f"{traced_cluster}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "the quick brown fox jumps over", "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    trace = collector.trace_of(request_id, NODE_SPANS)
    by_name = {s.name: s for s in trace}
    assert len(trace) == len(NODE_SPANS), sorted(s.name for s in trace)  # one attempt each: no retries

    def parent(name: str) -> str:
        return next(s.name for s in trace if s.span_id == by_name[name].parent_span_id)

    assert by_name["proxy.request"].parent_span_id == b""
    assert parent("proxy.prefill") == parent("proxy.decode") == "proxy.request"
    assert parent("prefill_node.Prefill") == "proxy.prefill"
    assert parent("decode_node.Generate") == "proxy.decode"
    assert parent("prefill_node.queue") == parent("prefill_node.prefill") == "prefill_node.Prefill"
    assert parent("decode_node.kv_handoff") == parent("decode_node.first_step") == "decode_node.Generate"
    assert {by_name[n].service for n in ("proxy.request", "proxy.prefill", "proxy.decode")} == {"tandem-proxy"}
    assert by_name["prefill_node.Prefill"].service == "tandem-prefill"
    assert by_name["decode_node.Generate"].service == "tandem-decode"
    assert by_name["proxy.request"].attributes["tandem.mode"] == "disaggregated"

    # one clock (one machine): each span inside its parent, P's work before D's, each phase after the one before
    for s in trace:
        assert s.start_ns <= s.end_ns, s.name
        if s.parent_span_id:
            outer = next(p for p in trace if p.span_id == s.parent_span_id)
            assert outer.start_ns <= s.start_ns and s.end_ns <= outer.end_ns, (s.name, outer.name)
    assert by_name["prefill_node.queue"].end_ns == by_name["prefill_node.prefill"].start_ns
    assert by_name["proxy.prefill"].end_ns <= by_name["proxy.decode"].start_ns
    assert by_name["prefill_node.Prefill"].end_ns <= by_name["decode_node.Generate"].start_ns
    assert by_name["decode_node.kv_handoff"].end_ns == by_name["decode_node.first_step"].start_ns


def test_the_nodes_phases_fit_inside_the_proxys_own_latencies(traced_cluster: str) -> None:
    before = {n: _metric(traced_cluster, n) for n in (
        "tandem:request_queue_time_seconds_count", "tandem:kv_handoff_seconds_count")}
    for i in range(3):
        response = httpx.post(f"{traced_cluster}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"request number {i} of a few", "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
    assert _metric(traced_cluster, "tandem:request_queue_time_seconds_count") == before[
        "tandem:request_queue_time_seconds_count"] + 3
    assert _metric(traced_cluster, "tandem:kv_handoff_seconds_count") == before["tandem:kv_handoff_seconds_count"] + 3
    assert _metric(traced_cluster, "tandem:first_decode_step_seconds_count") == _metric(
        traced_cluster, "tandem:kv_handoff_seconds_count")
    assert _metric(traced_cluster, "tandem:request_prefill_time_seconds_sum") > 0
    assert _metric(traced_cluster, "tandem:first_decode_step_seconds_sum") > 0
    # P's queue and prefill happen within the time to first token the proxy measures from the request's arrival;
    # D's handoff and first step within the gap between the first and the second token (D starts after the first)
    ttft = _metric(traced_cluster, "tandem:time_to_first_token_seconds_sum")
    on_prefill = (_metric(traced_cluster, "tandem:request_queue_time_seconds_sum")
                  + _metric(traced_cluster, "tandem:request_prefill_time_seconds_sum"))
    assert 0 < on_prefill <= ttft
    itl = _metric(traced_cluster, "tandem:inter_token_latency_seconds_sum")
    on_decode = (_metric(traced_cluster, "tandem:kv_handoff_seconds_sum")
                 + _metric(traced_cluster, "tandem:first_decode_step_seconds_sum"))
    assert 0 < on_decode <= itl
