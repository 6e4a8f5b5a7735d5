"""Same-host backend "ipc": a decode node pulls a prefill node's KV blocks with the OS or the GPU directly.

On one machine no transport library is needed: D reads P's pool itself, one copy per coalesced run, with no
per-descriptor protocol in between (NIXL moved 1.5 TB/s as one region but 150-250 GB/s as scattered 2 MiB blocks
between two processes on one H200; CUDA IPC moved 2.1 TB/s).
- Host pools (DRAM): `process_vm_readv` (kvtransfer/ipc_host.py), one local and one remote range per run, at most
  1024 runs per call, on a worker thread of this connector's pool so `read` returns at once; `poll` looks at the
  future.
- GPU pools (VRAM): CUDA IPC through torch (kvtransfer/ipc_cuda.py): D maps P's pool once in add_peer; a read
  enqueues the runs' device copies on a stream of its own and records an event; `poll` queries it.
- Notifications: datagrams on an abstract AF_UNIX socket per connector (kvtransfer/ipc_notify.py).
Both sides' pools must be of one kind (host and host, or GPU and GPU).

Who the peer is (kvtransfer/ipc_payload.py): the payload names P's host (hostname, boot id, PID and network
namespaces), its process (pid and start time, so a reused pid is told apart), its socket, and for a GPU pool the
CUDA IPC share. add_peer refuses a peer on another host or namespace (IncompatiblePeerError), and a host-memory
peer it may not read (EPERM: another user, Yama ptrace_scope 2+, seccomp) with what to change.

The peer's state, one-sided: no message from P is needed to read it, so D checks that P still runs (same pid and
start time) and that its connector is still open (its notification socket is still bound) before a read starts
and again once its bytes have landed; a read that raced with P's exit or close is FAILED, never DONE. A peer that
is stopped (SIGSTOP) is read as usual: its memory is there, and the blocks a ticket names are pinned under its
lease. A read cannot hang: process_vm_readv and GPU copies end on their own (and the read timeout still holds).
"""

from __future__ import annotations

import errno
import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.base import KVRegion, MemoryKind, PeerId, TransferStatus
from kvtransfer.common import BlockConnector, Peer
from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import (
    BackendError,
    IncompatiblePeerError,
    InvalidMetadataError,
    InvalidRequestError,
    PeerDisconnectedError,
)
from kvtransfer.handshake import KVLayout, PeerEnvelope
from kvtransfer.ipc_host import allow_same_user_readers, plan_iovec_batches, read_process_memory
from kvtransfer.ipc_notify import NotificationSocket, is_bound
from kvtransfer.ipc_payload import HostIdentity, IpcPayload, ProcessRef, process_gone_reason

logger = logging.getLogger(__name__)

_ABORT_WAIT_S = 5.0  # an aborted host read stops after its current call (<= 256 MiB): this is ample


@dataclass
class _IpcPeer:
    process: ProcessRef
    socket_name: str
    pool: Any = None  # the peer's GPU pool mapped here (torch uint8 [num_blocks, block_bytes]); None for host pools


@dataclass
class _HostRead:
    future: Future[str | None]  # None: every byte arrived; else why not
    cancelled: threading.Event


@dataclass
class _GpuRead:
    event: Any  # torch.cuda.Event recorded after the copies
    peer: _IpcPeer


def peer_gone_reason(process: ProcessRef, socket_name: str) -> str | None:
    """Why a peer can no longer be read (None while its process runs and its connector is open)."""
    reason = process_gone_reason(process)
    if reason is None and not is_bound(socket_name):
        reason = f"the peer (process {process.pid}) has closed its connector"
    return reason


class IpcConnector(BlockConnector):
    backend_name = "ipc"
    supported_memory_kinds = frozenset({MemoryKind.DRAM, MemoryKind.VRAM})

    def __init__(self, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                 read_threads: int = 2) -> None:
        """`read_threads`: how many host-memory reads may run at once (each is one thread in a system call)."""
        super().__init__(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s)
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads < 1:
            raise InvalidRequestError(f"read_threads must be an int >= 1, got {read_threads!r}")
        if not sys.platform.startswith("linux"):
            raise BackendError(f"the ipc KV transfer backend needs Linux, not {sys.platform}")
        process = ProcessRef.current()
        if process is None:
            raise BackendError("the ipc KV transfer backend needs /proc (it names processes by pid and start time)")
        self._process = process
        self._host = HostIdentity.current()
        self._socket = NotificationSocket(self._agent_name)
        self._executor = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="ipc-read")
        self._pool: Any = None  # our GPU pool as torch uint8 blocks (GPU regions only)
        self._copier: Any = None  # ipc_cuda.CudaCopier (GPU regions only)

    def _register_region(self, region: KVRegion) -> bytes:
        share = None
        if region.memory_kind is MemoryKind.VRAM:
            from kvtransfer import ipc_cuda

            self._pool = ipc_cuda.local_pool(region)
            self._copier = ipc_cuda.CudaCopier(self._pool)
            share = ipc_cuda.export_pool(region, self._pool, self._socket.name)
        else:
            allow_same_user_readers()  # peers are not our ancestors: under Yama scope 1 they need our leave
        return IpcPayload(self._host, self._process, self._socket.name, share).encode()

    def _connect_peer(self, envelope: PeerEnvelope) -> _IpcPeer:
        payload = IpcPayload.decode(envelope.payload)
        region = self._require_region()
        differences = self._host.differences(payload.host)
        if differences:
            raise IncompatiblePeerError(f"refusing peer {envelope.agent_name!r}: the ipc backend reads the memory of "
                                        f"processes on this host, in this PID and network namespace; the peer "
                                        f"differs in " + ", ".join(differences) + " (use nixl or mooncake)")
        if envelope.memory_kind is not region.memory_kind:
            raise IncompatiblePeerError(f"refusing peer {envelope.agent_name!r}: its KV pool is in "
                                        f"{envelope.memory_kind.value}, ours in {region.memory_kind.value}; the ipc "
                                        f"backend copies host memory to host memory or GPU memory to GPU memory")
        if (payload.cuda is None) != (region.memory_kind is MemoryKind.DRAM):
            raise InvalidMetadataError(f"peer {envelope.agent_name!r} has a {envelope.memory_kind.value} pool but "
                                       f"{'no' if payload.cuda is None else 'a'} CUDA IPC share")
        reason = peer_gone_reason(payload.process, payload.socket_name)
        if reason is not None:
            raise PeerDisconnectedError(f"cannot add peer {envelope.agent_name!r}: {reason}")
        peer = _IpcPeer(payload.process, payload.socket_name)
        if payload.cuda is None:
            self._probe_host_pool(envelope, payload.process)
        else:
            from kvtransfer import ipc_cuda

            peer.pool = ipc_cuda.import_pool(payload.cuda, same_process=payload.process == self._process,
                                             socket_name=payload.socket_name, device_id=region.device_id,
                                             num_blocks=envelope.num_blocks, block_bytes=envelope.block_bytes)
        return peer

    def _probe_host_pool(self, envelope: PeerEnvelope, process: ProcessRef) -> None:
        """Reads the first and last byte of the peer's pool: refuses at once a peer this process may not read
        (another user, Yama ptrace_scope 2+, seccomp) or whose pool is not where the envelope says."""
        scratch = np.zeros(2, dtype=np.uint8)
        last = envelope.base_address + envelope.num_blocks * envelope.block_bytes - 1
        batches = plan_iovec_batches([scratch.ctypes.data, scratch.ctypes.data + 1], [envelope.base_address, last],
                                     [1, 1])
        failure = read_process_memory(process.pid, batches)
        if failure is None:
            return
        if failure.errno == errno.EPERM:
            raise IncompatiblePeerError(f"refusing peer {envelope.agent_name!r}: {failure.reason}")
        if failure.errno in (errno.EFAULT, 0):
            raise InvalidMetadataError(f"peer {envelope.agent_name!r}: its KV pool is not mapped where its metadata "
                                       f"says ({failure.reason})")
        raise PeerDisconnectedError(f"cannot add peer {envelope.agent_name!r}: {failure.reason}")

    def _disconnect_peer(self, peer: Peer) -> None:
        state: _IpcPeer = peer.state
        if state.pool is not None:
            self._copier.synchronize()  # no copy may still read the mapping we are about to drop
            state.pool = None

    def _start_read(self, peer: Peer, runs: BlockRuns) -> _HostRead | _GpuRead:
        state: _IpcPeer = peer.state
        reason = peer_gone_reason(state.process, state.socket_name)
        if reason is not None:
            raise PeerDisconnectedError(reason)
        region = self._require_region()
        if state.pool is not None:
            return _GpuRead(self._copier.start(state.pool, runs), state)
        local, remote, lengths = runs.byte_ranges(remote_base=peer.envelope.base_address,
                                                  local_base=region.base_address, block_bytes=region.block_bytes)
        cancelled = threading.Event()
        future = self._executor.submit(self._read_host, state, plan_iovec_batches(local, remote, lengths), cancelled)
        return _HostRead(future, cancelled)

    @staticmethod
    def _read_host(peer: _IpcPeer, batches: list[Any], cancelled: threading.Event) -> str | None:
        """On a worker thread: the read, then the peer check (did it exit or close while we read?)."""
        failure = read_process_memory(peer.process.pid, batches, cancelled)
        return failure.reason if failure is not None else peer_gone_reason(peer.process, peer.socket_name)

    def _check_read(self, state: _HostRead | _GpuRead) -> tuple[TransferStatus, str | None]:
        if isinstance(state, _GpuRead):
            try:
                if not state.event.query():
                    return TransferStatus.PENDING, None
            except RuntimeError as e:  # a CUDA error surfaced by the copies
                return TransferStatus.FAILED, f"the GPU copies failed: {e}"
            reason = peer_gone_reason(state.peer.process, state.peer.socket_name)
        else:
            if not state.future.done():
                return TransferStatus.PENDING, None
            if state.future.cancelled():
                return TransferStatus.FAILED, "the read was cancelled"
            error = state.future.exception()
            reason = state.future.result() if error is None else f"the read raised {type(error).__name__}: {error}"
        return (TransferStatus.DONE, None) if reason is None else (TransferStatus.FAILED, reason)

    def _abort_read(self, state: _HostRead | _GpuRead) -> None:
        # Wait until nothing more can land in our blocks: the caller may reuse them as soon as the read is FAILED.
        if isinstance(state, _GpuRead):
            state.event.synchronize()
            return
        state.cancelled.set()
        if not state.future.cancel():
            _, running = wait_futures([state.future], timeout=_ABORT_WAIT_S)
            if running:
                logger.error("an aborted host read is still running after %g s", _ABORT_WAIT_S)

    def _send_notification(self, peer: Peer, message: bytes) -> None:
        self._socket.send(peer.state.socket_name, message)

    def _progress(self) -> list[tuple[PeerId, bytes]]:
        self._socket.flush()
        return self._socket.receive()

    def _shutdown(self) -> None:
        self._socket.close()  # peers see us as closed from here on
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._pool is not None:
            from kvtransfer import ipc_cuda

            ipc_cuda.forget_local_pool(self._socket.name)
            self._copier.synchronize()
            self._pool = self._copier = None
