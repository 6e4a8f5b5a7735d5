"""The chart's planner (templates/planner.yaml), rendered offline: off by default; on, its manifests pass Helm's
strict lint and Kubernetes' strict schemas, its Role allows exactly get/patch of the two pools' scale (the
Deployments `tandem scale --kubernetes` finds by their labels), its arguments are ones the planner's own parser
takes, its profile is one the planner loads; and the refusals (no profile, KEDA autoscaling the pools)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import chart as helm
from helm_python.errors import HelmError

from benchmark.profile import NodeSpec, Profile, StepCost, profile_from_json
from cluster.planner.run import add_planner_arguments
from tests.deploy.chart import CHART, NAMESPACE, RELEASE, render_values
from tests.deploy.test_chart import KUBERNETES_VERSION


def _profile_json() -> str:
    node = NodeSpec("m", "bfloat16", "cuda", 0, 2048, 128, 16, 20000)
    profile = Profile(node, StepCost(0.012, 6e-5, 1e-4, 0.002), 0.01, 0.005, 1e-6)
    return json.dumps(profile.to_json())


def _values(**planner: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / "minimal-cpu-values.yaml").read_text())
    values["planner"] = {"enabled": True, "profile": _profile_json(), **planner}
    return values


def _named(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


PLANNER = f"{RELEASE}-tandem-planner"


def test_the_planner_is_off_by_default():
    values = yaml.safe_load((CHART / "ci" / "minimal-cpu-values.yaml").read_text())
    names = [m["metadata"]["name"] for m in render_values(values)]
    assert not [n for n in names if "planner" in n]


def test_planner_manifests_pass_helm_lint_and_kubernetes_strict_schemas():
    report = helm.lint(CHART, _values(), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], (problems, report["errors"])
    manifests = render_values(_values())
    planner = [m for m in manifests if m["metadata"]["name"].startswith(PLANNER)]
    assert {m["kind"] for m in planner} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service",
                                            "Deployment", "NetworkPolicy"}
    for manifest in planner:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_role_allows_get_and_patch_of_the_pools_scale_only():
    manifests = render_values(_values())
    pools = sorted(m["metadata"]["name"] for m in manifests if m["kind"] == "Deployment"
                   and m["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")
                   and m["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE)
    assert len(pools) == 2
    rules = _named(manifests, "Role", PLANNER)["rules"]
    scale = [r for r in rules if r["resources"] == ["deployments/scale"]]
    assert len(scale) == 1 and sorted(scale[0]["resourceNames"]) == pools
    assert scale[0]["apiGroups"] == ["apps"] and scale[0]["verbs"] == ["get", "patch"]
    assert all(set(r["verbs"]) <= {"get", "list", "patch"} for r in rules)
    assert all("patch" not in r["verbs"] for r in rules if r["resources"] != ["deployments/scale"])
    binding = _named(manifests, "RoleBinding", PLANNER)
    assert binding["roleRef"]["name"] == PLANNER
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PLANNER, "namespace": NAMESPACE}]
    pod = _named(manifests, "Deployment", PLANNER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == PLANNER and pod["automountServiceAccountToken"] is True


def test_the_planner_args_parse_and_its_profile_loads():
    manifests = render_values(_values(slo={"ttftMs": 400, "itlMs": 40, "percentile": 95}, decode={"min": 2, "max": 6}))
    container = _named(manifests, "Deployment", PLANNER)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "cluster.planner"]
    parser = argparse.ArgumentParser()
    add_planner_arguments(parser)
    args = parser.parse_args(container["args"])
    assert args.kubernetes and args.resolve_all and (args.namespace, args.release) == (NAMESPACE, RELEASE)
    assert (args.slo_ttft_ms, args.slo_itl_ms, args.slo_percentile) == (400, 40, 95)
    assert (args.min_decode, args.max_decode) == (2, 6)
    assert args.metrics_url == [f"http://{PLANNER}-proxies.{NAMESPACE}.svc:8000/metrics"]
    headless = _named(manifests, "Service", f"{PLANNER}-proxies")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "proxy"
    config = _named(manifests, "ConfigMap", PLANNER)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "profile")
    assert Path(mount["mountPath"]) / "profile.json" == Path(args.profile)
    assert profile_from_json(json.loads(config["data"]["profile.json"])).step.base_s == 0.012


def test_the_planner_needs_a_profile():
    with pytest.raises(HelmError, match="planner.profile"):
        render_values(_values(profile=""))


def test_the_planner_is_refused_beside_keda_autoscaling_of_the_pools():
    values = yaml.safe_load((CHART / "ci" / "keda-values.yaml").read_text())
    values["planner"] = _values()["planner"]
    with pytest.raises(HelmError, match="KEDA would undo"):
        render_values(values)


def test_an_unknown_planner_key_is_refused_by_the_schema():
    with pytest.raises(HelmError, match="intervalSecond"):
        render_values(_values(intervalSecond=5))
