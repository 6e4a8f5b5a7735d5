"""Tandem's configuration tree: every setting declared once, read from CLI flag > YAML `--config` > `TANDEM_*` env >
default, and handed down by whoever starts a process.

    settings/spec.py     how a setting is declared and resolved (flags, env vars, YAML keys derive from its name)
    settings/cluster.py  the cluster-wide settings every node takes (block size, hash seed, KV backend, dtype,
                         drain timeout, transport), the proxy taking the hashing ones
    settings/serve.py    `tandem serve`'s own settings, with the cluster's nested
    settings/env.py      the one module that reads environment variables
"""

from __future__ import annotations

from settings.cluster import ClusterSettings, HashingSettings, TransportSettings
from settings.serve import ServeConfig
from settings.spec import ConfigError, Setting, add_arguments, resolve, settings_of, to_args

# Every key a config file may hold: one file can configure `tandem serve`, its nodes and its proxy.
TREE_KEYS = frozenset(s.name for s in settings_of(ServeConfig))

__all__ = ["TREE_KEYS", "ClusterSettings", "ConfigError", "HashingSettings", "ServeConfig", "Setting",
           "TransportSettings", "add_arguments", "resolve", "settings_of", "to_args"]
