"""The admin API's token check and input validation, the state file the CLI reads, and the CLI's errors
(no Ray: the pool manager is only asked for sizes here)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from cluster import cli
from cluster.admin import create_admin_app
from cluster.pools import NodeLaunch, PoolManager, placement_bundles
from cluster.state import ClusterState, read_state, remove_state, state_path, write_state

TOKEN = "secret-token"


@pytest.fixture
def pools() -> PoolManager:
    launch = NodeLaunch(model="/m", registry_url="redis://127.0.0.1:1/0")
    return PoolManager(launch, {"prefill": 1, "decode": 1})


@pytest.fixture
def client(pools: PoolManager) -> TestClient:
    return TestClient(create_admin_app(pools, TOKEN, extra_status={"proxy_url": "http://127.0.0.1:8000"}))


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_status_reports_desired_and_ready_per_pool(client: TestClient) -> None:
    body = client.get("/status", headers=auth()).json()
    assert body["pools"]["prefill"] == {"desired": 1, "ready": 0, "starting": 0, "draining": 0}
    assert body["pools"]["decode"]["desired"] == 1 and body["proxy_url"] == "http://127.0.0.1:8000"


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": TOKEN}])
def test_requests_without_the_token_are_refused(client: TestClient, headers: dict[str, str]) -> None:
    assert client.get("/status", headers=headers).status_code == 401
    assert client.post("/scale", json={"decode": 2}, headers=headers).status_code == 401


def test_scale_sets_the_desired_sizes(client: TestClient, pools: PoolManager) -> None:
    r = client.post("/scale", json={"decode": 3}, headers=auth())
    assert r.status_code == 202 and r.json()["pools"]["decode"]["desired"] == 3
    assert pools.desired == {"prefill": 1, "decode": 3}


@pytest.mark.parametrize("body", [{}, {"decode": -1}, {"decode": "2"}, {"decode": True}, {"router": 1},
                                  [1, 2], {"prefill": 10_000}])
def test_scale_refuses_bad_bodies(client: TestClient, pools: PoolManager, body: object) -> None:
    r = client.post("/scale", json=body, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert pools.desired == {"prefill": 1, "decode": 1}


def test_a_node_is_placed_on_a_share_of_the_cpus_and_on_its_gpu_or_share_of_one() -> None:
    # one bundle per tensor-parallel rank; the engine has no tensor parallelism yet, so tp is 1 (see below)
    assert placement_bundles(1, gpus_per_rank=0.0, cpus_per_node=0.5) == [{"CPU": 0.5}]
    assert placement_bundles(1, gpus_per_rank=1.0, cpus_per_node=0.5) == [{"CPU": 0.5, "GPU": 1.0}]
    assert placement_bundles(1, gpus_per_rank=0.5, cpus_per_node=1.0) == [{"CPU": 1.0, "GPU": 0.5}]
    assert placement_bundles(2, gpus_per_rank=1.0, cpus_per_node=1.0) == [{"CPU": 0.5, "GPU": 1.0}] * 2


@pytest.mark.parametrize(("gpus", "node_gpus", "room"), [(1, 1.0, 1), (1, 0.5, 2), (8, 1.0, 8), (2, 0.25, 8)])
def test_gpu_nodes_fit_as_many_as_the_gpus_hold(gpus: int, node_gpus: float, room: int) -> None:
    launch = NodeLaunch(model="/m", registry_url="redis://127.0.0.1:1/0", cpus_per_node=0.5,
                        gpus_per_rank=node_gpus)
    pools = PoolManager(launch, {"prefill": 0, "decode": 0}, resources=lambda: {"CPU": 64.0, "GPU": float(gpus)})
    assert pools.room() == room  # gpus // node_gpus: the CPUs hold more
    with pytest.raises(ValueError, match=f"room for {room} .* GPU and 0.5 CPU each.*smaller --node-gpus"):
        pools.scale({"decode": room + 1})


def test_serve_refuses_a_tp_flag_in_node_args_naming_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--node-args", "--tp 2"]) == 2
    assert "tandem serve sets each node's --tp itself: use its --tp, --prefill-tp or --decode-tp" in (
        capsys.readouterr().err)


@pytest.mark.parametrize(("cpus", "node_cpus", "room"), [(2, 0.5, 4), (64, 0.5, 128), (3, 1.0, 3), (8, 3.0, 2)])
def test_scale_refuses_more_nodes_than_the_machine_has_room_for(cpus: int, node_cpus: float, room: int) -> None:
    launch = NodeLaunch(model="/m", registry_url="redis://127.0.0.1:1/0", cpus_per_node=node_cpus)
    pools = PoolManager(launch, {"prefill": 1, "decode": 0}, resources=lambda: {"CPU": float(cpus)})
    assert pools.room() == room  # cpus // node_cpus
    pools.scale({"decode": room - 1})
    with pytest.raises(ValueError, match=f"{room + 1} nodes do not fit on this machine: it has room for {room}"):
        pools.scale({"decode": room})
    assert pools.desired == {"prefill": 1, "decode": room - 1}


def test_the_state_file_is_private_and_removed_only_by_its_writer(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    state = ClusterState(admin_url="http://127.0.0.1:1", token=TOKEN, proxy_url="http://127.0.0.1:8000", pid=42)
    path = write_state(state)
    assert path == state_path() == tmp_path / "cluster.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_state() == state
    remove_state(pid=43)
    assert read_state() == state
    remove_state(pid=42)
    assert read_state() is None


def test_the_cli_says_when_there_is_no_local_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_ADMIN_URL", raising=False)
    assert cli.main(["status"]) == 2
    assert "no local cluster" in capsys.readouterr().err
    assert cli.main(["scale"]) == 2
    assert "--prefill N and/or --decode M" in capsys.readouterr().err


def test_the_cli_ignores_a_state_file_left_by_a_process_that_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_ADMIN_URL", raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_state(ClusterState(admin_url="http://127.0.0.1:1", token=TOKEN, proxy_url="", pid=gone.pid))
    assert cli.main(["status", "--json"]) == 2
    assert "left over from process" in capsys.readouterr().err


def test_a_client_api_key_does_not_grant_admin_and_refusals_carry_the_envelope(pools: PoolManager) -> None:
    from proxy.api.auth import APIKeys

    client = TestClient(create_admin_app(pools, TOKEN, client_keys=APIKeys(["sk-client"])))
    for method, path in (("GET", "/status"), ("POST", "/scale")):
        forbidden = client.request(method, path, json={"decode": 5}, headers=auth("sk-client"))
        assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
        wrong = client.request(method, path, json={"decode": 5}, headers=auth("sk-other"))
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}
        assert wrong.json()["error"]["code"] == "invalid_admin_token"
    assert pools.desired == {"prefill": 1, "decode": 1}  # nothing scaled


def test_tandem_serve_gives_the_proxy_its_key_file_and_tls_and_refuses_an_admin_token_that_is_a_client_key(
        tmp_path: Path) -> None:
    from cluster.serve import ServeError, _client_keys, admin_token, proxy_command
    from settings import TREE_KEYS, ServeConfig, resolve

    keys = tmp_path / "keys"
    keys.write_text("# team a\nsk-a\n\nsk-b\n")
    config = resolve(ServeConfig, {"api_key": "sk-main", "api_key_file": str(keys), "node_tls_ca": "ca.pem",
                                   "node_tls_cert": "c.pem", "node_tls_key": "k.pem", "tls_cert": "s.pem",
                                   "tls_key": "sk.pem"}, {}, TREE_KEYS)
    command = proxy_command(config, Path("/m"), "tiny", "redis://127.0.0.1:1/0")
    assert command[command.index("--api-key-file") + 1] == str(keys)
    # the client side only: the proxy serves no gRPC; relative paths are made absolute (Ray workers start elsewhere)
    assert command[command.index("--node-tls-ca") + 1] == str(Path.cwd() / "ca.pem")
    assert "--node-tls-key" in command and "--tls-cert" not in command
    assert "sk-main" not in command  # the key travels in the environment
    client_keys = _client_keys(config)
    assert all(client_keys.matches(k) for k in ("sk-main", "sk-a", "sk-b")) and not client_keys.matches("# team a")
    with pytest.raises(ServeError, match="must not grant admin"):
        admin_token("sk-b", client_keys)
    assert admin_token("admin-secret", client_keys) == "admin-secret"
    assert not client_keys.matches(admin_token(None, client_keys))  # a random one

