"""Transitional: the old name of node_common/registrar.py, kept only so the two modules that import it on other
branches (node_common/options.py: add_registry_args; cluster/pools.py: node_key) keep working until they
import `node_common.registrar` and `wire` instead. Delete it then; import nothing new from here."""

from __future__ import annotations

from node_common.registrar import add_registry_args
from wire import node_key

__all__ = ["add_registry_args", "node_key"]
