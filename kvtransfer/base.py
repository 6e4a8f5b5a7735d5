"""The connector contract: how a node moves KV blocks to or from a peer (docs/architecture.md#kv-layout).

A connector owns one registered memory region per rank, the KV pool, laid out block-major so that block `i` of
every layer is one contiguous run of `block_bytes` bytes at `base_address + i * block_bytes`, and a run of
consecutive block ids is one contiguous range. It knows block ids and memory regions, never models or schedulers.

Backends: `nixl` (UCX) and `mooncake` (TransferEngine) between any hosts, `ipc` between processes of one host
(process_vm_readv for host memory, CUDA IPC for GPU memory), and `auto`, which chooses ipc or nixl (or mooncake)
per peer; all pass one contract suite (tests/kvtransfer/test_contract.py).

Lifecycle of a pull (decode side D, prefill side P; both run the same code):

    P: metadata_p = connector.register(region)        D: metadata_d = connector.register(region)
       ... metadata travels in the KV ticket or a registry; each side may add the other ...
                                                      D: peer = connector.add_peer(metadata_p)
                                                      D: handle = connector.read(peer, p_block_ids, d_block_ids)
    P: connector.progress()  (every loop turn)         D: connector.poll(handle) until DONE / FAILED
                                                      D: connector.notify(peer, b"release ...")
    P: connector.get_notifications() -> [(d, b"release ...")]

Threading: a connector is not thread-safe; one loop owns it and calls `progress()` regularly (at least every few
milliseconds while transfers may be running against its memory: with NIXL the memory owner must make progress
for a peer's read to complete; with ipc, the progress call only moves notifications).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NewType

from kvtransfer.errors import InvalidRequestError

PeerId = NewType("PeerId", str)  # the peer's agent name, as returned by add_peer and seen on notifications


class MemoryKind(Enum):
    DRAM = "DRAM"  # host memory
    VRAM = "VRAM"  # GPU memory


class TransferStatus(Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class KVRegion:
    """One contiguous, block-major KV pool: `num_blocks` blocks of `block_bytes` bytes from `base_address`.

    `owner` keeps the array or tensor that holds the memory alive for as long as the region is registered.
    """

    base_address: int
    num_blocks: int
    block_bytes: int
    memory_kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    owner: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("base_address", "num_blocks", "block_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"KVRegion.{name} must be a positive int, got {value!r}")
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int) or self.device_id < 0:
            raise InvalidRequestError(f"KVRegion.device_id must be an int >= 0, got {self.device_id!r}")
        if not isinstance(self.memory_kind, MemoryKind):
            raise InvalidRequestError(f"KVRegion.memory_kind must be a MemoryKind, got {self.memory_kind!r}")

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block_address(self, block_id: int) -> int:
        return self.base_address + block_id * self.block_bytes

    @classmethod
    def from_buffer(cls, buffer: Any, num_blocks: int | None = None) -> KVRegion:
        """The region of a C-contiguous numpy array or torch tensor (CPU or CUDA), kept alive as `owner`.

        `num_blocks` defaults to the first dimension (the block dimension of a block-major KV cache).
        """
        if hasattr(buffer, "data_ptr"):  # a torch tensor; duck-typed so that kvtransfer never imports torch
            if not buffer.is_contiguous():
                raise InvalidRequestError("the KV tensor must be contiguous")
            base_address, num_bytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
            on_gpu = buffer.device.type == "cuda"
            memory_kind = MemoryKind.VRAM if on_gpu else MemoryKind.DRAM
            device_id = (buffer.device.index or 0) if on_gpu else 0
        elif hasattr(buffer, "__array_interface__"):  # a numpy array
            if not buffer.flags.c_contiguous:
                raise InvalidRequestError("the KV array must be C-contiguous")
            base_address, num_bytes = buffer.ctypes.data, buffer.nbytes
            memory_kind, device_id = MemoryKind.DRAM, 0
        else:
            raise InvalidRequestError(f"cannot make a KVRegion from {type(buffer).__name__}")
        if num_blocks is None:
            num_blocks = int(buffer.shape[0]) if len(buffer.shape) else 0
        if num_blocks <= 0 or num_bytes % num_blocks:
            raise InvalidRequestError(f"{num_bytes} bytes do not split into {num_blocks} equal blocks")
        return cls(base_address, num_blocks, num_bytes // num_blocks, memory_kind, device_id, owner=buffer)


@dataclass(frozen=True)
class TransferHandle:
    """A READ in flight. `num_descriptors` is how many contiguous ranges it moves after coalescing."""

    transfer_id: int
    peer: PeerId
    num_blocks: int
    num_descriptors: int
    num_bytes: int


class Connector(abc.ABC):
    """Moves KV blocks between this node's registered region and its peers' regions (one-sided READs).

    Errors: calls that can never succeed raise a `kvtransfer.errors.TransferError` subclass before anything
    reaches the transfer library (which may abort the process on bad input). A transfer that fails later (the
    peer died, timed out) is reported by `poll` as FAILED, never raised, and never hangs: reads have a timeout.
    """

    # "nixl", "mooncake", "ipc" (same host only) or "auto" (ipc or a cross-host backend, per peer). Peers run the same
    # backend, or one is auto and runs the other's (an auto node's metadata offers each backend it runs).
    backend_name: str

    @property
    @abc.abstractmethod
    def agent_name(self) -> PeerId:
        """This connector's unique name: the PeerId under which peers know it."""

    @abc.abstractmethod
    def register(self, region: KVRegion) -> bytes:
        """Registers the KV pool with the transfer library (once) and returns this agent's metadata: the bytes a
        peer passes to `add_peer` (a versioned envelope carrying backend, layout hash and region geometry)."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> PeerId:
        """Loads a peer's metadata so that this side can read from it and notify it; returns its PeerId.

        Idempotent for the same metadata. Raises `IncompatiblePeerError` (naming the differing fields) when the
        peer's backend, layout hash or block size differ, `InvalidMetadataError` for unreadable bytes."""

    @abc.abstractmethod
    def remove_peer(self, peer: PeerId) -> None:
        """Forgets a peer: its reads still in flight are given up (FAILED once over, see `poll`); later calls naming
        it raise `UnknownPeerError`."""

    @abc.abstractmethod
    def read(self, peer: PeerId, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        """Starts copying the peer's blocks `remote_block_ids[k]` into local blocks `local_block_ids[k]`.

        Runs of consecutive ids on both sides are coalesced into as few descriptors as possible. Raises
        `InvalidDescriptorError` (ids out of range, lengths differ, a local block named twice) or
        `UnknownPeerError` at once; a transport failure shows up as FAILED from `poll`. An empty read is DONE.
        The local blocks must not be used until the handle is DONE or FAILED."""

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """The transfer's status. A read past its timeout (or whose peer was removed) is given up: it turns FAILED
        once the library says it is over, never earlier, because no library can stop a read in flight and FAILED
        promises that nothing more lands in its local blocks. A finished status is remembered for a while, so
        polling again answers the same."""

    @abc.abstractmethod
    def failure_reason(self, handle: TransferHandle) -> str | None:
        """Why a FAILED transfer failed (None otherwise)."""

    @abc.abstractmethod
    def notify(self, peer: PeerId, message: bytes) -> None:
        """Sends a small message to a peer (e.g. "release ticket t"). Best effort and non-blocking: a message to a
        peer that has gone away is lost (leases cover that), and messages carry no ordering guarantee."""

    @abc.abstractmethod
    def get_notifications(self) -> list[tuple[PeerId, bytes]]:
        """Messages received since the last call, as (sender PeerId, message). The sender need not be a peer
        added on this side."""

    @abc.abstractmethod
    def progress(self) -> None:
        """Lets the transfer library make progress; the owner's loop must call it regularly."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fails transfers in flight, forgets peers, deregisters memory and releases the library. Idempotent;
        every later call raises `ConnectorClosedError`."""

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferStatus:
        """Polls (with progress) until the transfer finishes or `timeout_s` passes; returns the last status.
        For tests and tools: a node's loop polls instead of blocking."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.progress()
            status = self.poll(handle)
            if status is not TransferStatus.PENDING or (deadline is not None and time.monotonic() >= deadline):
                return status
            time.sleep(0.0002)

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
