"""Rendering the Helm chart offline (helm-python-sdk bundles Helm as a library) and reading what it made: the
manifests, the PromQL they and the dashboard hold, and the metric names those queries use."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml
from helm_python import chart as helm

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "tandem"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "demo", "llm"
# what Grafana and the chart's templates substitute in queries before Prometheus sees them
QUERY_SUBSTITUTIONS = {"$__rate_interval": "5m"}


@dataclass(frozen=True)
class Rendered:
    values_name: str
    manifests: tuple[dict[str, Any], ...]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def named(self, kind: str, suffix: str) -> dict[str, Any]:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"{self.values_name}: expected one {kind} named *{suffix}, found {len(found)}"
        return found[0]


def render_values(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's manifests for these values (raises helm_python's errors on a refusal)."""
    with helm.Chart.load(CHART) as loaded:
        out = loaded.render(values, name=RELEASE, namespace=NAMESPACE)
    manifests = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return manifests


@functools.cache
def render_ci(path: Path) -> Rendered:
    return Rendered(path.name, tuple(render_values(yaml.safe_load(path.read_text()))))


def dashboard_queries() -> list[str]:
    sys.path.insert(0, str(REPO / "deploy" / "grafana"))
    try:
        import generate_dashboard
    finally:
        sys.path.pop(0)
    committed = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    queries = [t["expr"] for p in committed["panels"] for t in p.get("targets", [])]
    assert sorted(queries) == sorted(generate_dashboard.queries()), "the committed dashboard is stale"
    return queries


def chart_queries(rendered: Rendered) -> list[str]:
    """The PromQL of the PrometheusRule and of every KEDA ScaledObject trigger."""
    queries = [rule["expr"] for rule_set in rendered.of_kind("PrometheusRule")
               for group in rule_set["spec"]["groups"] for rule in group["rules"]]
    queries += [trigger["metadata"]["query"] for scaled in rendered.of_kind("ScaledObject")
                for trigger in scaled["spec"]["triggers"] if trigger["type"] == "prometheus"]
    return queries


def metric_names(query: str) -> set[str]:
    """The metric names a query selects, from promql-parser's AST (raises ValueError when it does not parse)."""
    for placeholder, value in QUERY_SUBSTITUTIONS.items():
        query = query.replace(placeholder, value)
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(query), visit)
    return names

