"""The PromQL the chart ships (alert rules, KEDA triggers) and the Grafana dashboard's: every query parses
(promql-parser), and the committed dashboard is what its generator writes. That every metric they name exists on
a live proxy is checked against a running cluster in tests/integration/test_registry.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy.chart import CHART, CI_VALUES, REPO, chart_queries, dashboard_queries, metric_names, render_ci


def test_the_committed_dashboard_is_what_the_generator_writes():
    run = subprocess.run([sys.executable, str(REPO / "deploy" / "grafana" / "generate_dashboard.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_every_dashboard_query_parses_and_names_tandem_metrics():
    queries = dashboard_queries()
    assert len(queries) >= 15
    for query in queries:
        names = metric_names(query)
        assert names and all(n.startswith("tandem:") for n in names), query


@pytest.mark.parametrize("values_file", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_every_rule_and_scaler_query_parses(values_file):
    for query in chart_queries(render_ci(values_file)):
        assert all(n.startswith("tandem:") for n in metric_names(query)), query


def test_rules_cover_transfer_failures_missing_decode_nodes_and_stale_heartbeats():
    rendered = render_ci(CHART / "ci" / "pd-rdma-values.yaml")
    rules = {rule["alert"]: rule["expr"] for rule_set in rendered.of_kind("PrometheusRule")
             for group in rule_set["spec"]["groups"] for rule in group["rules"]}
    assert "tandem:kv_transfer_failures_total" in metric_names(rules["TandemKVTransferFailures"])
    assert metric_names(rules["TandemNoDecodeNode"]) == {"tandem:num_nodes"}
    assert metric_names(rules["TandemStaleHeartbeat"]) == {"tandem:node_heartbeat_age_seconds"}


def test_a_query_that_does_not_parse_is_caught():
    with pytest.raises(ValueError):
        metric_names("sum(rate(tandem:kv_transfer_bytes_total[5m])")
