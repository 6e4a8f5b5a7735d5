"""A node's own Prometheus endpoint (`--metrics-port`): the process's metrics (CPU, resident memory, open files,
Python GC) and who the node is, for a PodMonitor per role. Load and KV metrics are not here: the proxy polls every
node's Stats and exports them per node (proxy/api/metrics.py), so dashboards need no second source."""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Gauge,
    start_http_server,
)

from wire import NodeIdentity


def node_registry(identity: NodeIdentity, incarnation: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    info = Gauge("tandem:node_process_info", "This node process (1): its id, role, incarnation and pod.",
                 ["node_id", "role", "model", "kv_backend", "incarnation", "pod_uid"], registry=registry)
    info.labels(identity.node_id, identity.role.value, identity.model, identity.kv_backend, str(incarnation),
                identity.pod_uid).set(1)
    return registry


def serve_node_metrics(host: str, port: int, identity: NodeIdentity, incarnation: int) -> None:
    """Serves /metrics on `port` from a daemon thread (prometheus_client's server) until the process exits."""
    start_http_server(port, addr=host, registry=node_registry(identity, incarnation))
