"""A real decode node whose KV connector injects transfer faults (tests/reliability/faults.py): the test-only entry
point that installs the wrapper, so that no production code reads a test setting.

    python -m tests.reliability.faulty_node --fault-plan PLAN.json <the flags of python -m decode_node>

Everything else is the production decode node: its engine, loop, service, checksums and gRPC server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import decode_node.__main__ as decode_main
from kvtransfer.base import Connector, KVRegion
from tests.reliability.faults import FaultyConnector


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fault-plan", type=Path, required=True)
    ours, node_argv = parser.parse_known_args()
    open_connector = decode_main.open_connector

    def open_faulty_connector(*args: Any, **kwargs: Any) -> tuple[Connector, KVRegion, bytes]:
        connector, region, metadata = open_connector(*args, **kwargs)
        return FaultyConnector(connector, ours.fault_plan, region), region, metadata

    decode_main.open_connector = open_faulty_connector
    sys.argv = [sys.argv[0], *node_argv]
    decode_main.main()


if __name__ == "__main__":
    main()
