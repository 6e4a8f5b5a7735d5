"""The images (deploy/images/), without a Docker engine: hadolint on the Dockerfiles, the proxy image's Python
dependency set is torch-free and enough to run the proxy (it is started with only those packages importable), and
what the chart and the compose file run exists (modules, flags)."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.chart import CHART, REPO, render_ci
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import free_port

IMAGES = REPO / "deploy" / "images"
HEAVY = {"torch", "triton", "nixl", "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine",
         "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13", "ray", "xgrammar", "accelerate"}


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    dockerfiles = sorted(IMAGES.glob("*.Dockerfile"))
    assert {p.name for p in dockerfiles} == {"engine.Dockerfile", "proxy.Dockerfile"}
    run = subprocess.run([str(hadolint), *map(str, dockerfiles)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_engine_image_installs_exactly_one_kv_transfer_library():
    text = (IMAGES / "engine.Dockerfile").read_text()
    branches = re.findall(r"^\s+(\w+)\) pip install --no-cache-dir ([^;]+);;", text, re.MULTILINE)
    assert {name for name, _ in branches} == {"nixl", "mooncake"}
    for _, packages in branches:  # never a NIXL and a Mooncake package in one branch
        assert ("nixl" in packages) != ("mooncake" in packages), packages


def _closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements pull in (what pip would install beside them)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo.extend(Requirement(r) for r in metadata.distribution(name).requires or [])
    return seen


def _proxy_requirements() -> list[Requirement]:
    lines = (IMAGES / "proxy-requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in (ln.split("#", 1)[0].strip() for ln in lines) if line]


def test_the_proxy_image_dependency_set_is_torch_free():
    requirements = _proxy_requirements()
    assert all(str(r.specifier).startswith("==") for r in requirements), "pinned, as the engine's are"
    closure = _closure(requirements)
    assert "transformers" in closure and "grpcio" in closure
    assert not closure & HEAVY, sorted(closure & HEAVY)


@pytest.fixture(scope="module")
def proxy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site-packages holding only the proxy requirements' closure (links into this venv's)."""
    site = tmp_path_factory.mktemp("proxy-site")
    for name in _closure(_proxy_requirements()):
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not top.endswith(".pth") and top != ".." and not (site / top).exists():
                (site / top).symlink_to(source)
    return site


@pytest.fixture(scope="module")
def torch_free_proxy(proxy_site: Path, tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[str]:
    port = free_port()
    # -S: no site-packages but the proxy's; the repository for Tandem's own code (the image installs it --no-deps)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": f"{proxy_site}{os.pathsep}{REPO}"}
    log = tmp_path_factory.mktemp("proxy-image") / "proxy.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-S", "-m", "proxy", "--model", str(tiny_model("llama")),
                                    "--port", str(port), "--decode", f"127.0.0.1:{free_port()}"],
                                   env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/live", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(15)


def test_the_proxy_runs_with_only_its_image_dependencies(torch_free_proxy: str, proxy_site: Path):
    assert httpx.get(f"{torch_free_proxy}/ready", timeout=5).json() == {"status": "ok"}  # static nodes: no registry
    assert httpx.get(f"{torch_free_proxy}/v1/models", timeout=5).status_code == 200
    # and the environment it ran in really has no torch
    probe = subprocess.run([sys.executable, "-S", "-c", "import torch"], env={"PYTHONPATH": str(proxy_site)},
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_what_the_chart_runs_exists():
    from node_common.options import add_node_args

    node_parser = argparse.ArgumentParser()
    add_node_args(node_parser)
    rendered = render_ci(CHART / "ci" / "pd-rdma-values.yaml")
    for role in ("prefill", "decode"):
        container = rendered.named("Deployment", f"-{role}")["spec"]["template"]["spec"]["containers"][0]
        assert (REPO / f"{role}_node" / "__main__.py").exists()
        assert f"exec python -m {role}_node" in container["command"][2]
        used = {arg.split("=", 1)[0] for arg in container["args"]}
        # --tensor-parallel-size arrives with tensor parallelism (issue 15), merged separately
        assert used - _flags(node_parser) <= {"--tensor-parallel-size"}, used - _flags(node_parser)
    proxy = rendered.named("Deployment", "-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert proxy["command"] == ["python", "-m", "proxy"] and (REPO / "proxy" / "__main__.py").exists()


def test_the_compose_file_runs_the_same_entry_points():
    compose = yaml.safe_load((IMAGES / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert services["prefill"]["command"][:3] == ["python", "-m", "prefill_node"]
    assert services["decode"]["command"][:3] == ["python", "-m", "decode_node"]
    assert "--registry" in services["proxy"]["command"]
    proxy_entry = (IMAGES / "proxy.Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m", "proxy"]' in proxy_entry
