"""Moves KV blocks between nodes. Knows block ids and memory regions, never models or schedulers.

    connector = make_connector("nixl", layout=KVLayout(...))      # or "mooncake", or "ipc" (one host)
    metadata = connector.register(KVRegion.from_buffer(kv_cache))  # send it to peers (in a KV ticket)
    peer = connector.add_peer(peer_metadata)
    handle = connector.read(peer, remote_block_ids, local_block_ids)
    connector.poll(handle)  # PENDING → DONE | FAILED

The contract is `kvtransfer.base.Connector`; backends are imported only when chosen:
    nixl      NIXL (UCX): any hosts; host or GPU memory
    mooncake  Mooncake transfer engine (tcp, rdma): any hosts; host or GPU memory
    ipc       same host only: process_vm_readv for host memory, CUDA IPC (through torch) for GPU memory
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

BACKENDS = ("nixl", "mooncake", "ipc")

__all__ = [
    "BACKENDS", "CONNECTOR_VERSION", "BackendError", "Connector", "ConnectorClosedError", "IncompatiblePeerError",
    "InvalidDescriptorError", "InvalidMetadataError", "InvalidRequestError", "KVLayout", "KVRegion", "MemoryKind",
    "PeerDisconnectedError", "PeerId", "TransferError", "TransferHandle", "TransferStatus", "UnknownPeerError",
    "UnknownTransferError", "kv_block_checksums", "kv_checksum", "layout_hash", "make_connector",
]


def make_connector(name: str, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                   host: str = "127.0.0.1", **backend_options: Any) -> Connector:
    """A connector of backend `name` ("nixl", "mooncake" or "ipc"). `host` is the address peers reach this node on
    (Mooncake's RPC address; NIXL's UCX picks its devices from `ucx_devices`; ipc peers are on this host).
    `backend_options` go to the backend (NIXL: `ucx_devices="lo"`, `ucx_config="KEY=VALUE,..."`; Mooncake:
    `protocol="tcp"|"rdma"|"nvlink_intra"`; ipc: `read_threads=2`)."""
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
    raise InvalidRequestError(f"unknown KV transfer backend {name!r} (known: {', '.join(BACKENDS)})")
