"""The configuration tree (settings/): CLI flag > YAML --config > TANDEM_* env var > default, with clear errors;
each cluster-wide setting declared once and handed by `tandem serve` to nodes and proxy as the flags they parse."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from cluster.pools import NodeLaunch, node_command, node_environment
from engine.config import EngineConfig
from node_common.options import add_node_args, engine_config, parse_node_args
from settings import TREE_KEYS, ConfigError, HashingSettings, ServeConfig, add_arguments, resolve, to_args
from settings.spec import flatten


def parse(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServeConfig)
    return vars(parser.parse_args(list(argv)))


def serve_config(*argv: str, env: dict[str, str] | None = None) -> ServeConfig:
    return resolve(ServeConfig, parse(*argv), env or {}, TREE_KEYS)


def node_args(*argv: str) -> argparse.Namespace:
    """A node's flags as `python -m prefill_node/decode_node` parses them (the environment included)."""
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parse_node_args(parser, ["--model", "/m", "--port", "1", *argv])


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tandem.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_one_prefill_one_decode_and_the_proxy_on_localhost_8000() -> None:
    config = serve_config()
    assert config == ServeConfig()
    assert (config.prefill_nodes, config.decode_nodes, config.host, config.port) == (1, 1, "127.0.0.1", 8000)
    assert config.model is None  # the demo model


def test_env_beats_default(tmp_path: Path) -> None:
    config = serve_config(env={"TANDEM_DECODE_NODES": "3", "TANDEM_KV_BACKEND": "mooncake",
                                   "TANDEM_NODE_CPUS": "0.25"})
    assert (config.decode_nodes, config.cluster.kv_backend, config.node_cpus) == (3, "mooncake", 0.25)


def test_yaml_beats_env_and_cli_beats_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode_nodes: 2\nprefill-nodes: 4\nport: 9000\nmodel: /models/a\n")
    env = {"TANDEM_DECODE_NODES": "3", "TANDEM_PORT": "7000", "TANDEM_DTYPE": "bfloat16"}
    config = serve_config("--config", path, "--prefill-nodes", "5", env=env)
    assert config.prefill_nodes == 5  # CLI over YAML
    assert config.decode_nodes == 2 and config.port == 9000 and config.model == "/models/a"  # YAML over env
    assert config.cluster.dtype == "bfloat16"  # env over default
    assert config.tp == 1  # default


def test_the_config_file_may_come_from_the_environment(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode_nodes: 2\n")
    assert serve_config(env={"TANDEM_CONFIG": path}).decode_nodes == 2
    assert serve_config("--decode-nodes", "4", env={"TANDEM_CONFIG": path}).decode_nodes == 4


def test_extra_flags_may_be_a_yaml_list(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "node_args: ['--num-kv-blocks', 64]\nproxy_args: [--routing, round_robin]\n")
    config = serve_config("--config", path, env={})
    assert config.node_args == "--num-kv-blocks 64" and config.proxy_args == "--routing round_robin"


def test_a_yaml_key_without_a_value_leaves_the_setting_to_env_and_default(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port:\ndecode_nodes:\n")
    config = serve_config("--config", path, env={"TANDEM_DECODE_NODES": "2"})
    assert config.port == 8000 and config.decode_nodes == 2


@pytest.mark.parametrize(("text", "message"), [
    ("decode_nodez: 2\n", "unknown setting 'decode_nodez'"),
    ("decode_nodes: two\n", "decode_nodes: expected int"),
    ("decode_nodes: 1.5\n", "decode_nodes: expected int"),
    ("kv_backend: ucx\n", "must be one of nixl, mooncake, ipc, auto"),
    ("kv_cross_host_backend: ipc\n", "must be one of nixl, mooncake"),
    ("tp: 0\n", "must be at least 1"),
    ("- a list\n", "must hold a mapping"),
    ("port: [1\n", "not valid YAML"),
])
def test_bad_yaml_settings_are_refused_with_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve_config("--config", write_yaml(tmp_path, text))


def test_bad_env_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"\$TANDEM_PORT: expected int"):
        serve_config(env={"TANDEM_PORT": "eighty"})
    with pytest.raises(ConfigError, match="TANDEM_DECODE_NODES: must be at least 0"):
        serve_config(env={"TANDEM_DECODE_NODES": "-1"})


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        serve_config("--config", str(tmp_path / "nope.yaml"))


def test_an_empty_env_var_counts_as_unset() -> None:
    assert serve_config(env={"TANDEM_PORT": ""}).port == 8000


def test_node_flag_defaults_equal_the_offline_llm_defaults() -> None:
    # LLM(model, **engine_args) builds EngineConfig(model, **engine_args): its defaults are EngineConfig's
    import dataclasses

    offline = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    args = node_args()
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "dtype", "seed"):
        assert getattr(args, name) == offline[name], name
    assert args.max_num_seqs == 128  # was 64 on nodes
    config = engine_config(args)
    assert (config.load_format, config.enforce_eager) == (offline["load_format"], offline["enforce_eager"])
    assert config.async_scheduling is offline["async_scheduling"] is None  # the engine picks by device


def test_node_async_scheduling_flag_reaches_the_engine_config() -> None:
    assert engine_config(node_args("--async-scheduling")).async_scheduling is True
    assert engine_config(node_args("--no-async-scheduling")).async_scheduling is False


def test_node_load_format_and_enforce_eager_reach_the_engine_config() -> None:
    config = engine_config(node_args("--load-format", "dummy", "--enforce-eager"))
    assert (config.load_format, config.enforce_eager) == ("dummy", True)
    with pytest.raises(SystemExit):  # argparse refuses a format the engine does not know
        node_args("--load-format", "pt")


CHOSEN = ["--block-size", "8", "--hash-seed", "s1", "--kv-backend", "mooncake", "--dtype", "bfloat16",
          "--drain-timeout", "7", "--ucx-devices", "mlx5_0:1", "--mooncake-protocol", "rdma"]


def test_serve_hands_every_cluster_setting_to_the_nodes_as_the_flags_they_parse() -> None:
    config = serve_config(*CHOSEN)
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.node_settings(on_one_machine=False))
    command = node_command(launch, "decode", "decode-0", "127.0.0.1", 1234)
    assert command[1:3] == ["-m", "decode_node"]
    node = node_args(*command[3:])
    assert node.cluster == config.cluster
    assert (node.block_size, node.hash_seed, node.kv_backend, node.dtype, node.drain_timeout, node.ucx_devices,
            node.mooncake_protocol) == (8, "s1", "mooncake", "bfloat16", 7.0, "mlx5_0:1", "rdma")


def test_serve_hands_the_nodes_block_size_and_hash_seed_to_the_proxy() -> None:
    from cluster.serve import proxy_command
    from proxy.__main__ import parse_args

    config = serve_config("--block-size", "8", "--hash-seed", "s1", "--proxy-args", "--routing round_robin")
    command = proxy_command(config, Path("/m"), "tiny", "redis://127.0.0.1:1/0")
    assert command[1:3] == ["-m", "proxy"]
    _, proxy = parse_args(command[3:])
    assert proxy.hashing == config.cluster.hashing == HashingSettings(block_size=8, hash_seed="s1")
    assert (proxy.block_size, proxy.hash_seed, proxy.routing) == (8, "s1", "round_robin")


def test_serve_hands_the_tool_call_and_reasoning_parsers_to_the_proxy_under_vllms_flag_names() -> None:
    from cluster.serve import proxy_command
    from proxy.__main__ import parse_args
    from settings.chat import ChatSettings

    config = serve_config("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    _, proxy = parse_args(proxy_command(config, Path("/m"), "tiny", "redis://127.0.0.1:1/0")[3:])
    assert proxy.chat == config.chat == ChatSettings(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                                     reasoning_parser="qwen3")
    _, plain = parse_args(proxy_command(serve_config(), Path("/m"), "tiny", "redis://127.0.0.1:1/0")[3:])
    assert plain.chat == ChatSettings()
    with pytest.raises(ConfigError, match="needs --tool-call-parser"):  # as vLLM refuses it
        serve_config("--enable-auto-tool-choice")


def test_the_drain_timeout_of_the_pool_and_of_its_nodes_is_one_setting() -> None:
    from cluster.pools import PoolManager

    config = serve_config("--drain-timeout", "7")
    launch = NodeLaunch(model="/m", registry_url="redis://127.0.0.1:1/0", cluster=config.cluster)
    pools = PoolManager(launch, {"prefill": 0, "decode": 0})
    node = node_args(*node_command(launch, "prefill", "p-0", "127.0.0.1", 1)[3:])
    assert pools.drain_timeout_s == node.cluster.drain_timeout == 7.0


@pytest.mark.parametrize("extra", ["--node-args=--block-size 8", "--node-args=--num-kv-blocks 4 --hash-seed=x",
                                   "--proxy-args=--block-size 8"])
def test_a_cluster_setting_given_as_an_extra_flag_is_refused(extra: str) -> None:
    with pytest.raises(ConfigError, match="is a cluster-wide setting: give it to tandem serve itself"):
        serve_config(extra)


def test_one_config_file_configures_serve_its_nodes_and_its_proxy(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, "decode_nodes: 2\nblock_size: 8\nkv-backend: mooncake\nport: 9000\n")
    assert serve_config("--config", path).cluster.hashing.block_size == 8
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")
    monkeypatch.setenv("TANDEM_DTYPE", "bfloat16")
    node = node_args("--config", path)  # the serve-only keys (decode_nodes, port) are someone else's
    assert (node.block_size, node.kv_backend, node.dtype, node.port) == (8, "mooncake", "bfloat16", 1)
    assert node_args("--config", path, "--block-size", "4").block_size == 4
    monkeypatch.setenv("TANDEM_CONFIG", write_yaml(tmp_path, "block_sise: 8\n"))
    with pytest.raises(SystemExit):  # a typo is refused by a node as by tandem serve
        node_args()


def test_a_single_machine_cluster_runs_ucx_on_loopback_a_ray_cluster_leaves_ucx_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UCX_MODULES", "UCX_NET_DEVICES", "UCX_TLS"):
        monkeypatch.delenv(name, raising=False)
    config = serve_config()

    def launched(on_one_machine: bool, config: ServeConfig = config) -> tuple[list[str], dict[str, str]]:
        launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.node_settings(on_one_machine),
                            environment=config.node_environment(on_one_machine), bind_loopback=on_one_machine)
        return node_command(launch, "decode", "d-0", "127.0.0.1", 1), node_environment(launch)

    command, env = launched(on_one_machine=True)
    assert node_args(*command[3:]).ucx_devices == "lo" and env["UCX_MODULES"] == "^ib"
    command, env = launched(on_one_machine=False)  # InfiniBand stays on: UCX picks the NICs
    assert "--ucx-devices" not in command and node_args(*command[3:]).ucx_devices is None
    assert not {name for name in env if name.startswith("UCX_")}
    chosen = serve_config("--ucx-devices", "mlx5_0:1", "--transport-env", "UCX_TLS=rc,sm MC_TRANSFER_TIMEOUT=60")
    command, env = launched(on_one_machine=True, config=chosen)  # the user's choice beats the single-box default
    assert node_args(*command[3:]).ucx_devices == "mlx5_0:1"
    assert (env["UCX_TLS"], env["MC_TRANSFER_TIMEOUT"]) == ("rc,sm", "60") and "UCX_MODULES" not in env


def test_a_bad_transport_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected NAME=VALUE"):
        serve_config("--transport-env", "UCX_TLS")


def test_ucx_settings_reach_every_node_and_its_nixl_connector() -> None:
    ucx = "CUDA_IPC_ENABLE_GET_ZCOPY=y,PROTO_EMULATION_ENABLE=n"
    config = serve_config("--ucx-config", ucx)
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.node_settings(on_one_machine=True))
    node = node_args(*node_command(launch, "decode", "d-0", "127.0.0.1", 1)[3:])
    assert node.ucx_config == ucx
    assert node.cluster.transport.connector_options("nixl") == {"ucx_devices": "lo", "ucx_config": ucx}
    assert node.cluster.transport.connector_options("mooncake") == {"protocol": "tcp"}
    assert "ucx_config" not in serve_config().cluster.transport.connector_options("nixl")


@pytest.mark.parametrize(("value", "message"), [
    ("TLS=cuda_ipc,cuda_copy", "a value cannot hold one .*--transport-env"),
    ("tls=tcp", "'tls' is not a UCX setting name"),
])
def test_malformed_ucx_settings_are_refused_wherever_they_come_from(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"ucx_config .*{message}"):
        serve_config("--ucx-config", value)
    with pytest.raises(ConfigError, match=message):
        serve_config(env={"TANDEM_UCX_CONFIG": value})
    with pytest.raises(SystemExit):  # a node refuses it as a usage error
        node_args("--ucx-config", value)


def test_mooncake_nvlink_intra_nodes_start_with_the_variable_that_installs_it() -> None:
    # Mooncake reads MC_INTRANODE_NVLINK from the environment only, and any value (even "0") turns it on
    intra = serve_config("--kv-backend", "mooncake", "--mooncake-protocol", "nvlink_intra")
    assert intra.node_environment(on_one_machine=True) == {"MC_INTRANODE_NVLINK": "1", "UCX_MODULES": "^ib"}
    assert intra.node_environment(on_one_machine=False) == {"MC_INTRANODE_NVLINK": "1"}
    assert node_args(*to_args(intra.cluster)).mooncake_protocol == "nvlink_intra"
    for other in (serve_config("--kv-backend", "mooncake"), serve_config("--mooncake-protocol", "nvlink_intra")):
        assert "MC_INTRANODE_NVLINK" not in other.node_environment(on_one_machine=True)  # tcp, or NIXL's nodes
    chosen = serve_config("--kv-backend", "mooncake", "--mooncake-protocol", "nvlink_intra", "--transport-env",
                          "MC_INTRANODE_NVLINK=yes MC_TRANSFER_TIMEOUT=60")
    assert chosen.node_environment(on_one_machine=False) == {"MC_INTRANODE_NVLINK": "yes", "MC_TRANSFER_TIMEOUT": "60"}


def test_auto_nodes_get_their_cross_host_backends_options_and_environment() -> None:
    config = serve_config("--kv-backend", "auto", "--ucx-config", "PROTO_EMULATION_ENABLE=n")
    assert config.cluster.kv_backend == "auto" and config.cluster.transport.kv_cross_host_backend == "nixl"
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.node_settings(on_one_machine=True))
    node = node_args(*node_command(launch, "decode", "d-0", "127.0.0.1", 1)[3:])
    assert node.kv_backend == "auto"
    assert node.cluster.transport.connector_options("auto") == {
        "cross_host": "nixl", "ucx_devices": "lo", "ucx_config": "PROTO_EMULATION_ENABLE=n"}
    assert config.node_environment(on_one_machine=False) == {}
    # Mooncake across hosts, over nvlink_intra: its nodes need the variable that installs that transport
    mooncake = serve_config("--kv-backend", "auto", "--kv-cross-host-backend", "mooncake", "--mooncake-protocol",
                            "nvlink_intra")
    node = node_args(*to_args(mooncake.cluster))
    assert (node.kv_backend, node.kv_cross_host_backend) == ("auto", "mooncake")
    assert node.cluster.transport.connector_options("auto") == {"cross_host": "mooncake", "protocol": "nvlink_intra"}
    assert mooncake.node_environment(on_one_machine=False) == {"MC_INTRANODE_NVLINK": "1"}
    env = serve_config(env={"TANDEM_KV_BACKEND": "auto", "TANDEM_KV_CROSS_HOST_BACKEND": "mooncake"})
    assert env.cluster.transport.connector_options("auto") == {"cross_host": "mooncake", "protocol": "tcp"}


def test_the_default_kv_backend_stays_nixl_and_the_backend_choices_are_the_connectors() -> None:
    from kvtransfer import BACKENDS
    from kvtransfer.same_host import CROSS_HOST_BACKENDS
    from settings.cluster import KV_BACKENDS, KV_CROSS_HOST_BACKENDS

    assert serve_config().cluster.kv_backend == "nixl"
    assert KV_BACKENDS == BACKENDS and KV_CROSS_HOST_BACKENDS == CROSS_HOST_BACKENDS


def test_the_mooncake_protocol_choices_are_the_connectors() -> None:
    from kvtransfer.mooncake import PROTOCOLS
    from settings.cluster import MOONCAKE_PROTOCOLS

    assert MOONCAKE_PROTOCOLS == PROTOCOLS


def test_settings_flatten_and_build_round_trip() -> None:
    config = serve_config(*CHOSEN, "--decode-nodes", "3")
    assert resolve(ServeConfig, flatten(config), {}, TREE_KEYS) == config
    assert to_args(config.cluster.hashing) == ["--block-size", "8", "--hash-seed", "s1"]


def test_the_settings_package_imports_no_torch_and_no_serving_package() -> None:
    import subprocess
    import sys

    code = ("import sys, settings, settings.env; "
            "bad = {'torch', 'ray', 'redis', 'grpc', 'cluster', 'proxy', 'node_common', 'kvtransfer'} & "
            "{name.split('.')[0] for name in sys.modules}; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True)


def test_tandem_serve_hands_the_tls_settings_to_every_node_as_flags_the_node_parses() -> None:
    config = resolve(ServeConfig, {"tls_cert": "node.pem", "tls_key": "node.key", "tls_client_ca": "ca.pem",
                                   "node_tls_ca": "ca.pem", "node_tls_cert": "c.pem", "node_tls_key": "c.key",
                                   "node_tls_server_name": "tandem-node"}, {}, TREE_KEYS)
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.node_settings(on_one_machine=True))
    command = node_command(launch, "decode", "decode-0", "127.0.0.1", 1234)
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    tls = parse_node_args(parser, command[3:]).cluster.tls
    assert tls == config.cluster.tls
    assert tls.server.tls_client_ca == str(Path.cwd() / "ca.pem") and tls.client.node_tls_server_name == "tandem-node"
