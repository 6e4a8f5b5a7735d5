"""`tandem serve` settings: CLI flag > YAML --config > TANDEM_* env var > default, with clear errors."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from cluster.config import SETTINGS, ConfigError, ServeConfig, add_serve_args, resolve


def parse(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return vars(parser.parse_args(list(argv)))


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tandem.yaml"
    path.write_text(text)
    return str(path)


def test_settings_table_and_config_dataclass_agree() -> None:
    assert [f.name for f in dataclasses.fields(ServeConfig)] == [s.name for s in SETTINGS]
    assert all(getattr(ServeConfig(), s.name) == s.default for s in SETTINGS)


def test_defaults_are_one_prefill_one_decode_and_the_proxy_on_localhost_8000() -> None:
    config = resolve(parse(), env={})
    assert config == ServeConfig()
    assert (config.prefill_nodes, config.decode_nodes, config.host, config.port) == (1, 1, "127.0.0.1", 8000)
    assert config.model is None  # the demo model


def test_env_beats_default(tmp_path: Path) -> None:
    config = resolve(parse(), env={"TANDEM_DECODE_NODES": "3", "TANDEM_KV_BACKEND": "mooncake",
                                   "TANDEM_NODE_CPUS": "0.25"})
    assert (config.decode_nodes, config.kv_backend, config.node_cpus) == (3, "mooncake", 0.25)


def test_yaml_beats_env_and_cli_beats_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode_nodes: 2\nprefill-nodes: 4\nport: 9000\nmodel: /models/a\n")
    env = {"TANDEM_DECODE_NODES": "3", "TANDEM_PORT": "7000", "TANDEM_DTYPE": "bfloat16"}
    config = resolve(parse("--config", path, "--prefill-nodes", "5"), env=env)
    assert config.prefill_nodes == 5  # CLI over YAML
    assert config.decode_nodes == 2 and config.port == 9000 and config.model == "/models/a"  # YAML over env
    assert config.dtype == "bfloat16"  # env over default
    assert config.tp == 1  # default


def test_the_config_file_may_come_from_the_environment(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode_nodes: 2\n")
    assert resolve(parse(), env={"TANDEM_CONFIG": path}).decode_nodes == 2
    assert resolve(parse("--decode-nodes", "4"), env={"TANDEM_CONFIG": path}).decode_nodes == 4


def test_extra_flags_may_be_a_yaml_list(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "node_args: ['--num-kv-blocks', 64]\nproxy_args: [--routing, round_robin]\n")
    config = resolve(parse("--config", path), env={})
    assert config.node_args == "--num-kv-blocks 64" and config.proxy_args == "--routing round_robin"


def test_a_yaml_key_without_a_value_leaves_the_setting_to_env_and_default(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port:\ndecode_nodes:\n")
    config = resolve(parse("--config", path), env={"TANDEM_DECODE_NODES": "2"})
    assert config.port == 8000 and config.decode_nodes == 2


@pytest.mark.parametrize(("text", "message"), [
    ("decode_nodez: 2\n", "unknown setting 'decode_nodez'"),
    ("decode_nodes: two\n", "decode_nodes: expected int"),
    ("decode_nodes: 1.5\n", "decode_nodes: expected int"),
    ("kv_backend: ucx\n", "must be one of nixl, mooncake"),
    ("tp: 0\n", "must be at least 1"),
    ("- a list\n", "must hold a mapping"),
    ("port: [1\n", "not valid YAML"),
])
def test_bad_yaml_settings_are_refused_with_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(parse("--config", write_yaml(tmp_path, text)), env={})


def test_bad_env_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"\$TANDEM_PORT: expected int"):
        resolve(parse(), env={"TANDEM_PORT": "eighty"})
    with pytest.raises(ConfigError, match="TANDEM_DECODE_NODES: must be at least 0"):
        resolve(parse(), env={"TANDEM_DECODE_NODES": "-1"})


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        resolve(parse("--config", str(tmp_path / "nope.yaml")), env={})


def test_an_empty_env_var_counts_as_unset() -> None:
    assert resolve(parse(), env={"TANDEM_PORT": ""}).port == 8000
