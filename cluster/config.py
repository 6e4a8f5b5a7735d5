"""`tandem serve`'s settings, from four layers: CLI flag > YAML `--config` file > `TANDEM_*` env var > default.

Every setting is declared once, in `SETTINGS`: its flag, its env var and its YAML key derive from its name
(`prefill_nodes` is `--prefill-nodes`, `TANDEM_PREFILL_NODES` and `prefill_nodes:` or `prefill-nodes:`).
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "TANDEM_"


class ConfigError(ValueError):
    """A setting with a bad value, an unknown YAML key, an unreadable config file."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type  # int, float or str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, None, "Hugging Face model directory (default: the demo model, built on first use)",
            metavar="PATH"),
    Setting("served_model_name", str, None,
            "the model name clients send (default: the model folder's name; tandem-demo for the demo model)",
            metavar="NAME"),
    Setting("prefill_nodes", int, 1, "number of prefill nodes", minimum=0, metavar="N"),
    Setting("decode_nodes", int, 1, "number of decode nodes", minimum=0, metavar="M"),
    Setting("tp", int, 1, "tensor-parallel ranks per node (one placement bundle each)", minimum=1, metavar="N"),
    Setting("kv_backend", str, "nixl", "KV transfer library", choices=("nixl", "mooncake")),
    Setting("dtype", str, "auto", "model dtype", choices=("auto", "float32", "bfloat16")),
    Setting("host", str, "127.0.0.1", "address the proxy listens on", metavar="H"),
    Setting("port", int, 8000, "port the proxy listens on", minimum=1, metavar="P"),
    Setting("ray_address", str, "local", "Ray cluster to join ('local' starts one on this machine)", metavar="ADDR"),
    Setting("api_key", str, None, "clients must send 'Authorization: Bearer KEY' (default: no key)", metavar="KEY"),
    Setting("registry", str, None, "redis:// URL of the node registry (default: a redis-server started here)",
            metavar="URL"),
    Setting("admin_port", int, 0, "port of the admin API on 127.0.0.1 (0: any free port)", minimum=0,
            metavar="PORT"),
    Setting("node_cpus", float, 0.5, "CPUs reserved per node in its placement group (CPU machines)", minimum=0.0,
            metavar="CPUS"),
    Setting("node_args", str, "", "extra flags for every node process, e.g. '--num-kv-blocks 512'", metavar="FLAGS"),
    Setting("proxy_args", str, "", "extra flags for the proxy, e.g. '--routing round_robin'", metavar="FLAGS"),
    Setting("drain_timeout", float, 120.0, "seconds a removed node may take to finish its requests", minimum=1.0,
            metavar="SECONDS"),
    Setting("startup_timeout", float, 300.0, "seconds a node may take to be placed and start serving",
            minimum=1.0, metavar="SECONDS"),
)
_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    served_model_name: str | None = None
    prefill_nodes: int = 1
    decode_nodes: int = 1
    tp: int = 1
    kv_backend: str = "nixl"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    ray_address: str = "local"
    api_key: str | None = None
    registry: str | None = None
    admin_port: int = 0
    node_cpus: float = 0.5
    node_args: str = ""
    proxy_args: str = ""
    drain_timeout: float = 120.0
    startup_timeout: float = 300.0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags default to None, so `resolve` can tell a flag the user gave from one left out."""
    parser.add_argument("--config", default=None, help=f"YAML file of settings (or {ENV_PREFIX}CONFIG)")
    for s in SETTINGS:
        parser.add_argument(s.flag, dest=s.name, default=None, help=f"{s.help} [{s.env_var}]",
                            type=s.kind, choices=s.choices, metavar=s.metavar)


def resolve(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ServeConfig:
    """Merges the layers. `cli` holds the parsed flags (None for those not given) and maybe `config`."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {s.name: s.default for s in SETTINGS}
    for s in SETTINGS:
        if s.env_var in env and env[s.env_var] != "":
            values[s.name] = _convert(s, env[s.env_var], f"${s.env_var}")
    config_path = cli.get("config") or env.get(f"{ENV_PREFIX}CONFIG")
    if config_path:
        values.update(load_yaml(Path(config_path)))
    for s in SETTINGS:
        if cli.get(s.name) is not None:
            values[s.name] = _convert(s, cli[s.name], s.flag)
    return ServeConfig(**values)


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"the config file {path} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the config file {path} must hold a mapping of settings, not {type(raw).__name__}")
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in _BY_NAME:
            raise ConfigError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(_BY_NAME))}")
        if value is None:
            continue  # `key:` with no value leaves the setting to the env var or the default
        if name.endswith("_args") and isinstance(value, Sequence) and not isinstance(value, str):
            value = shlex.join(str(v) for v in value)  # extra flags may be a YAML list
        values[name] = _convert(_BY_NAME[name], value, f"{path}: {key}")
    return values


def _convert(setting: Setting, value: Any, where: str) -> Any:
    try:
        if setting.kind is int and isinstance(value, float | bool):
            raise ValueError(value)  # YAML's 1.5 or true is not a count
        converted = setting.kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {setting.kind.__name__}, got {value!r}") from None
    if setting.choices is not None and converted not in setting.choices:
        raise ConfigError(f"{where}: must be one of {', '.join(setting.choices)}, got {converted!r}")
    if setting.minimum is not None and converted < setting.minimum:
        raise ConfigError(f"{where}: must be at least {setting.minimum:g}, got {converted!r}")
    return converted

