"""The chart's KV tiers (values `kvTiers`): the cluster KV store's master (mooncake_master) as a Deployment of one
and a ClusterIP Service, and the flags that point every node at it; the host tier's size; what the chart refuses.
The Kubernetes schemas, security defaults, network policies and checkov run on ci/kv-store-values.yaml with the
other examples (test_chart.py, test_checkov.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python.errors import HelmError

from kvtransfer.kv_store import master_command
from settings.cluster import store_address
from tests.deploy.chart import CHART, RELEASE, Rendered, render_ci, render_values
from tests.deploy.test_chart import KUBERNETES_VERSION

STORE_EXAMPLE = CHART / "ci" / "kv-store-values.yaml"
STORE_FLAGS = ("--kv-store=", "--kv-store-segment-size=", "--kv-offloading-size=")


def _minimal(**kv_tiers: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / "minimal-cpu-values.yaml").read_text())
    values["kvTiers"] = kv_tiers
    return values


def _render(values: dict[str, Any]) -> Rendered:
    return Rendered("values", tuple(render_values(values)))


def _node_args(rendered: Rendered, role: str) -> list[str]:
    return rendered.named("Deployment", f"-{role}")["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], name: str) -> str:
    found = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(found) == 1, (name, args)
    return found[0]


def _store_objects(rendered: Rendered) -> list[str]:
    return [f"{m['kind']}/{m['metadata']['name']}" for m in rendered.manifests
            if m["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "kv-store"
            or m["metadata"]["name"].endswith("-kv-store")]


def test_the_master_is_one_recreated_deployment_behind_a_clusterip_service_on_its_port():
    rendered = render_ci(STORE_EXAMPLE)
    port = yaml.safe_load(STORE_EXAMPLE.read_text())["kvTiers"]["store"]["embedded"]["port"]
    deployment = rendered.named("Deployment", "-kv-store")
    service = rendered.named("Service", "-kv-store")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two masters behind the Service
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["ports"] == [{"name": "rpc", "containerPort": port, "protocol": "TCP"}]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "rpc"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "rpc"}
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "rpc", "port": port, "targetPort": "rpc", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    selected = [d["metadata"]["name"] for d in rendered.of_kind("Deployment")
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert selected == [deployment["metadata"]["name"]], "the Service selects the master and nothing else"


def test_the_master_runs_the_argv_kv_store_master_command_builds_for_every_interface():
    deployment = render_ci(STORE_EXAMPLE).named("Deployment", "-kv-store")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port = int(_flag(container["args"], "--rpc_port"))
    expected = master_command(port, "0.0.0.0")
    assert container["command"] == [Path(expected[0]).name]  # on the engine image's PATH
    assert container["args"] == expected[1:]


def test_nodes_are_pointed_at_the_master_service_by_its_dns_name_and_port():
    rendered = render_ci(STORE_EXAMPLE)
    values = yaml.safe_load(STORE_EXAMPLE.read_text())["kvTiers"]
    service = rendered.named("Service", "-kv-store")
    for role in ("prefill", "decode"):
        args = _node_args(rendered, role)
        host, _, port = store_address(_flag(args, "--kv-store")).rpartition(":")  # the node's own parser
        assert (host, int(port)) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
        assert float(_flag(args, "--kv-store-segment-size")) == values["store"]["segmentSizeGiB"]
        assert float(_flag(args, "--kv-offloading-size")) == values["offloadingSizeGiB"]
    assert service["metadata"]["name"] == f"{RELEASE}-tandem-kv-store"


def test_by_default_there_is_no_store_and_no_kv_tier_flag():
    rendered = _render(_minimal())
    assert _store_objects(rendered) == []
    for role in ("prefill", "decode"):
        assert not [a for a in _node_args(rendered, role) if a.startswith(STORE_FLAGS)]


def test_an_external_store_address_is_passed_to_the_nodes_and_no_master_is_rendered():
    values = _minimal(store={"external": {"address": "mooncake-master.kv.svc:50051"}, "segmentSizeGiB": 2.5})
    values["kvTransfer"] = {"backend": "mooncake"}
    rendered = _render(values)
    assert _store_objects(rendered) == []
    for role in ("prefill", "decode"):
        args = _node_args(rendered, role)
        assert _flag(args, "--kv-store") == "mooncake://mooncake-master.kv.svc:50051"
        assert _flag(args, "--kv-store-segment-size") == "2.5"
        assert not [a for a in args if a.startswith("--kv-offloading-size=")]
    for manifest in rendered.manifests:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_a_host_tier_alone_needs_no_store_and_works_with_any_backend():
    rendered = _render(_minimal(offloadingSizeGiB=4))
    assert _store_objects(rendered) == []
    for role in ("prefill", "decode"):
        args = _node_args(rendered, role)
        assert _flag(args, "--kv-offloading-size") == "4"
        assert not [a for a in args if a.startswith(("--kv-store=", "--kv-store-segment-size="))]


def test_the_master_port_follows_its_value():
    values = _minimal(store={"embedded": {"enabled": True, "port": 6000}})
    values["kvTransfer"] = {"backend": "mooncake"}
    rendered = _render(values)
    assert rendered.named("Service", "-kv-store")["spec"]["ports"][0]["port"] == 6000
    assert _flag(_node_args(rendered, "decode"), "--kv-store") == f"mooncake://{RELEASE}-tandem-kv-store:6000"
    policy = rendered.named("NetworkPolicy", "-kv-store")
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": 6000, "protocol": "TCP"}]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]


@pytest.mark.parametrize(("kv_tiers", "backend", "message"), [
    ({"store": {"embedded": {"enabled": True}}}, "nixl", "kvTiers.store needs kvTransfer.backend mooncake"),
    ({"store": {"external": {"address": "m:50051"}}}, "nixl", "kvTiers.store needs kvTransfer.backend mooncake"),
    ({"store": {"embedded": {"enabled": True}, "external": {"address": "m:50051"}}}, "mooncake", "not both"),
    ({"store": {"external": {"address": "mooncake://m:50051"}}}, "mooncake", "does not match"),  # host:port only
    ({"offloadingSizeGiB": -1}, "nixl", "minimum"),
    ({"store": {"segmentSize": 1}}, "mooncake", "additional properties 'segmentSize' not allowed"),
])
def test_the_chart_refuses_a_store_that_cannot_work(kv_tiers: dict[str, Any], backend: str, message: str):
    values = _minimal(**kv_tiers)
    values["kvTransfer"] = {"backend": backend}
    with pytest.raises(HelmError, match=message):
        render_values(values)
