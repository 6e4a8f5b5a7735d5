"""Backend "auto": the ipc backend for peers on this host, a cross-host backend (NIXL, or Mooncake) for the others.

An auto connector runs two connectors under one agent name: an `IpcConnector` (kvtransfer/ipc.py: process_vm_readv
for host pools, CUDA IPC for GPU pools; far faster between processes of one host) and the cross-host one, both with
the same layout and read timeout. It chooses per peer, in `add_peer`, and then routes every call about that peer to
the chosen one. The ipc connector is optional: where it cannot start (not Linux, no /proc: BackendError) or cannot
register a pool the cross-host one took (a GPU pool CUDA IPC cannot share), the auto connector runs the cross-host
one alone and says so in a warning; its metadata then offers no ipc part.

Metadata: an envelope of backend "auto" (handshake.PeerEnvelope: layout, region geometry) whose payload bundles the
inner connectors' own envelopes (handshake.encode_bundle: versioned and length-prefixed, never pickled). A plain
connector reads its backend's part (handshake.select_envelope), so auto and plain nodes pair both ways.

How a peer's path is chosen (once per peer and metadata; the choice and why are logged at INFO):

    auto envelope ── layout check ─┬─ ipc part, ipc here ── ipc.add_peer ─┬─ ok ──────────────────────────► ipc
                                   │                                      └─ IncompatiblePeerError: another host
                                   │                                         or namespace, another memory kind,
                                   │                                         not permitted, unreadable ipc part ─┐
                                   └─ no ipc part, or no ipc here ───────────────────────────────────────────────┴─►
                                                                   cross-host part ── cross_host.add_peer ──► cross
    plain ipc envelope ─────────────► ipc.add_peer          (its errors propagate: there is no other way)
    plain nixl|mooncake envelope ───► cross_host.add_peer   (a plain nixl or mooncake peer: it refuses a backend
                                                             it does not run)
Any other error of ipc.add_peer (the peer's process has exited, mapping its GPU pool failed) propagates as it is.

Ids. A peer is known by its agent name on both transports (the inner connectors share ours, and return the
peer's), so a notification's sender, which an inner connector names by agent name whichever transport carried it,
already is the PeerId `add_peer` returned for that peer, or the name of a sender never added here (the contract
allows those): no translation is needed. A transfer handle is the inner connector's handle with its id
interleaved, 2 * id for ipc and 2 * id + 1 for the cross-host connector: handles of the two never collide, and the
inner connector keeps answering for its transfers exactly as on its own (re-polls, forgetting, unknown handles).
Re-adding a peer follows the inner connectors: the same metadata returns the same peer at once; new metadata under
a known name replaces the peer (which may move it to the other transport).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.base import Connector, KVRegion, PeerId, TransferHandle, TransferStatus
from kvtransfer.common import default_agent_name
from kvtransfer.errors import (
    BackendError,
    ConnectorClosedError,
    IncompatiblePeerError,
    InvalidMetadataError,
    InvalidRequestError,
    UnknownPeerError,
    UnknownTransferError,
)
from kvtransfer.handshake import (
    AUTO_BACKEND,
    KVLayout,
    PeerEnvelope,
    check_compatible,
    decode_bundle,
    encode_bundle,
)

logger = logging.getLogger(__name__)

CROSS_HOST_BACKENDS = ("nixl", "mooncake")  # settings.cluster.KV_CROSS_HOST_BACKENDS offers the same
IPC = "ipc"


@dataclass(frozen=True)
class _Route:
    """The inner connector a peer was added to, and the metadata it was added with (to spot a re-registration)."""

    inner: Connector
    metadata: bytes


class AutoConnector(Connector):
    backend_name = AUTO_BACKEND

    def __init__(self, *, layout: KVLayout, cross_host: Connector, ipc: Connector | None,
                 ipc_unavailable: str | None = None) -> None:
        """Takes over two fresh connectors of one agent name (see `open_auto_connector`). `ipc` is None where the
        ipc backend cannot run here, `ipc_unavailable` then says why."""
        if cross_host.backend_name not in CROSS_HOST_BACKENDS:
            raise InvalidRequestError(f"the cross-host connector must be one of {list(CROSS_HOST_BACKENDS)}, got "
                                      f"{cross_host.backend_name!r}")
        assert ipc is None or (ipc.backend_name == IPC and ipc.agent_name == cross_host.agent_name), \
            "the inner connectors must be an ipc and a cross-host connector of one agent name"
        self.layout = layout
        self._cross_host = cross_host
        self._ipc = ipc
        self._ipc_unavailable = ipc_unavailable if ipc is None else None
        self._envelope: PeerEnvelope | None = None
        self._metadata: bytes | None = None
        self._routes: dict[PeerId, _Route] = {}
        self._closed = False

    # ---- what this connector is made of --------------------------------------------------------------------------

    @property
    def agent_name(self) -> PeerId:
        return self._cross_host.agent_name

    @property
    def cross_host_backend(self) -> str:
        return self._cross_host.backend_name

    @property
    def ipc_unavailable(self) -> str | None:
        """Why this connector runs without ipc (None when it has it)."""
        return self._ipc_unavailable

    @property
    def metadata(self) -> bytes:
        """The bytes `register` returned."""
        if self._metadata is None:
            raise InvalidRequestError("no KV region is registered yet")
        return self._metadata

    @property
    def peers(self) -> list[PeerId]:
        return list(self._routes)

    def chosen_backend(self, peer: PeerId) -> str:
        """The backend this connector reads `peer` with: "ipc", or the cross-host backend's name."""
        self._check_open()
        return self._route(peer).inner.backend_name

    # ---- the contract --------------------------------------------------------------------------------------------

    def register(self, region: KVRegion) -> bytes:
        self._check_open()
        if self._envelope is not None:
            raise InvalidRequestError("a KV region is already registered with this connector")
        parts = {self._cross_host.backend_name: self._cross_host.register(region)}
        if self._ipc is not None:
            try:
                parts = {IPC: self._ipc.register(region), **parts}
            except (BackendError, InvalidRequestError) as e:  # e.g. a GPU pool CUDA IPC cannot share
                self._drop_ipc(f"registering the KV pool with it failed: {e}")
        self._envelope = PeerEnvelope(AUTO_BACKEND, self.agent_name, self.layout, region.base_address,
                                      region.num_blocks, region.block_bytes, region.memory_kind, region.device_id,
                                      encode_bundle(parts))
        self._metadata = self._envelope.encode()
        return self._metadata

    def add_peer(self, metadata: bytes) -> PeerId:
        self._check_open()
        if self._envelope is None:
            raise InvalidRequestError("register the KV region before adding peers (the handshake compares them)")
        envelope = PeerEnvelope.decode(metadata)
        peer_id = PeerId(envelope.agent_name)
        known = self._routes.get(peer_id)
        if known is not None and known.metadata == bytes(metadata):
            return peer_id  # a ticket per request names the same peer: no new choice, no new log line
        if envelope.backend == AUTO_BACKEND:
            check_compatible(self._envelope, envelope)
            parts = decode_bundle(envelope.payload)
        elif envelope.backend in (IPC, self._cross_host.backend_name):
            parts = {envelope.backend: bytes(metadata)}
        else:
            raise IncompatiblePeerError(f"refusing peer {peer_id!r}: backend (ours {AUTO_BACKEND!r}: ipc on this "
                                        f"host, {self._cross_host.backend_name} across hosts; peer "
                                        f"{envelope.backend!r})")
        if known is not None:
            self.remove_peer(peer_id)  # same name, new metadata: the peer re-registered
        inner, why = self._connect(peer_id, parts)
        self._routes[peer_id] = _Route(inner, bytes(metadata))
        logger.info("KV peer %s: reading over %s (%s)", peer_id, inner.backend_name, why)
        return peer_id

    def remove_peer(self, peer: PeerId) -> None:
        self._check_open()
        route = self._route(peer)
        del self._routes[peer]
        route.inner.remove_peer(peer)

    def read(self, peer: PeerId, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        self._check_open()
        route = self._route(peer)
        handle = route.inner.read(peer, remote_block_ids, local_block_ids)
        parity = 1 if route.inner is self._cross_host else 0
        return dataclasses.replace(handle, transfer_id=2 * handle.transfer_id + parity)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._check_open()
        inner, inner_handle = self._unwrap(handle)
        return inner.poll(inner_handle)

    def failure_reason(self, handle: TransferHandle) -> str | None:
        self._check_open()
        inner, inner_handle = self._unwrap(handle)
        return inner.failure_reason(inner_handle)

    def notify(self, peer: PeerId, message: bytes) -> None:
        self._check_open()
        self._route(peer).inner.notify(peer, message)

    def get_notifications(self) -> list[tuple[PeerId, bytes]]:
        self._check_open()
        # senders are agent names on both transports, which are our PeerIds (see the module docstring)
        return [received for inner in self._inner() for received in inner.get_notifications()]

    def progress(self) -> None:
        self._check_open()
        for inner in self._inner():
            inner.progress()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._routes.clear()
        for inner in self._inner():
            try:
                inner.close()
            except Exception:  # closing must finish: log, go on
                logger.exception("closing the inner %s connector failed", inner.backend_name)

    # ---- helpers -------------------------------------------------------------------------------------------------

    def _connect(self, peer_id: PeerId, parts: dict[str, bytes]) -> tuple[Connector, str]:
        """Adds the peer to the inner connector it can be read with; returns that connector and why it was chosen."""
        cross_part = parts.get(self._cross_host.backend_name)
        if IPC in parts and self._ipc is not None:
            try:
                return self._add(self._ipc, peer_id, parts[IPC]), "same host"
            except IncompatiblePeerError as e:
                if len(parts) == 1:  # a plain ipc peer: there is no other way to read it
                    raise
                why = f"ipc refused it: {e}"
        elif IPC in parts:
            why = f"the peer offers ipc, but this node runs without it: {self._ipc_unavailable}"
        else:
            why = f"the peer offers {', '.join(parts)}, not ipc"
        if cross_part is None:
            raise IncompatiblePeerError(f"refusing peer {peer_id!r}: {why}; and it offers no "
                                        f"{self._cross_host.backend_name} metadata (it offers {', '.join(parts)})")
        return self._add(self._cross_host, peer_id, cross_part), why

    @staticmethod
    def _add(inner: Connector, peer_id: PeerId, part: bytes) -> Connector:
        added = inner.add_peer(part)
        if added != peer_id:  # a part naming another agent than its envelope: refuse it, leave nothing behind
            inner.remove_peer(added)
            raise InvalidMetadataError(f"the peer {peer_id!r}'s {inner.backend_name} metadata names agent "
                                       f"{added!r}")
        return inner

    def _unwrap(self, handle: TransferHandle) -> tuple[Connector, TransferHandle]:
        if not isinstance(handle, TransferHandle) or isinstance(handle.transfer_id, bool) \
                or not isinstance(handle.transfer_id, int):
            raise UnknownTransferError(f"{handle!r} is not a transfer handle of this connector")
        inner = self._cross_host if handle.transfer_id % 2 else self._ipc
        if inner is None:
            raise UnknownTransferError(f"transfer {handle.transfer_id} was not issued by this connector")
        return inner, dataclasses.replace(handle, transfer_id=handle.transfer_id // 2)

    def _route(self, peer: PeerId) -> _Route:
        route = self._routes.get(peer)
        if route is None:
            raise UnknownPeerError(f"unknown peer {peer!r}: add_peer it first (known: {len(self._routes)})")
        return route

    def _inner(self) -> list[Connector]:
        return [self._cross_host] if self._ipc is None else [self._ipc, self._cross_host]

    def _drop_ipc(self, why: str) -> None:
        assert self._ipc is not None, "no ipc connector to drop"
        logger.warning("the auto KV connector %s runs without ipc (every peer over %s): %s", self.agent_name,
                       self._cross_host.backend_name, why)
        try:
            self._ipc.close()
        except Exception:
            logger.exception("closing the ipc connector failed")
        self._ipc, self._ipc_unavailable = None, why

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError(f"the auto connector {self.agent_name} is closed")


def open_auto_connector(*, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                        host: str = "127.0.0.1", cross_host: str = "nixl", ipc_options: Mapping[str, Any] | None = None,
                        **cross_host_options: Any) -> AutoConnector:
    """An auto connector: an ipc connector given `ipc_options` (e.g. `read_threads`), and a `cross_host` ("nixl" or
    "mooncake") connector given `host` and `cross_host_options` as `make_connector(cross_host, ...)` takes them."""
    from kvtransfer import make_connector  # the package's factory (it imports this module only for "auto")

    if cross_host not in CROSS_HOST_BACKENDS:
        raise InvalidRequestError(f"cross_host must be one of {list(CROSS_HOST_BACKENDS)}, got {cross_host!r}")
    if ipc_options is not None and not isinstance(ipc_options, Mapping):
        raise InvalidRequestError(f"ipc_options must be a mapping, got {type(ipc_options).__name__}")
    name = agent_name or default_agent_name(AUTO_BACKEND)
    ipc: Connector | None = None
    unavailable = None
    try:
        ipc = make_connector(IPC, layout=layout, agent_name=name, read_timeout_s=read_timeout_s, **(ipc_options or {}))
    except BackendError as e:
        unavailable = str(e)
        logger.warning("the auto KV connector %s runs without ipc (every peer over %s): %s", name, cross_host, e)
    try:
        cross = make_connector(cross_host, layout=layout, agent_name=name, read_timeout_s=read_timeout_s, host=host,
                               **cross_host_options)
    except BaseException:
        if ipc is not None:
            ipc.close()
        raise
    return AutoConnector(layout=layout, cross_host=cross, ipc=ipc, ipc_unavailable=unavailable)
