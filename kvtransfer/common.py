"""The bookkeeping every backend shares, so that each backend file is only its library's calls.

`BlockConnector` implements the `Connector` contract over a handful of backend hooks (`_register_region`,
`_connect_peer`, `_start_read`, `_check_read`, ...). It validates everything before a hook runs (the libraries
may abort the process on bad input), keeps the peer table and transfer records, enforces read deadlines, and
remembers finished statuses for a while so that a handle can be polled again.

Transfer record lifecycle:

    read() ─ validate, coalesce ─┬─ no blocks ───────────────────────────────────► finished: DONE
                                 ├─ _start_read raised a TransferError ──────────► finished: FAILED (reason)
                                 └─ in flight ── poll: _check_read ── DONE/FAILED ► finished
                                                     └─ deadline passed, or peer removed: _abort_read ► given up
                     given up ── poll: _check_read ── still in flight: PENDING
                                                  └─ over (whatever its outcome) ► finished: FAILED (why given up)

A read given up on stays PENDING until the library says it is over, because FAILED promises the caller that nothing
more lands in the read's local blocks (it frees them, and they go to another request). No library here can promise
that earlier: NIXL's release of a READ in flight (and removing its peer) only orphans UCX's GET, whose bytes keep
arriving (tests/multihost/test_late_writes.py saw every block written seconds after a timed-out read was released);
a running Mooncake batch read cannot be stopped. A read from a peer that is gone ends soon (the connection fails);
one stuck on a partition ends when the transport gives up, holding its blocks until then.
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvtransfer.base import Connector, KVRegion, MemoryKind, PeerId, TransferHandle, TransferStatus
from kvtransfer.descriptors import BlockIds, BlockRuns, coalesce_runs, validate_block_ids
from kvtransfer.errors import (
    ConnectorClosedError,
    InvalidRequestError,
    TransferError,
    UnknownPeerError,
    UnknownTransferError,
)
from kvtransfer.handshake import KVLayout, PeerEnvelope, check_compatible, select_envelope

logger = logging.getLogger(__name__)

MAX_NOTIFICATION_BYTES = 4096
_MAX_FINISHED_RECORDS = 4096  # finished statuses kept for re-polling; the oldest are forgotten first


@dataclass
class Peer:
    """A peer this connector can read from and notify; `state` is the backend's (e.g. a prepared list)."""

    peer_id: PeerId
    envelope: PeerEnvelope
    metadata: bytes
    state: Any = None


@dataclass
class _Transfer:
    handle: TransferHandle
    deadline: float  # time.monotonic()
    state: Any
    given_up: str | None = None  # why the read was given up on (it ends FAILED for this reason once over)


def default_agent_name(backend: str) -> str:
    return f"{backend}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class BlockConnector(Connector):
    """The shared half of a connector; subclasses implement the `_hooks` with their library."""

    supported_memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.DRAM})

    def __init__(self, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidRequestError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not read_timeout_s > 0:
            raise InvalidRequestError(f"read_timeout_s must be > 0, got {read_timeout_s!r}")
        self.layout = layout
        self.read_timeout_s = float(read_timeout_s)
        self._agent_name = PeerId(agent_name or default_agent_name(self.backend_name))
        self._region: KVRegion | None = None
        self._envelope: PeerEnvelope | None = None
        self._metadata: bytes | None = None
        self._peers: dict[PeerId, Peer] = {}
        self._departing: dict[PeerId, Peer] = {}  # removed, with reads still in flight: disconnected once over
        self._transfers: dict[int, _Transfer] = {}
        self._finished: OrderedDict[int, tuple[TransferHandle, TransferStatus, str | None]] = OrderedDict()
        self._inbox: list[tuple[PeerId, bytes]] = []
        self._transfer_ids = itertools.count(1)
        self._closed = False

    # ---- backend hooks -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _register_region(self, region: KVRegion) -> bytes:
        """Registers the region with the library; returns the backend payload of the metadata envelope."""

    @abc.abstractmethod
    def _connect_peer(self, envelope: PeerEnvelope) -> Any:
        """Loads a (compatible) peer; returns the backend's per-peer state."""

    @abc.abstractmethod
    def _disconnect_peer(self, peer: Peer) -> None:
        """Releases the backend's per-peer state (no read from this peer is in flight any more, but at close)."""

    @abc.abstractmethod
    def _start_read(self, peer: Peer, runs: BlockRuns) -> Any:
        """Starts a READ of the (valid, coalesced) runs; returns its state. Raises a TransferError when the
        transfer fails at once (the record becomes FAILED)."""

    @abc.abstractmethod
    def _check_read(self, state: Any) -> tuple[TransferStatus, str | None]:
        """The READ's status and, when FAILED, why."""

    @abc.abstractmethod
    def _abort_read(self, state: Any) -> None:
        """Asks the library to stop a READ still in flight (timeout, peer removed), best effort and without blocking
        for long; `_check_read` keeps being asked until the read is over. Must not release what `_check_read`
        needs while the read may still write."""

    def _discard_read(self, state: Any) -> None:
        """Drops a READ at close: the library is released next, after which nothing can land."""
        self._abort_read(state)

    @abc.abstractmethod
    def _send_notification(self, peer: Peer, message: bytes) -> None:
        """Sends a message, best effort."""

    @abc.abstractmethod
    def _progress(self) -> list[tuple[PeerId, bytes]]:
        """Makes progress; returns the notifications received since the last call."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Deregisters the region and releases the library (peers and transfers are already gone)."""

    # ---- the contract --------------------------------------------------------------------------------------

    @property
    def agent_name(self) -> PeerId:
        return self._agent_name

    @property
    def metadata(self) -> bytes:
        """The bytes `register` returned."""
        if self._metadata is None:
            raise InvalidRequestError("no KV region is registered yet")
        return self._metadata

    @property
    def peers(self) -> list[PeerId]:
        return list(self._peers)

    def register(self, region: KVRegion) -> bytes:
        self._check_open()
        if self._region is not None:
            raise InvalidRequestError("a KV region is already registered with this connector")
        if not isinstance(region, KVRegion):
            raise InvalidRequestError(f"register takes a KVRegion, got {type(region).__name__}")
        if region.memory_kind not in self.supported_memory_kinds:
            raise InvalidRequestError(f"the {self.backend_name} connector does not support "
                                      f"{region.memory_kind.value} regions here")
        payload = self._register_region(region)
        self._region = region
        self._envelope = PeerEnvelope(self.backend_name, self._agent_name, self.layout, region.base_address,
                                      region.num_blocks, region.block_bytes, region.memory_kind, region.device_id,
                                      payload)
        self._metadata = self._envelope.encode()
        return self._metadata

    def add_peer(self, metadata: bytes) -> PeerId:
        self._check_open()
        if self._envelope is None:
            raise InvalidRequestError("register the KV region before adding peers (the handshake compares them)")
        # an auto peer offers one envelope per backend it runs: we read ours (see handshake.select_envelope)
        envelope, metadata = select_envelope(metadata, self.backend_name)
        check_compatible(self._envelope, envelope)
        peer_id = PeerId(envelope.agent_name)
        if peer_id == self._agent_name:
            raise InvalidRequestError("a connector cannot add itself as a peer")
        known = self._peers.get(peer_id) or self._departing.get(peer_id)
        if known is not None and known.metadata == bytes(metadata):
            # known, or removed while its reads end (the library still has it): in use again as it is
            self._peers[peer_id] = self._departing.pop(peer_id, known)
            return peer_id
        if known is not None:  # same name, new metadata: the peer re-registered; reads from the old one are orphaned
            if peer_id in self._peers:
                self.remove_peer(peer_id)
            if (old := self._departing.pop(peer_id, None)) is not None:
                self._disconnect(old)
        self._peers[peer_id] = Peer(peer_id, envelope, bytes(metadata), self._connect_peer(envelope))
        return peer_id

    def remove_peer(self, peer: PeerId) -> None:
        self._check_open()
        record = self._require_peer(peer)
        for transfer in [t for t in self._transfers.values() if t.handle.peer == peer]:
            self._give_up(transfer, "the peer was removed")
        del self._peers[peer]
        self._departing[peer] = record
        self._disconnect_departed(peer)

    def read(self, peer: PeerId, remote_block_ids: BlockIds, local_block_ids: BlockIds) -> TransferHandle:
        self._check_open()
        region = self._require_region()
        record = self._require_peer(peer)
        remote, local = validate_block_ids(remote_block_ids, local_block_ids,
                                           num_remote_blocks=record.envelope.num_blocks,
                                           num_local_blocks=region.num_blocks)
        runs = coalesce_runs(remote, local)
        handle = TransferHandle(next(self._transfer_ids), peer, len(remote), len(runs),
                                len(remote) * region.block_bytes)
        if not runs:
            self._finish(handle, TransferStatus.DONE, None)
            return handle
        try:
            state = self._start_read(record, runs)
        except TransferError as e:
            logger.warning("read from %s failed at once: %s", peer, e)
            self._finish(handle, TransferStatus.FAILED, str(e))
            return handle
        self._transfers[handle.transfer_id] = _Transfer(handle, time.monotonic() + self.read_timeout_s, state)
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._check_open()
        transfer = self._transfers.get(handle.transfer_id)
        if transfer is None or transfer.handle != handle:
            return self._finished_record(handle)[1]
        status, reason = self._check_read(transfer.state)
        if status is TransferStatus.PENDING and transfer.given_up is None and time.monotonic() >= transfer.deadline:
            self._give_up(transfer, f"timed out after {self.read_timeout_s:g} s")
            status, reason = self._check_read(transfer.state)
        if status is not TransferStatus.PENDING and transfer.given_up is not None:
            status, reason = TransferStatus.FAILED, transfer.given_up
        if status is not TransferStatus.PENDING:
            del self._transfers[handle.transfer_id]
            self._disconnect_departed(handle.peer)
            if status is TransferStatus.FAILED:
                logger.warning("read from %s failed: %s", handle.peer, reason)
            self._finish(handle, status, reason)
        return status

    def failure_reason(self, handle: TransferHandle) -> str | None:
        self._check_open()
        transfer = self._transfers.get(handle.transfer_id)
        if transfer is not None and transfer.handle == handle:
            return None
        return self._finished_record(handle)[2]

    def notify(self, peer: PeerId, message: bytes) -> None:
        self._check_open()
        record = self._require_peer(peer)
        if not isinstance(message, (bytes, bytearray, memoryview)):
            raise InvalidRequestError(f"a notification is bytes, got {type(message).__name__}")
        if len(message) > MAX_NOTIFICATION_BYTES:
            raise InvalidRequestError(f"a notification is at most {MAX_NOTIFICATION_BYTES} bytes, "
                                      f"got {len(message)}")
        self._send_notification(record, bytes(message))

    def get_notifications(self) -> list[tuple[PeerId, bytes]]:
        self.progress()
        received, self._inbox = self._inbox, []
        return received

    def progress(self) -> None:
        self._check_open()
        self._inbox.extend(self._progress())

    def close(self) -> None:
        if self._closed:
            return
        self._discard_transfers("the connector was closed")
        for record in [*self._peers.values(), *self._departing.values()]:
            self._disconnect(record)
        self._peers.clear()
        self._departing.clear()
        self._closed = True
        try:
            self._shutdown()
        except Exception:
            logger.exception("shutting down the %s connector failed", self.backend_name)

    # ---- helpers -------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError(f"the {self.backend_name} connector {self._agent_name} is closed")

    def _require_region(self) -> KVRegion:
        if self._region is None:
            raise InvalidRequestError("register the KV region first")
        return self._region

    def _require_peer(self, peer: PeerId) -> Peer:
        record = self._peers.get(peer)
        if record is None:
            raise UnknownPeerError(f"unknown peer {peer!r}: add_peer it first (known: {len(self._peers)})")
        return record

    def _give_up(self, transfer: _Transfer, reason: str) -> None:
        """The read ends FAILED for `reason`, once the library says it is over (see the module's docstring)."""
        transfer.given_up = reason
        try:
            self._abort_read(transfer.state)
        except Exception:
            logger.exception("aborting read %d failed", transfer.handle.transfer_id)

    def _disconnect_departed(self, peer: PeerId) -> None:
        """Disconnects a removed peer once none of its reads is in flight."""
        if peer in self._departing and not any(t.handle.peer == peer for t in self._transfers.values()):
            self._disconnect(self._departing.pop(peer))

    def _disconnect(self, record: Peer) -> None:
        try:
            self._disconnect_peer(record)
        except Exception:  # the peer is forgotten either way; the library may already have dropped it
            logger.exception("releasing peer %s failed", record.peer_id)

    def _discard_transfers(self, reason: str) -> None:
        for transfer in list(self._transfers.values()):
            try:
                self._discard_read(transfer.state)
            except Exception:
                logger.exception("discarding read %d failed", transfer.handle.transfer_id)
            del self._transfers[transfer.handle.transfer_id]
            self._finish(transfer.handle, TransferStatus.FAILED, reason)

    def _finish(self, handle: TransferHandle, status: TransferStatus, reason: str | None) -> None:
        self._finished[handle.transfer_id] = (handle, status, reason)
        while len(self._finished) > _MAX_FINISHED_RECORDS:
            self._finished.popitem(last=False)

    def _finished_record(self, handle: TransferHandle) -> tuple[TransferHandle, TransferStatus, str | None]:
        record = self._finished.get(handle.transfer_id)
        if record is None or record[0] != handle:
            raise UnknownTransferError(f"transfer {handle.transfer_id} was not issued by this connector, or "
                                       f"finished long ago")
        return record
