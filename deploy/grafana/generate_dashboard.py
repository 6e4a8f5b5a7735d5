"""Writes the chart's Grafana dashboard (deploy/helm/tandem/dashboards/tandem.json) from the panel list below.

    python deploy/grafana/generate_dashboard.py          # rewrite the JSON
    python deploy/grafana/generate_dashboard.py --check  # exit 1 when the committed JSON differs (CI)

Generated rather than hand-edited so that every query is in one readable list that tests can parse
(tests/deploy/test_monitoring.py checks each with promql-parser, and that every metric exists on a live proxy).
All series come from the proxy's /metrics (proxy/api/metrics.py): per-node series carry node_id and role, and several
proxy replicas export the same ones, so per-node queries take `max by (node_id)` first.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "helm" / "tandem" / "dashboards" / "tandem.json"
SEL = 'namespace=~"$namespace",model_name=~"$model"'


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""


def per_node(metric: str, role: str) -> str:
    return f'max by (node_id) ({metric}{{{SEL},role="{role}"}})'


def quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[$__rate_interval])))",
                  f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99))


def by_backend(expression: str) -> str:
    """`expression` (per node_id) summed per KV backend, joined from the tandem:node_info info metric."""
    info = f"max by (node_id, kv_backend) (tandem:node_info{{{SEL}}})"
    return f"sum by (kv_backend) ({expression} * on (node_id) group_left (kv_backend) {info})"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Pools", (
        Panel("Nodes per role", (
            (f"max by (role) (tandem:num_nodes{{{SEL}}})", "{{role}} seen"),
            (f"sum by (role) (max by (node_id, role) (tandem:node_up{{{SEL}}}))", "{{role}} up"),
        ), description="Nodes the proxies see in the registry, and those answering."),
        Panel("P:D ratio", (
            (f'max(tandem:num_nodes{{{SEL},role="prefill"}}) / max(tandem:num_nodes{{{SEL},role="decode"}})',
             "prefill per decode"),
        ), kind="stat", description="Prefill nodes per decode node."),
        Panel("Heartbeat age", (
            (f"max by (node_id) (tandem:node_heartbeat_age_seconds{{{SEL}}})", "{{node_id}}"),
        ), unit="s"),
    )),
    ("Latency", (
        Panel("Time to first token", quantiles("tandem:time_to_first_token_seconds"), unit="s"),
        Panel("Inter-token latency", quantiles("tandem:inter_token_latency_seconds"), unit="s"),
        Panel("Requests", (
            (f"sum(tandem:num_requests_running{{{SEL}}})", "in flight"),
            (f"sum by (finished_reason) (rate(tandem:request_success_total{{{SEL}}}[$__rate_interval]))",
             "{{finished_reason}} /s"),
        )),
    )),
    ("Queues and KV cache", (
        Panel("Queued prompt tokens (prefill)", (
            (f"sum({per_node('tandem:num_queued_prefill_tokens', 'prefill')})", "total"),
            (per_node("tandem:num_queued_prefill_tokens", "prefill"), "{{node_id}}"),
        )),
        Panel("Waiting requests", (
            (f"sum by (role) (max by (node_id, role) (tandem:num_requests_waiting{{{SEL}}}))", "{{role}}"),
        )),
        Panel("KV cache usage (decode)", (
            (per_node("tandem:kv_cache_usage_perc", "decode"), "{{node_id}}"),
        ), unit="percentunit"),
    )),
    ("KV transfer", (
        Panel("Transfer latency by backend", (
            (by_backend(f"max by (node_id) (rate(tandem:kv_transfer_seconds_sum{{{SEL}}}[$__rate_interval]))")
             + " / " + by_backend(f"max by (node_id) (rate(tandem:kv_transfer_seconds_count{{{SEL}}}"
                                  "[$__rate_interval]))"), "{{kv_backend}} mean"),
        ), unit="s"),
        Panel("Transfer bytes by backend", (
            (by_backend(f"max by (node_id) (rate(tandem:kv_transfer_bytes_total{{{SEL}}}[$__rate_interval]))"),
             "{{kv_backend}}"),
        ), unit="Bps"),
        Panel("Transfer failures by backend", (
            (by_backend(f"max by (node_id) (rate(tandem:kv_transfer_failures_total{{{SEL}}}[$__rate_interval]))"),
             "{{kv_backend}}"),
            (f"sum(rate(tandem:prefill_leases_expired_total{{{SEL}}}[$__rate_interval]))", "leases expired"),
        ), unit="ops"),
    )),
    ("KV tiers", (
        # a hit rate per tier, each past the tiers above it (docs/architecture.md#kv-tiers)
        Panel("Prefix hit rate by tier", (
            (f"sum(rate(tandem:prefix_cache_hits_total{{{SEL}}}[$__rate_interval])) / "
             f"sum(rate(tandem:prefix_cache_queries_total{{{SEL}}}[$__rate_interval]))", "pool"),
            (f"sum by (tier) (rate(tandem:kv_tier_hits_total{{{SEL}}}[$__rate_interval])) / "
             f"sum by (tier) (rate(tandem:kv_tier_queries_total{{{SEL}}}[$__rate_interval]))", "{{tier}}"),
        ), unit="percentunit"),
        Panel("Tier bytes", (
            (f"sum by (tier) (rate(tandem:kv_tier_read_bytes_total{{{SEL}}}[$__rate_interval]))", "{{tier}} read"),
            (f"sum by (tier) (rate(tandem:kv_tier_write_bytes_total{{{SEL}}}[$__rate_interval]))", "{{tier}} written"),
        ), unit="Bps"),
        Panel("Store errors", (
            (f"sum(rate(tandem:kv_tier_errors_total{{{SEL}}}[$__rate_interval]))", "failed calls and bad blocks"),
        ), unit="ops"),
    )),
)


def queries() -> list[str]:
    """Every PromQL expression the dashboard holds (for tests)."""
    return [expr for _, panels in ROWS for panel in panels for expr, _ in panel.queries]


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, object]:
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": 8, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(panel.queries)],
    }


def _variable(name: str, label: str, query: str) -> dict[str, object]:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "refresh": 2, "includeAll": True, "multi": True,
            "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict[str, object]:
    panels: list[dict[str, object]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        for column, panel in enumerate(row):
            panels.append(_panel(panel, len(panels) + 1, 8 * column, y))
        y += 8
    return {
        "uid": "tandem-pd", "title": "Tandem: prefill/decode serving", "tags": ["tandem", "llm"],
        "schemaVersion": 39, "version": 1, "editable": True, "timezone": "browser", "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            _variable("namespace", "Namespace", "label_values(tandem:num_nodes, namespace)"),
            _variable("model", "Model", 'label_values(tandem:num_nodes{namespace=~"$namespace"}, model_name)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed dashboard is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
