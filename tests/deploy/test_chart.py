"""The Helm chart, rendered offline for every ci/*-values.yaml example: Helm's lint and schema, Kubernetes' own
schemas (strict) for built-in kinds, the upstream CRD schemas for KEDA and Prometheus-operator resources, and the
properties that matter on a cluster (replicas left to KEDA, PDBs that select their pods, probes, drain times,
refusals, security contexts)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import chart as helm
from helm_python.errors import HelmError
from yamllint import config as yamllint_config
from yamllint import linter

from tests.deploy.chart import CHART, CI_VALUES, Rendered, render_ci, render_values

KUBERNETES_VERSION = "1.33.0"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {  # (apiVersion, kind) -> the upstream CRD's schema (tests/deploy/schemas/*.yaml say where from)
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.v1alpha1.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.v1.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.v1.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.v1.yaml",
}
ci = pytest.mark.parametrize("values_file", CI_VALUES, ids=[p.name for p in CI_VALUES])


def _closed(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists properties: the API server would prune them
    silently, so a misspelt key would go unnoticed."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(item) for item in schema]
    return schema


def _base(**overrides: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / "minimal-cpu-values.yaml").read_text())
    for dotted, value in overrides.items():
        node = values
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return values


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def test_the_ci_examples_exist():
    assert {p.name for p in CI_VALUES} == {"minimal-cpu-values.yaml", "pd-rdma-values.yaml", "keda-values.yaml",
                                          "external-redis-values.yaml", "kv-store-values.yaml",
                                          "planner-values.yaml"}


@ci
def test_helm_lint_passes_strict(values_file: Path):
    report = helm.lint(CHART, yaml.safe_load(values_file.read_text()), strict=True, namespace="llm")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], (problems, report["errors"])


@ci
def test_builtin_kinds_pass_kubernetes_strict_schemas(values_file: Path):
    rendered = render_ci(values_file)
    builtin = [m for m in rendered.manifests if (m["apiVersion"], m["kind"]) not in CRD_SCHEMAS]
    assert builtin
    for manifest in builtin:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


@ci
def test_custom_resources_match_their_upstream_crd_schemas(values_file: Path):
    rendered = render_ci(values_file)
    for manifest in rendered.manifests:
        name = CRD_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
        if name is not None:
            schema = _closed(yaml.safe_load((SCHEMAS / name).read_text()))
            jsonschema.validate(manifest, schema)


def test_a_misspelt_crd_field_is_caught():
    manifest = copy.deepcopy(render_ci(CHART / "ci" / "keda-values.yaml").named("ScaledObject", "-decode"))
    manifest["spec"]["minReplicas"] = manifest["spec"].pop("minReplicaCount")  # the HPA's name, not KEDA's
    schema = _closed(yaml.safe_load((SCHEMAS / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")]).read_text()))
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(manifest, schema)


def test_values_and_examples_pass_yamllint():
    config = yamllint_config.YamlLintConfig("extends: default\nrules: {line-length: {max: 120}, document-start: "
                                            "disable, comments: {min-spaces-from-content: 1}, truthy: disable, "
                                            "braces: {max-spaces-inside: 1}}")
    for path in [CHART / "values.yaml", CHART / "Chart.yaml", *CI_VALUES]:
        problems = list(linter.run(path.read_text(), config))
        assert not problems, (path.name, [str(p) for p in problems])


# ---- what matters on a cluster ----

def test_keda_owns_the_replicas_of_autoscaled_roles():
    rendered = render_ci(CHART / "ci" / "keda-values.yaml")
    for role in ("prefill", "decode", "proxy"):
        deployment = rendered.named("Deployment", f"-{role}")
        assert "replicas" not in deployment["spec"], f"{role}: KEDA and Helm would fight over replicas"
        scaled = rendered.named("ScaledObject", f"-{role}")
        assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                    "name": deployment["metadata"]["name"]}
        assert scaled["spec"]["minReplicaCount"] >= 1
    prefill = rendered.named("ScaledObject", "-prefill")
    assert prefill["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 600
    assert "tandem:num_queued_prefill_tokens" in prefill["spec"]["triggers"][0]["metadata"]["query"]
    decode = rendered.named("ScaledObject", "-decode")
    assert decode["spec"]["triggers"][0]["metricType"] == "Value"  # a fraction: compared as it is
    assert "tandem:kv_cache_usage_perc" in decode["spec"]["triggers"][0]["metadata"]["query"]


def test_fixed_replicas_are_set_without_keda():
    rendered = render_ci(CHART / "ci" / "pd-rdma-values.yaml")
    assert rendered.named("Deployment", "-prefill")["spec"]["replicas"] == 2
    assert rendered.named("Deployment", "-decode")["spec"]["replicas"] == 4
    assert not rendered.of_kind("ScaledObject")


@ci
def test_every_pdb_selects_the_pods_of_one_workload(values_file: Path):
    rendered = render_ci(values_file)
    budgets = rendered.of_kind("PodDisruptionBudget")
    assert {b["metadata"]["name"].rsplit("-", 1)[1] for b in budgets} == {"prefill", "decode", "proxy"}
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        matching = [w for w in rendered.of_kind("Deployment")
                    if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert [w["metadata"]["name"] for w in matching] == [budget["metadata"]["name"]]


@ci
def test_nodes_probe_the_grpc_health_service_and_drain_within_their_grace(values_file: Path):
    rendered = render_ci(values_file)
    for role in ("prefill", "decode"):
        deployment = rendered.named("Deployment", f"-{role}")
        pod = _pod_spec(deployment)
        container = pod["containers"][0]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": ""}
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": "tandem.liveness"}
        assert container["startupProbe"]["grpc"] == {"port": port, "service": "tandem.liveness"}
        drain = next(float(a.split("=", 1)[1]) for a in container["args"] if a.startswith("--drain-timeout="))
        assert pod["terminationGracePeriodSeconds"] >= drain + 10
        assert "preStop" in container["lifecycle"]
        env = {e["name"]: e for e in container["env"]}
        assert env["TANDEM_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    proxy = _pod_spec(rendered.named("Deployment", "-proxy"))["containers"][0]
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/live"


@ci
def test_security_defaults(values_file: Path):
    rendered = render_ci(values_file)
    rdma = "rdma" in values_file.name
    for workload in [*rendered.of_kind("Deployment"), *rendered.of_kind("StatefulSet"), *rendered.of_kind("Job")]:
        pod = _pod_spec(workload)
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        # only the planner calls the Kubernetes API (its Role: the pools' scale, nothing else)
        planner = workload["metadata"]["labels"]["app.kubernetes.io/component"] == "planner"
        assert pod["automountServiceAccountToken"] is planner
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        node = workload["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")
        for container in pod.get("initContainers", []) + pod["containers"]:
            security = container["securityContext"]
            assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            if node and rdma and container["name"] in ("prefill", "decode"):
                assert security["capabilities"]["add"] == ["IPC_LOCK"]  # pinning memory needs it, nothing more
                assert "ulimit -l" in container["command"][2]  # the locked-memory check before the node starts
            else:
                assert security["runAsNonRoot"] is True and "add" not in security["capabilities"]
        for container in pod["containers"]:
            for env in container.get("env", []):
                assert not (env["name"] in ("TANDEM_API_KEY", "REDIS_PASSWORD") and "value" in env), \
                    f"{env['name']} must come from a Secret"
    assert not any(w["spec"]["template"]["spec"].get("runtimeClassName") for w in rendered.of_kind("Deployment")
                   if "rdma" not in values_file.name), "no runtime class unless asked for"


@ci
def test_network_policies_cover_every_pod(values_file: Path):
    rendered = render_ci(values_file)
    policies = rendered.of_kind("NetworkPolicy")
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in [*rendered.of_kind("Deployment"),
                                                                   *rendered.of_kind("StatefulSet")]]
    for labels in pods:
        assert any(_selects(p["spec"]["podSelector"], labels) for p in policies), labels


def test_the_proxy_is_reachable_only_from_configured_sources():
    rendered = render_ci(CHART / "ci" / "external-redis-values.yaml")
    proxy = rendered.named("NetworkPolicy", "-proxy")
    assert all("from" in rule for rule in proxy["spec"]["ingress"])
    assert not rendered.of_kind("StatefulSet"), "an external Redis: no embedded one"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_api_key_and_redis_password_come_from_secrets():
    rendered = render_ci(CHART / "ci" / "external-redis-values.yaml")
    pod = _pod_spec(rendered.named("Deployment", "-proxy"))
    proxy = pod["containers"][0]
    env = {e["name"]: e for e in proxy["env"]}
    assert "TANDEM_API_KEY" not in env  # a file, not the environment children inherit
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == "api-key")
    volume = next(v for v in pod["volumes"] if v["name"] == "api-key")
    assert volume["secret"]["secretName"] == "tandem-api-key"
    assert volume["secret"]["items"] == [{"key": "api-key", "path": "api-key"}]
    assert f"--api-key-file={mount['mountPath']}/api-key" in proxy["args"]
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "platform-redis", "key": "password"}
    assert "--registry=redis://:$(REDIS_PASSWORD)@redis-master.platform.svc:6379/2" in proxy["args"]


def test_grafana_dashboard_ships_as_a_labelled_configmap():
    rendered = render_ci(CHART / "ci" / "pd-rdma-values.yaml")
    dashboard = rendered.named("ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert (CHART / "dashboards" / "tandem.json").read_text().strip() == dashboard["data"]["tandem.json"].strip()


# ---- refusals ----

@pytest.mark.parametrize(("overrides", "message"), [
    ({"model__pvc__accessMode": "ReadWriteOnce"}, "a ReadWriteOnce volume cannot serve 3 pods"),
    ({"decode__drain__timeoutSeconds": 300, "decode__terminationGracePeriodSeconds": 300},
     "decode.terminationGracePeriodSeconds"),
    ({"prefill__autoscaling": {"enabled": True, "metric": "kv_cache_usage"}}, "a prefill pool scales on one of"),
    ({"model__pvc__claimName": ""}, "model.pvc.claimName"),
    ({"redis__embedded": {"enabled": False}}, "redis.external.address"),
])
def test_the_chart_refuses_what_cannot_work(overrides: dict[str, Any], message: str):
    with pytest.raises(HelmError, match=message):
        render_values(_base(**overrides))


def test_rwo_volume_is_fine_for_a_single_pod_and_min_replicas_are_at_least_one():
    values = _base(model__pvc__accessMode="ReadWriteOnce", prefill__replicas=0, decode__replicas=1,
                   proxy__replicas=0)
    with pytest.raises(HelmError, match="minimum"):  # the schema: a proxy is always needed
        render_values(values)
    values = _base(model__source="image", model__image={"reference": "registry.example.com/m:1"})
    assert render_values(values)
    with pytest.raises(HelmError, match="minimum"):
        render_values(_base(decode__autoscaling={"enabled": True, "minReplicas": 0}))


def test_unknown_keys_are_refused_by_the_schema():
    with pytest.raises(HelmError, match="additional properties 'replica' not allowed"):
        render_values(_base(prefill__replica=2))


def test_rendered_ci_examples_are_cached_per_file():
    assert isinstance(render_ci(CI_VALUES[0]), Rendered)


def test_every_schema_key_is_in_values_yaml_and_documented_there():
    """values.yaml is the documentation: a key the schema accepts but values.yaml lacks is a key nobody can find
    (the other way round, the schema's additionalProperties: false refuses values.yaml's own undeclared keys)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], value: Any, path: str) -> list[str]:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node
        if node.get("additionalProperties") is not False:
            return []  # a free-form map (labels, resources): its keys are the user's
        missing = []
        for key, child in node["properties"].items():
            if not isinstance(value, dict) or key not in value:
                missing.append(f"{path}{key}")
            else:
                missing += walk(child, value[key], f"{path}{key}.")
        return missing

    properties = {k: v for k, v in schema["properties"].items() if k != "global"}
    assert walk({**schema, "properties": properties}, values, "") == []


def test_the_committed_schema_is_what_its_generator_writes():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(CHART.parent / "generate_schema.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
