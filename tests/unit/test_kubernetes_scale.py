"""`tandem scale --kubernetes` (cluster/kubernetes.py) and the requests the official `kubernetes` client sends.

There is no Kubernetes cluster here. The client talks to a small local HTTP server (a kubeconfig points at it) that
answers as the API server would and checks each request against the API's contract: the method and path of the
Deployment list, of the `scale` subresource (apps/v1, autoscaling/v1 Scale) and of a KEDA ScaledObject, the patch's
content type, and a body that changes exactly what the contract allows (`spec.replicas`, an int32 >= 0; KEDA's
`autoscaling.keda.sh/paused-replicas` annotation, a string of an integer, or null to remove it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from cluster.cli import main
from cluster.kubernetes import KubernetesPools, KubernetesScaleError, ScaleMethod

NAMESPACE, RELEASE = "llm", "demo"
MERGE_PATCH = "application/merge-patch+json"
INT32_MAX = 2**31 - 1


@dataclass
class FakeAPIServer:
    """Deployments of one release; `keda_roles` are annotated as the chart does when KEDA owns their replicas."""

    keda_roles: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str, Any]] = field(default_factory=list)  # method, path+query, type, body
    violations: list[str] = field(default_factory=list)
    replicas: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 2})
    paused: dict[str, str | None] = field(default_factory=dict)

    def deployment(self, role: str) -> dict[str, Any]:
        name = f"{RELEASE}-tandem-{role}"
        annotations = {"tandem.dev/scaled-object": name} if role in self.keda_roles else {}
        labels = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": role}
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels, "annotations": annotations},
                "spec": {"replicas": self.replicas[role], "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels}, "spec": {"containers": []}}}}

    def handle(self, method: str, target: str, content_type: str, body: Any) -> tuple[int, dict[str, Any]]:
        self.requests.append((method, target, content_type, body))
        url = urlsplit(target)
        parts = url.path.strip("/").split("/")
        deployments = f"apis/apps/v1/namespaces/{NAMESPACE}/deployments"
        if method == "GET" and url.path.strip("/") == deployments:
            selector = dict(term.split("=", 1) for term in parse_qs(url.query)["labelSelector"][0].split(","))
            items = [self.deployment(r) for r in self.replicas
                     if selector == {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": r}]
            return 200, {"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": items}
        if method == "PATCH" and "/".join(parts[:-2]) == deployments and parts[-1] == "scale":
            return self._scale(parts[-2], content_type, body)
        keda = f"apis/keda.sh/v1alpha1/namespaces/{NAMESPACE}/scaledobjects"
        if method == "PATCH" and "/".join(parts[:-1]) == keda:
            return self._pause(parts[-1], content_type, body)
        self.violations.append(f"no such API: {method} {target}")
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}

    def _scale(self, name: str, content_type: str, body: Any) -> tuple[int, dict[str, Any]]:
        # the scale subresource takes a patch of an autoscaling/v1 Scale; only spec.replicas is writable
        if content_type != MERGE_PATCH:
            self.violations.append(f"scale patched as {content_type}")
        replicas = body.get("spec", {}).get("replicas") if isinstance(body, dict) else None
        if set(body) - {"spec"} or set(body.get("spec", {})) != {"replicas"}:
            self.violations.append(f"the scale patch changes more than spec.replicas: {body}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= INT32_MAX:
            self.violations.append(f"spec.replicas is not an int32 >= 0: {replicas!r}")
            return 422, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422}
        role = name.rsplit("-", 1)[1]
        if role in self.keda_roles:
            self.violations.append(f"{name}'s replicas belong to KEDA, but its scale was patched")
        self.replicas[role] = replicas
        return 200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                     "metadata": {"name": name, "namespace": NAMESPACE},
                     "spec": {"replicas": replicas}, "status": {"replicas": replicas, "selector": f"role={role}"}}

    def _pause(self, name: str, content_type: str, body: Any) -> tuple[int, dict[str, Any]]:
        if content_type != MERGE_PATCH:
            self.violations.append(f"ScaledObject patched as {content_type}")
        annotations = body.get("metadata", {}).get("annotations", {}) if isinstance(body, dict) else {}
        if set(body) != {"metadata"} or set(body["metadata"]) != {"annotations"} \
                or set(annotations) != {"autoscaling.keda.sh/paused-replicas"}:
            self.violations.append(f"the ScaledObject patch changes more than paused-replicas: {body}")
        value = annotations.get("autoscaling.keda.sh/paused-replicas")
        if value is not None and not (isinstance(value, str) and value.isdigit()):
            self.violations.append(f"paused-replicas must be a string of an integer (or null), got {value!r}")
        self.paused[name.rsplit("-", 1)[1]] = value
        return 200, {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                     "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {}}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeAPIServer, Path]]:
    fake = FakeAPIServer()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            status, answer = fake.handle(self.command, self.path, content_type, body)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "operator", "user": {"token": "operator-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "operator", "namespace": NAMESPACE}}]}))
    try:
        yield fake, kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def test_scaling_a_pool_patches_its_deployments_scale_subresource(api: tuple[FakeAPIServer, Path]):
    fake, kubeconfig = api
    result = KubernetesPools(NAMESPACE, RELEASE, kubeconfig=str(kubeconfig)).scale("prefill", 3)
    assert result.method is ScaleMethod.SCALE_SUBRESOURCE and result.deployment == f"{RELEASE}-tandem-prefill"
    assert not fake.violations, fake.violations
    method, target, content_type, body = fake.requests[-1]
    assert (method, target, content_type, body) == (
        "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}-tandem-prefill/scale", MERGE_PATCH,
        {"spec": {"replicas": 3}})
    assert fake.replicas == {"prefill": 3, "decode": 2}  # the other pool untouched


def test_a_keda_pool_is_held_with_paused_replicas_and_handed_back_with_auto(api: tuple[FakeAPIServer, Path]):
    fake, kubeconfig = api
    fake.keda_roles = {"decode"}
    pools = KubernetesPools(NAMESPACE, RELEASE, kubeconfig=str(kubeconfig))
    assert pools.scale("decode", 5).method is ScaleMethod.KEDA_PAUSED_REPLICAS
    assert fake.requests[-1][:3] == ("PATCH", f"/apis/keda.sh/v1alpha1/namespaces/{NAMESPACE}/scaledobjects/"
                                              f"{RELEASE}-tandem-decode", MERGE_PATCH)
    assert fake.paused == {"decode": "5"}
    assert pools.scale("decode", None).method is ScaleMethod.KEDA_RESUMED
    assert fake.requests[-1][3] == {"metadata": {"annotations": {"autoscaling.keda.sh/paused-replicas": None}}}
    assert fake.paused == {"decode": None} and fake.replicas["decode"] == 2
    assert not fake.violations, fake.violations


def test_the_cli_scales_both_pools_and_refuses_what_it_cannot_do(api: tuple[FakeAPIServer, Path],
                                                                 capsys: pytest.CaptureFixture[str]):
    fake, kubeconfig = api
    common = ["scale", "--kubernetes", "--namespace", NAMESPACE, "--release", RELEASE, "--kubeconfig",
              str(kubeconfig)]
    assert main([*common, "--prefill", "2", "--decode", "0"]) == 0
    assert fake.replicas == {"prefill": 2, "decode": 0} and not fake.violations
    assert "demo-tandem-decode -> 0 replicas (scale subresource)" in capsys.readouterr().out
    assert main([*common, "--prefill", "auto"]) == 2  # not autoscaled: nothing to hand back
    assert "not autoscaled by KEDA" in capsys.readouterr().err
    assert main(["scale", "--kubernetes", "--namespace", NAMESPACE, "--release", "other", "--kubeconfig",
                 str(kubeconfig), "--decode", "1"]) == 2
    assert "found 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--prefill", "-1"])
    assert main(["scale", "--prefill", "auto"]) == 2  # the local (Ray) cluster has no KEDA
    assert "needs --kubernetes" in capsys.readouterr().err


def test_a_refused_patch_is_reported_not_raised(api: tuple[FakeAPIServer, Path]):
    fake, kubeconfig = api
    pools = KubernetesPools(NAMESPACE, RELEASE, kubeconfig=str(kubeconfig))
    with pytest.raises(KubernetesScaleError, match="negative|at least 0"):
        pools.scale("decode", -1)
    with pytest.raises(KubernetesScaleError, match="unknown role"):
        pools.scale("proxy", 1)
    assert not [r for r in fake.requests if r[0] == "PATCH"]
