"""Moves KV blocks between nodes. Knows block ids and memory regions, never models or schedulers.

    connector = make_connector("nixl", layout=KVLayout(...))      # or "mooncake", "ipc" (one host), "auto"
    metadata = connector.register(KVRegion.from_buffer(kv_cache))  # send it to peers (in a KV ticket)
    peer = connector.add_peer(peer_metadata)
    handle = connector.read(peer, remote_block_ids, local_block_ids)
    connector.poll(handle)  # PENDING → DONE | FAILED

The contract is `kvtransfer.base.Connector`; backends are imported only when chosen:
    nixl      NIXL (UCX): any hosts; host or GPU memory
    mooncake  Mooncake transfer engine (tcp, rdma): any hosts; host or GPU memory
    ipc       same host only: process_vm_readv for host memory, CUDA IPC (through torch) for GPU memory
    auto      per peer: ipc for a peer on this host (and namespaces), nixl (or mooncake) for the others; reads
              from and is read by plain nixl/mooncake/ipc nodes too (kvtransfer/same_host.py)
"""

from __future__ import annotations

from typing import Any

from kvtransfer.base import Connector, KVRegion, MemoryKind, PeerId, TransferHandle, TransferStatus
from kvtransfer.checksum import kv_block_checksums, kv_checksum
from kvtransfer.errors import (
    BackendError,
    ConnectorClosedError,
    IncompatiblePeerError,
    InvalidDescriptorError,
    InvalidMetadataError,
    InvalidRequestError,
    PeerDisconnectedError,
    TransferError,
    UnknownPeerError,
    UnknownTransferError,
)
from kvtransfer.handshake import CONNECTOR_VERSION, KVLayout, layout_hash

BACKENDS = ("nixl", "mooncake", "ipc", "auto")

__all__ = [
    "BACKENDS", "CONNECTOR_VERSION", "BackendError", "Connector", "ConnectorClosedError", "IncompatiblePeerError",
    "InvalidDescriptorError", "InvalidMetadataError", "InvalidRequestError", "KVLayout", "KVRegion", "MemoryKind",
    "PeerDisconnectedError", "PeerId", "TransferError", "TransferHandle", "TransferStatus", "UnknownPeerError",
    "UnknownTransferError", "kv_block_checksums", "kv_checksum", "layout_hash", "make_connector",
]


def make_connector(name: str, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                   host: str = "127.0.0.1", **backend_options: Any) -> Connector:
    """A connector of backend `name` ("nixl", "mooncake", "ipc" or "auto"). `host` is the address peers reach this
    node on (Mooncake's RPC address; NIXL's UCX picks its devices from `ucx_devices`; ipc peers are on this host).
    `backend_options` go to the backend (NIXL: `ucx_devices="lo"`, `ucx_config="KEY=VALUE,..."`; Mooncake:
    `protocol="tcp"|"rdma"|"nvlink_intra"`; ipc: `read_threads=2`).

    "auto" takes `cross_host="nixl"|"mooncake"` (default nixl) and `ipc_options={...}` (the ipc backend's, e.g.
    `{"read_threads": 4}`); every other option goes to the cross-host backend, as it would to
    `make_connector(cross_host, ...)`. Both inner connectors share the agent name, layout and read timeout."""
    if name == "nixl":
        from kvtransfer.nixl import NixlConnector

        return NixlConnector(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s, **backend_options)
    if name == "mooncake":
        from kvtransfer.mooncake import MooncakeConnector

        return MooncakeConnector(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s, host=host,
                                 **backend_options)
    if name == "ipc":
        from kvtransfer.ipc import IpcConnector

        return IpcConnector(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s, **backend_options)
    if name == "auto":
        from kvtransfer.same_host import open_auto_connector

        return open_auto_connector(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s, host=host,
                                   **backend_options)
    raise InvalidRequestError(f"unknown KV transfer backend {name!r} (known: {', '.join(BACKENDS)})")
