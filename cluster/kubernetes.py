"""`tandem scale --kubernetes`: resize the prefill and decode pools of a Tandem Helm release (deploy/helm/tandem),
through the official `kubernetes` client with the operator's own kubeconfig.

A pool is the release's Deployment labelled `app.kubernetes.io/instance=<release>` and
`app.kubernetes.io/component=<role>`. How it is resized depends on who owns its replicas:
- nobody but the Deployment: its `scale` subresource is patched (a JSON merge patch of `spec.replicas`), as
  `kubectl scale` does; a later `helm upgrade` sets the values' replicas again;
- KEDA (the chart annotates the Deployment with its ScaledObject's name): the ScaledObject gets KEDA's
  `autoscaling.keda.sh/paused-replicas` annotation, which holds the pool at that size with autoscaling paused
  (patching the Deployment would be undone by KEDA's HPA within seconds); `auto` removes the annotation and
  hands the pool back to KEDA.
Removed nodes drain on their SIGTERM (node_common/server.py), within the pods' termination grace period.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

SCALED_OBJECT_ANNOTATION = "tandem.dev/scaled-object"  # set by the chart on autoscaled Deployments
PAUSED_REPLICAS_ANNOTATION = "autoscaling.keda.sh/paused-replicas"
MERGE_PATCH = "application/merge-patch+json"
KEDA_GROUP, KEDA_VERSION, KEDA_PLURAL = "keda.sh", "v1alpha1", "scaledobjects"
ROLES = ("prefill", "decode")


class KubernetesScaleError(Exception):
    """Something the operator can fix (no such release, KEDA's `auto` without KEDA, an API error); the message says
    what."""


class ScaleMethod(enum.Enum):
    SCALE_SUBRESOURCE = "scale subresource"
    KEDA_PAUSED_REPLICAS = "KEDA paused-replicas"
    KEDA_RESUMED = "KEDA autoscaling resumed"


@dataclass(frozen=True)
class ScaleResult:
    role: str
    deployment: str
    replicas: int | None  # None: handed back to KEDA
    method: ScaleMethod

    def describe(self) -> str:
        target = "KEDA decides" if self.replicas is None else f"{self.replicas} replicas"
        return f"{self.role}: {self.deployment} -> {target} ({self.method.value})"


class KubernetesPools:
    """The release's node pools on one cluster. `api_client` is a `kubernetes.client.ApiClient` (default: one from
    the kubeconfig, or the in-cluster configuration when there is no kubeconfig)."""

    def __init__(self, namespace: str, release: str, api_client: Any | None = None,
                 kubeconfig: str | None = None, context: str | None = None) -> None:
        from kubernetes import client, config  # only for this command: the client is heavy

        if api_client is None:
            try:
                api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
            except config.ConfigException as e:
                if kubeconfig is not None or context is not None:
                    raise KubernetesScaleError(f"cannot load the kubeconfig: {e}") from None
                config.load_incluster_config()
                api_client = client.ApiClient()
        self.namespace = namespace
        self.release = release
        self._client = client
        self._apps = client.AppsV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    def scale(self, role: str, replicas: int | None) -> ScaleResult:
        """Sets `role`'s pool to `replicas` (None: back to KEDA)."""
        if role not in ROLES:
            raise KubernetesScaleError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        if replicas is not None and replicas < 0:
            raise KubernetesScaleError(f"--{role} must be at least 0, got {replicas}")
        deployment = self._deployment(role)
        name = deployment.metadata.name
        scaled_object = (deployment.metadata.annotations or {}).get(SCALED_OBJECT_ANNOTATION)
        try:
            if scaled_object:
                # merge patch: a null value removes the annotation
                value = None if replicas is None else str(replicas)
                self._custom.patch_namespaced_custom_object(
                    KEDA_GROUP, KEDA_VERSION, self.namespace, KEDA_PLURAL, scaled_object,
                    {"metadata": {"annotations": {PAUSED_REPLICAS_ANNOTATION: value}}}, _content_type=MERGE_PATCH)
                method = ScaleMethod.KEDA_RESUMED if replicas is None else ScaleMethod.KEDA_PAUSED_REPLICAS
                return ScaleResult(role, name, replicas, method)
            if replicas is None:
                raise KubernetesScaleError(f"--{role} auto: {name} is not autoscaled by KEDA (enable "
                                           f"{role}.autoscaling in the chart's values)")
            self._apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": replicas}},
                                                         _content_type=MERGE_PATCH)
        except self._client.ApiException as e:
            raise KubernetesScaleError(f"{role}: the Kubernetes API refused the change ({e.status} {e.reason}): "
                                       f"{(e.body or '')[:300]}") from None
        return ScaleResult(role, name, replicas, ScaleMethod.SCALE_SUBRESOURCE)

    def replicas(self, role: str) -> int:
        """The pool's size as its Deployment asks (spec.replicas), for the planner (cluster/planner/loop.py)."""
        return int(self._deployment(role).spec.replicas or 0)

    def _deployment(self, role: str) -> Any:
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component={role}"
        try:
            found = self._apps.list_namespaced_deployment(self.namespace, label_selector=selector).items
        except self._client.ApiException as e:
            raise KubernetesScaleError(f"cannot list Deployments in {self.namespace} ({e.status} {e.reason})") \
                from None
        if len(found) != 1:
            raise KubernetesScaleError(f"expected one {role} Deployment of release {self.release!r} in namespace "
                                       f"{self.namespace!r} ({selector}), found {len(found)}")
        return found[0]
