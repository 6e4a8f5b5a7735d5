"""Writes the chart's values.schema.json (deploy/helm/tandem/values.schema.json) from the declarations below.

    python deploy/helm/generate_schema.py          # rewrite the schema
    python deploy/helm/generate_schema.py --check  # exit 1 when the committed schema differs (CI)

Our own keys are closed (additionalProperties: false): a misspelt value fails `helm install` instead of being
ignored. Kubernetes' own types (resources, affinity, tolerations) are left to Kubernetes' validation.
tests/deploy/test_chart.py checks that every key declared here is in values.yaml, where it is documented.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "tandem" / "values.schema.json"


Schema = dict[str, Any]


def obj(properties: Schema, required: list[str] | None = None, description: str | None = None) -> Schema:
    """One of our own mappings: closed, so that an unknown key is refused."""
    schema: Schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = required
    if description:
        schema["description"] = description
    return schema


def integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
PORT = integer(1, 65535)
KUBERNETES_OBJECT: Schema = {"type": "object"}  # Kubernetes' own types (affinity, ...): Kubernetes validates them
KUBERNETES_LIST: Schema = {"type": "array"}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY: Schema = {"type": ["string", "integer"]}
NUMBER_STRING: Schema = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
PULL_POLICY = enum("Always", "IfNotPresent", "Never")
HOST_PORT: Schema = {"type": "string", "pattern": r"^$|^[A-Za-z0-9.\-]+:[0-9]+$"}  # "" = none
GIB: Schema = {"type": "number", "minimum": 0}

PROBE = obj({"periodSeconds": integer(1), "timeoutSeconds": integer(1), "failureThreshold": integer(1)})
RESOURCES = obj({"requests": {"type": "object", "additionalProperties": QUANTITY},
                 "limits": {"type": "object", "additionalProperties": QUANTITY}})
PDB = obj({"enabled": BOOLEAN, "maxUnavailable": {"type": ["integer", "string"]}})
IMAGE = obj({"repository": STRING, "tag": STRING, "pullPolicy": PULL_POLICY}, ["repository"])
PLACEMENT: Schema = {"nodeSelector": STRING_MAP, "tolerations": KUBERNETES_LIST, "affinity": KUBERNETES_OBJECT,
                     "topologySpreadConstraints": KUBERNETES_LIST, "priorityClassName": STRING,
                     "podAnnotations": STRING_MAP, "podLabels": STRING_MAP, "extraEnv": KUBERNETES_LIST,
                     "extraArgs": {"type": "array", "items": STRING}}

ROLE = obj({
    "replicas": integer(0), "port": PORT, "metricsPort": PORT,
    "parallelism": obj({"tensor": integer(1)}),
    "gpu": obj({"count": integer(0), "resourceName": STRING}),
    "resources": RESOURCES, "shmSize": QUANTITY, "runtimeClassName": STRING, **PLACEMENT,
    "probes": obj({"startup": PROBE, "readiness": PROBE, "liveness": PROBE}, ["startup", "readiness", "liveness"]),
    "drain": obj({"timeoutSeconds": integer(1)}, ["timeoutSeconds"]),
    "terminationGracePeriodSeconds": integer(1),
    "podDisruptionBudget": PDB,
    "autoscaling": obj({
        "enabled": BOOLEAN, "minReplicas": integer(1), "maxReplicas": integer(1),
        "metric": enum("queued_prompt_tokens", "ttft_p90_seconds", "kv_cache_usage", "running_requests",
                       "itl_p90_seconds"),
        "target": NUMBER_STRING,
        "pollingIntervalSeconds": integer(1), "cooldownPeriodSeconds": integer(0),
        "scaleDownStabilizationSeconds": integer(0)},
        description="A KEDA ScaledObject on Tandem's metrics; min >= 1 (a pool never scales to zero)"),
}, description="A node role (prefill and decode have the same keys)")

schema: Schema = {
    "$schema": "https://json-schema.org/draft-07/schema#",
    "title": "Tandem chart values",
    "type": "object", "additionalProperties": False,
    "definitions": {"role": ROLE},
    "properties": {
        "nameOverride": STRING, "fullnameOverride": STRING,
        "image": obj({"engine": IMAGE, "proxy": IMAGE}),
        "imagePullSecrets": KUBERNETES_LIST,
        "serviceAccount": obj({"create": BOOLEAN, "name": STRING, "automountServiceAccountToken": BOOLEAN}),
        "cluster": obj({
            "blockSize": integer(1), "hashSeed": STRING, "dtype": enum("auto", "float32", "bfloat16", "float16"),
            "extraSettings": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]},
                              "propertyNames": {"pattern": "^TANDEM_[A-Z0-9_]+$"}}}),
        "model": obj({
            "source": enum("pvc", "download", "image"), "path": STRING, "servedModelName": STRING,
            "pvc": obj({"claimName": STRING,
                        "accessMode": enum("ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce", "ReadWriteOncePod")}),
            "download": obj({"repository": STRING, "revision": STRING, "storageClassName": STRING, "size": QUANTITY,
                             "accessMode": enum("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"),
                             "tokenSecret": obj({"name": STRING, "key": STRING}), "backoffLimit": integer(0),
                             "resources": RESOURCES}),
            "image": obj({"reference": STRING, "pullPolicy": PULL_POLICY}),
        }, ["source"]),
        "kvTransfer": obj({
            "backend": enum("nixl", "mooncake"),
            "nixl": obj({"ucxDevices": STRING, "ucxConfig": STRING, "ucxTls": STRING}),
            "mooncake": obj({"protocol": enum("tcp", "rdma", "nvlink_intra")}),
            "rdma": obj({"enabled": BOOLEAN, "resourceName": STRING, "resourceCount": integer(1),
                         "minLockedMemoryKiB": integer(0)}),
            "extraEnv": STRING_MAP,
        }, ["backend"]),
        "kvTiers": obj({
            "offloadingSizeGiB": GIB,
            "store": obj({
                "segmentSizeGiB": GIB,
                "embedded": obj({"enabled": BOOLEAN, "port": PORT, "resources": RESOURCES, **PLACEMENT}),
                "external": obj({"address": HOST_PORT}),
            }, description="The cluster KV store (Mooncake Store): the chart's own mooncake_master, or an existing "
                           "one's RPC address"),
        }),
        "prefill": {"$ref": "#/definitions/role"},
        "decode": {"$ref": "#/definitions/role"},
        "proxy": obj({
            "replicas": integer(1), "port": PORT,
            "service": obj({"type": enum("ClusterIP", "NodePort", "LoadBalancer"), "port": PORT}),
            "apiKey": obj({"existingSecret": STRING, "secretKey": STRING}),
            "resources": RESOURCES, **PLACEMENT,
            "probes": obj({"readiness": PROBE, "liveness": PROBE}),
            "terminationGracePeriodSeconds": integer(1),
            "podDisruptionBudget": PDB,
            "autoscaling": obj({"enabled": BOOLEAN, "kind": enum("hpa", "keda"), "minReplicas": integer(1),
                                "maxReplicas": integer(1), "targetCPUUtilizationPercentage": integer(1, 100),
                                "targetRequestsInFlight": NUMBER_STRING}),
        }),
        "redis": obj({
            "embedded": obj({"enabled": BOOLEAN, "image": IMAGE, "resources": RESOURCES}),
            "external": obj({"address": HOST_PORT, "database": integer(0, 15)}),
            "auth": obj({"existingSecret": STRING, "secretKey": STRING}),
        }),
        "keda": obj({"prometheusServerAddress": {"type": "string", "pattern": "^https?://"}}),
        "monitoring": obj({
            "podMonitor": obj({"enabled": BOOLEAN, "interval": STRING, "labels": STRING_MAP}),
            "serviceMonitor": obj({"enabled": BOOLEAN, "interval": STRING, "labels": STRING_MAP}),
            "prometheusRule": obj({"enabled": BOOLEAN, "labels": STRING_MAP,
                                   "staleHeartbeatSeconds": {"type": "number", "exclusiveMinimum": 0}}),
            "grafanaDashboard": obj({"enabled": BOOLEAN, "labels": STRING_MAP}),
            "namespaceSelector": KUBERNETES_OBJECT,
        }),
        "networkPolicy": obj({"enabled": BOOLEAN, "proxyFrom": KUBERNETES_LIST}),
        "planner": obj({
            "enabled": BOOLEAN, "image": IMAGE, "profile": STRING,
            "slo": obj({"ttftMs": {"type": "number", "exclusiveMinimum": 0},
                        "itlMs": {"type": "number", "exclusiveMinimum": 0},
                        "percentile": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
                       ["ttftMs", "itlMs", "percentile"]),
            "intervalSeconds": {"type": "number", "exclusiveMinimum": 0}, "cooldownSeconds": {"type": "number",
                                                                                          "minimum": 0},
            "prefill": obj({"min": integer(0), "max": integer(1)}, ["min", "max"]),
            "decode": obj({"min": integer(1), "max": integer(1)}, ["min", "max"]),
            "colocateMaxTokens": integer(0), "metricsPort": PORT, "resources": RESOURCES,
            "nodeSelector": STRING_MAP, "tolerations": KUBERNETES_LIST,
            "extraArgs": {"type": "array", "items": STRING},
        }, description="The planner (cluster/planner/): sizes the prefill and decode pools from the proxies' metrics"),
        "global": {"type": "object", "description": "Helm's own (passed to subcharts)"},
    },
}


def render() -> str:
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed schema is stale")
    args = parser.parse_args()
    if args.check:
        if OUTPUT.read_text() != render():
            print(f"{OUTPUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
