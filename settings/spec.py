"""How a setting is declared, and the four layers it is read from: CLI flag > YAML `--config` > `TANDEM_*` env >
default.

A group of settings is a frozen dataclass whose fields are made with `setting(...)`; a field whose type is another
such dataclass is a nested group (flattened: its settings keep their own names). From one declaration come the
flag (`block_size` is `--block-size`), the env var (`TANDEM_BLOCK_SIZE`), the YAML key (`block_size:` or
`block-size:`), the validation and the typed value, so every process that takes a setting parses it alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

ENV_PREFIX = "TANDEM_"
CONFIG_ENV_VAR = f"{ENV_PREFIX}CONFIG"
G = TypeVar("G")


class ConfigError(ValueError):
    """A setting with a bad value, an unknown YAML key, an unreadable config file."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type  # int, float, str or bool (a flag that takes no value: given is true)
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


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, minimum: float | None = None,
            metavar: str | None = None) -> Any:
    """A settings-group field; its type annotation gives the kind (`int`, `float`, `str`, or `X | None`)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": tuple(choices) if choices is not None else None, "minimum": minimum,
        "metavar": metavar})


def group(default_factory: Any) -> Any:
    """A nested settings group field (`cluster: ClusterSettings = group(ClusterSettings)`)."""
    return dataclasses.field(default_factory=default_factory)


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings of a group, nested groups flattened, in declaration order."""
    if cls not in _SETTINGS_OF:
        found = tuple(_walk(cls))
        names = [s.name for s in found]
        assert len(set(names)) == len(names), f"{cls.__name__}: a setting name is declared twice in {names}"
        _SETTINGS_OF[cls] = found
    return _SETTINGS_OF[cls]


_SETTINGS_OF: dict[type, tuple[Setting, ...]] = {}


def _walk(cls: type) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield from settings_of(kind)
            continue
        if isinstance(kind, types.UnionType):  # `int | None`: None means "not set" (a computed default)
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        assert kind in (int, float, str, bool), f"{cls.__name__}.{f.name}: a setting is an int, float, str or bool"
        yield Setting(f.name, kind, f.default, f.metadata["help"], f.metadata["choices"], f.metadata["minimum"],
                      f.metadata["metavar"])


def build(cls: type[G], values: Mapping[str, Any]) -> G:
    """An instance of the group `cls` from flat values (missing ones take their defaults)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flatten(instance: Any) -> dict[str, Any]:
    """The group's values by setting name (the inverse of `build`)."""
    return {s.name: _lookup(instance, s.name) for s in settings_of(type(instance))}


def _lookup(instance: Any, name: str) -> Any:
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if f.name == name:
            return value
        if dataclasses.is_dataclass(value):
            try:
                return _lookup(value, name)
            except KeyError:
                continue
    raise KeyError(name)


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, config_flag: bool = True) -> None:
    """The group's flags (and `--config`). They default to None, so `resolve` tells a given flag from one left out;
    the help shows the env var and the default."""
    if config_flag:
        parser.add_argument("--config", default=None, metavar="FILE",
                            help=f"YAML file of settings (or ${CONFIG_ENV_VAR}); flags beat it, it beats env vars")
    for s in settings_of(cls):
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.name, default=None, action="store_const", const=True,
                                help=f"{s.help} [{s.env_var}=1]")
            continue
        default = "" if s.default in (None, "") else f", default {s.default}"
        parser.add_argument(s.flag, dest=s.name, default=None, help=f"{s.help} [{s.env_var}{default}]",
                            type=s.kind, choices=s.choices, metavar=s.metavar)


def resolve(cls: type[G], cli: Mapping[str, Any], env: Mapping[str, str], known: frozenset[str] | None = None) -> G:
    """Merges the four layers into the group `cls`. `cli` holds the parsed flags (None when not given) and maybe
    `config`; `known` is every key a config file may hold (the whole tree's settings, some for other processes)."""
    group_settings = settings_of(cls)
    values: dict[str, Any] = {s.name: s.default for s in group_settings}
    for s in group_settings:
        if env.get(s.env_var, "") != "":
            values[s.name] = _convert(s, env[s.env_var], f"${s.env_var}")
    config_path = cli.get("config") or env.get(CONFIG_ENV_VAR)
    if config_path:
        from_file = load_yaml(Path(config_path), group_settings, known)
        values.update(from_file)
    for s in group_settings:
        if cli.get(s.name) is not None:
            values[s.name] = _convert(s, cli[s.name], s.flag)
    return build(cls, values)


def load_yaml(path: Path, group_settings: Sequence[Setting], known: frozenset[str] | None = None) -> dict[str, Any]:
    """The file's values for `group_settings`; keys in `known` but not in the group are someone else's."""
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
    by_name = {s.name: s for s in group_settings}
    known = (known or frozenset()) | frozenset(by_name)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
        if value is None or name not in by_name:
            continue  # `key:` with no value leaves the setting to the env var or the default
        if name.endswith("_args") and isinstance(value, Sequence) and not isinstance(value, str):
            value = shlex.join(str(v) for v in value)  # extra flags may be a YAML list
        values[name] = _convert(by_name[name], value, f"{path}: {key}")
    return values


def to_args(instance: Any) -> list[str]:
    """The flags that hand a resolved group to another process (settings left unset are left out)."""
    return [item for s in settings_of(type(instance)) if (value := _lookup(instance, s.name)) is not None
            for item in ((s.flag,) if value is True else () if value is False else (s.flag, str(value)))]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _convert(setting: Setting, value: Any, where: str) -> Any:
    if setting.kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
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
