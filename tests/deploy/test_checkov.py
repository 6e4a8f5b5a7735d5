"""checkov (`--framework kubernetes`) on the manifests of every ci/*-values.yaml example, in one invocation (it takes
seconds to start). Every finding must be one of the deliberate choices below, each with its reason and the
resources it may concern.

checkov lives in its own virtual environment (`make setup` makes .venv-checkov): its pins would downgrade packages
the project's venv needs (networkx, packaging)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import CI_VALUES, REPO, render_ci

# check -> why the chart does it anyway
DELIBERATE = {
    "CKV_K8S_11": "no CPU limits on serving containers (and the KV store's master, which every store lookup "
                  "asks): CFS throttling adds latency to every token; requests reserve the CPU (the init "
                  "containers have limits)",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent with versioned tags: the engine image is several GB",
    "CKV_K8S_43": "images by tag: the operator pins a digest in image.*.tag if they want one",
    "CKV_K8S_35": "the Redis password as an environment variable: Kubernetes expands it into the registry URL "
                  "argument (the API key, which clients use, is mounted as a file)",
}
# checks that only the RDMA example's engine pods may fail: memory pinning for RDMA needs root and IPC_LOCK
RDMA_ONLY = {"CKV_K8S_23", "CKV_K8S_25", "CKV_K8S_40"}
# only the planner mounts its service account's token: it patches the pools' scale (its Role allows that alone)
PLANNER_ONLY = {"CKV_K8S_38"}


def _checkov() -> str:
    for candidate in (REPO / ".venv-checkov" / "bin" / "checkov",
                      Path(sys.prefix).parent / ".venv-checkov" / "bin" / "checkov"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("checkov")
    if found is None:
        pytest.fail("checkov is not installed: `make setup` installs it into .venv-checkov")
    return found


def test_checkov_finds_only_deliberate_choices(tmp_path: Path):
    for values_file in CI_VALUES:
        (tmp_path / values_file.name).write_text(yaml.safe_dump_all(render_ci(values_file).manifests))
    run = subprocess.run([_checkov(), "--directory", str(tmp_path), "--framework", "kubernetes", "--output", "json",
                          "--quiet", "--compact", "--skip-download"], capture_output=True, text=True, timeout=300)
    assert run.stdout, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["summary"]["passed"] > 100, report["summary"]  # it did check something
    unexpected = []
    for failed in report["results"]["failed_checks"]:
        check, resource, file = failed["check_id"], failed["resource"], failed["file_path"]
        if check in DELIBERATE:
            continue
        rdma_engine = file.endswith("pd-rdma-values.yaml") and resource.split(".")[-1].endswith(("-prefill",
                                                                                                  "-decode"))
        if check in RDMA_ONLY and rdma_engine:
            continue
        if check in PLANNER_ONLY and resource.endswith("-planner"):
            continue
        unexpected.append(f"{check} {failed['check_name']}: {resource} ({file})")
    assert not unexpected, "\n".join(unexpected)
