"""Tandem's configuration tree: every setting declared once, read from CLI flag > YAML `--config` > `TANDEM_*` env >
default, and handed down by whoever starts a process.

    settings/spec.py     how a setting is declared and resolved (flags, env vars, YAML keys derive from its name)
    settings/cluster.py  the cluster-wide settings every node takes (block size, hash seed, KV backend, dtype,
                         drain timeout, transport), the proxy taking the hashing ones
    settings/serve.py    `tandem serve`'s own settings, with the cluster's nested
    settings/env.py      the one module that reads environment variables
"""

from __future__ import annotations

import argparse
from typing import TypeVar

from settings import env
from settings.cluster import ClusterSettings, HashingSettings, TransportSettings
from settings.serve import ServeConfig
from settings.spec import ConfigError, Setting, add_arguments, flatten, resolve, settings_of, to_args

# Every key a config file may hold: one file can configure `tandem serve`, its nodes and its proxy.
TREE_KEYS = frozenset(s.name for s in settings_of(ServeConfig))

G = TypeVar("G")


def parse_args_with(parser: argparse.ArgumentParser, cls: type[G], argv: list[str] | None = None
                    ) -> tuple[argparse.Namespace, G]:
    """Parses a process's flags and resolves the settings group `cls` over its four layers (a bad value is a
    usage error); each setting is also set as `args.<name>`."""
    args = parser.parse_args(argv)
    try:
        group = resolve(cls, vars(args), env.settings_layer(), TREE_KEYS)
    except ConfigError as e:
        parser.error(str(e))
    vars(args).update(flatten(group))
    return args, group


__all__ = ["TREE_KEYS", "ClusterSettings", "ConfigError", "HashingSettings", "ServeConfig", "Setting",
           "TransportSettings", "add_arguments", "parse_args_with", "resolve", "settings_of", "to_args"]
