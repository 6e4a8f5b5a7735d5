"""Mooncake transfer engine backend (`tcp` on CPU boxes, `rdma` on GPU clusters, `nvlink_intra` between the GPUs
of one machine), P2P handshake, no Redis.

How it maps the contract (mooncake-transfer-engine 0.3.13.post1, `from mooncake.engine import TransferEngine`):
- The engine starts with `initialize(host, "P2PHANDSHAKE", protocol, "")` and answers peers on
  `host:get_rpc_port()`. The wheels have no Redis metadata plugin, so our envelope's payload carries the endpoint
  record (rpc address, base address; the geometry is in the envelope header).
- register: `register_memory(base, num_bytes, location)`, location "cuda:N" for GPU memory, "*" for host memory.
- read: the coalesced runs become (local address, remote address, length) triples, cut into batches of at most
  1024 entries (a bigger TCP batch fails), each a `batch_transfer_sync_read`. The Python binding has no usable
  non-blocking poll (`get_batch_transfer_status` blocks until the batch ends, `transfer_check_status` looks at the
  first task only), so each peer gets one worker thread that runs its reads in order (the binding releases the
  GIL) and `poll` looks at the thread's future.
- notify: Mooncake delivers a `TransferNotify(name, msg)` once a transfer carrying it completes, so a
  notification is a 1-byte READ from the peer's region into a private scratch buffer, carrying
  (our agent name, base64 of the message); the peer sees it in `get_notifies()`. It runs on the same worker
  thread, after the reads already queued for that peer.

GPU memory (VRAM regions). Mooncake picks its transport at `initialize` from what it finds, not from the protocol
argument: a CUDA build (mooncake-transfer-engine-cuda13) installs `nvlink_intra` (CUDA IPC: cudaIpcGetMemHandle on
the owner, cudaIpcOpenMemHandle + cudaMemcpyBatchAsync on the reader) when MC_INTRANODE_NVLINK is in the process
environment (any value, "0" too), else RDMA when it finds an HCA, else TCP (which stages GPU memory through host
buffers). So protocol "nvlink_intra" is a request the launcher must back with MC_INTRANODE_NVLINK=1
(`TransportSettings.launch_environment`); the connector checks that the engine really runs it (nvlink_intra refuses
host memory, so a host buffer that registers means it does not) and fails with a clear error otherwise. Under
nvlink_intra every registered buffer must be GPU memory, so a notification's scratch buffer is then a small CUDA
tensor on the region's device, and each peer's worker thread binds that device first (the library's CUDA calls use
the calling thread's current device). nvlink_intra orders its copies after the calling thread's per-thread default
stream only: whoever wrote the KV must have synchronised its own stream before a peer reads it (a node publishes
a ticket after sampling, which syncs). It shares whole cudaMalloc allocations (cuMemGetAddressRange), so a pool
inside a larger allocation works, but not expandable-segment (virtual memory) allocations. Peers must run the same
protocol (their endpoint records say which); nvlink_intra peers must share the machine.

Everything is validated before it reaches the library: bad input can abort the process instead of raising.
Caveats: the engine listens on all interfaces whatever `host` says (0.3.13 has no bind setting for its RPC and
data ports); a read that times out on our side keeps running until the library's own timeout
(`MC_TRANSFER_TIMEOUT`, 30 s unless the launcher starts the process with another), so its local blocks stay busy
until then; `close()` waits for running reads before it destroys the engine. The library reads its settings
(`MC_TRANSFER_TIMEOUT`, `MC_LOG_LEVEL`, ...) from the process environment only: that is the launcher's to set
(`tandem serve --transport-env`), never this module's.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.base import KVRegion, MemoryKind, PeerId, TransferStatus
from kvtransfer.common import BlockConnector, Peer
from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import BackendError, IncompatiblePeerError, InvalidMetadataError, InvalidRequestError
from kvtransfer.handshake import KVLayout, PeerEnvelope

logger = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 1024  # more entries in one TCP batch make the whole batch fail (-1)
PROTOCOLS = ("tcp", "rdma", "nvlink_intra")  # settings.cluster.MOONCAKE_PROTOCOLS offers the same
NVLINK_INTRA = "nvlink_intra"
_NOTIFY_SCRATCH_BYTES = 64
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")
_RPC_ADDRESS = re.compile(r"^([A-Za-z0-9][A-Za-z0-9.-]{0,252}):([0-9]{1,5})$")
_LEAKED_ENGINES: list[Any] = []  # engines with reads still running at close: destroying them would crash


@dataclass
class _MooncakePeer:
    rpc_address: str
    base_address: int
    worker: ThreadPoolExecutor


@dataclass
class _MooncakeRead:
    future: Future[int]


class MooncakeConnector(BlockConnector):
    backend_name = "mooncake"
    supported_memory_kinds = frozenset({MemoryKind.DRAM, MemoryKind.VRAM})

    def __init__(self, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                 host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        super().__init__(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s)
        if not isinstance(host, str) or not _HOST.match(host):
            raise InvalidRequestError(f"host must be an IPv4 address or host name, got {host!r}")
        if protocol not in PROTOCOLS:
            raise InvalidRequestError(f"protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as e:
            raise BackendError(f"the Mooncake transfer engine is not installed or cannot load ({e}): pip install "
                               "mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU) or "
                               "mooncake-transfer-engine-cuda13==0.3.13.post1 (GPU), and apt-get install "
                               "libibverbs1") from None
        self.protocol = protocol
        self._notify_type, self._read_opcode = TransferNotify, TransferOpcode.Read
        self._engine: Any = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise BackendError(f"the Mooncake transfer engine did not start ({protocol} on {host})")
        self._rpc_address = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._scratch_address = 0  # notifications ride on a 1-byte read into this buffer (set by register)
        self._scratch_owner: Any = None
        self._device_id: int | None = None  # the region's GPU, which worker threads bind
        self._in_flight: set[Future[Any]] = set()  # reads and notifications the engine is running
        if protocol == NVLINK_INTRA:
            self._check_nvlink_intra_is_running()

    @property
    def rpc_address(self) -> str:
        return self._rpc_address

    def _check_nvlink_intra_is_running(self) -> None:
        """The engine chose its transport from the environment; nvlink_intra refuses host memory, so a host probe
        that registers means the engine runs another transport (TCP) and GPU reads would crawl or fail."""
        probe = np.zeros(_NOTIFY_SCRATCH_BYTES, dtype=np.uint8)
        if self._engine.register_memory(probe.ctypes.data, probe.nbytes, "*") != 0:
            return  # refused, as nvlink_intra does (the library logs "Unsupported memory type" once)
        self._engine.unregister_memory(probe.ctypes.data)
        self._engine = None
        raise BackendError("Mooncake did not start its nvlink_intra transport: it needs a CUDA build "
                           "(mooncake-transfer-engine-cuda13) and MC_INTRANODE_NVLINK=1 in the environment the "
                           "process started with (the launcher's transport environment, e.g. tandem serve "
                           "--mooncake-protocol nvlink_intra)")

    def _register(self, address: int, num_bytes: int, location: str) -> None:
        if self._engine.register_memory(address, num_bytes, location) != 0:
            hint = (" (nvlink_intra registers GPU memory only: unset MC_INTRANODE_NVLINK for host memory)"
                    if location == "*" else " (CUDA IPC shares cudaMalloc memory only, not the virtual-memory "
                    "allocations of PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
            raise BackendError(f"Mooncake could not register {num_bytes} bytes at {address:#x} ({location}){hint}")
        self._registered.append(address)

    def _register_region(self, region: KVRegion) -> bytes:
        on_gpu = region.memory_kind is MemoryKind.VRAM
        if self.protocol == NVLINK_INTRA and not on_gpu:
            raise InvalidRequestError("Mooncake's nvlink_intra protocol moves GPU memory only: register a VRAM "
                                      "region, or use protocol tcp/rdma for host memory")
        location = f"cuda:{region.device_id}" if on_gpu else "*"
        self._register(region.base_address, region.num_bytes, location)
        if on_gpu:
            self._device_id = region.device_id
            self._scratch_owner = _cuda_scratch(region.device_id)
            self._scratch_address = int(self._scratch_owner.data_ptr())
        else:
            self._scratch_owner = np.zeros(_NOTIFY_SCRATCH_BYTES, dtype=np.uint8)
            self._scratch_address = int(self._scratch_owner.ctypes.data)
        self._register(self._scratch_address, _NOTIFY_SCRATCH_BYTES, location)
        return json.dumps({"rpc_address": self._rpc_address, "base_address": region.base_address,
                           "protocol": self.protocol}).encode()

    def _connect_peer(self, envelope: PeerEnvelope) -> _MooncakePeer:
        try:
            record = json.loads(envelope.payload)
            rpc_address, base_address, protocol = record["rpc_address"], record["base_address"], record["protocol"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidMetadataError(f"the Mooncake endpoint record is malformed: {type(e).__name__}: {e}") from None
        match = _RPC_ADDRESS.match(rpc_address) if isinstance(rpc_address, str) else None
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise InvalidMetadataError(f"the Mooncake rpc address {rpc_address!r} is not host:port")
        if base_address != envelope.base_address:
            raise InvalidMetadataError("the Mooncake endpoint record and the envelope disagree on the base address")
        if protocol != self.protocol:
            raise IncompatiblePeerError(f"refusing peer {envelope.agent_name!r}: Mooncake protocol ours "
                                        f"{self.protocol!r}, peer {protocol!r}")
        device_id = self._device_id
        bind_device = None if device_id is None else functools.partial(_bind_cuda_device, device_id)
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mooncake-read-{envelope.agent_name}",
                                    initializer=bind_device)
        return _MooncakePeer(rpc_address, base_address, worker)

    def _disconnect_peer(self, peer: Peer) -> None:
        peer.state.worker.shutdown(wait=False, cancel_futures=True)

    def _start_read(self, peer: Peer, runs: BlockRuns) -> _MooncakeRead:
        region = self._require_region()
        local, remote, lengths = runs.byte_ranges(remote_base=peer.state.base_address,
                                                  local_base=region.base_address, block_bytes=region.block_bytes)
        future = peer.state.worker.submit(self._read_batches, peer.state.rpc_address, local, remote, lengths)
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        return _MooncakeRead(future)

    def _read_batches(self, rpc_address: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        for start in range(0, len(lengths), MAX_BATCH_ENTRIES):
            end = start + MAX_BATCH_ENTRIES
            result = self._engine.batch_transfer_sync_read(rpc_address, local[start:end], remote[start:end],
                                                           lengths[start:end])
            if result != 0:
                return int(result)
        return 0

    def _check_read(self, state: _MooncakeRead) -> tuple[TransferStatus, str | None]:
        future = state.future
        if not future.done():
            return TransferStatus.PENDING, None
        if future.cancelled():
            return TransferStatus.FAILED, "the read was cancelled"
        error = future.exception()
        if error is not None:
            return TransferStatus.FAILED, f"Mooncake raised {type(error).__name__}: {error}"
        if future.result() != 0:
            return TransferStatus.FAILED, (f"Mooncake batch read returned {future.result()} (the peer is gone, "
                                           "unreachable, or rejected the ranges)")
        return TransferStatus.DONE, None

    def _abort_read(self, state: _MooncakeRead) -> None:
        # a queued read is dropped; a running one cannot be stopped and ends by the library's own timeout
        state.future.cancel()

    def _send_notification(self, peer: Peer, message: bytes) -> None:
        notice = self._notify_type(self._agent_name, base64.b64encode(message).decode())
        try:
            future = peer.state.worker.submit(self._notify, peer.state.rpc_address, peer.state.base_address, notice)
        except RuntimeError as e:  # the worker was shut down
            logger.warning("notification to %s was lost: %s", peer.peer_id, e)
            return
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)

    def _notify(self, rpc_address: str, peer_base_address: int, notice: Any) -> None:
        result = self._engine.batch_transfer_sync(rpc_address, [self._scratch_address], [peer_base_address],
                                                  [1], self._read_opcode, notice)
        if result != 0:
            logger.warning("notification to %s was lost (Mooncake returned %s)", rpc_address, result)

    def _progress(self) -> list[tuple[PeerId, bytes]]:
        received = []
        for notice in self._engine.get_notifies():
            try:
                received.append((PeerId(notice.name), base64.b64decode(notice.msg, validate=True)))
            except (binascii.Error, ValueError):
                logger.warning("ignoring a Mooncake notification that is not ours, from %r", notice.name)
        return received

    def _shutdown(self) -> None:
        if self._engine is None:
            return
        running = set(self._in_flight)
        if running:
            _, still_running = wait_futures(running, timeout=self.read_timeout_s + 5.0)
            if still_running:
                logger.error("%d Mooncake reads still running at close: leaking the engine", len(still_running))
                # the engine may still write into the scratch buffer: keep both alive
                _LEAKED_ENGINES.append((self._engine, self._scratch_owner))
                self._engine = None
                return
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
        self._engine = None  # the engine stops with its last reference (and closes its CUDA IPC mappings)
        self._scratch_owner = None


def _cuda_scratch(device_id: int) -> Any:
    """A small buffer on the region's GPU (nvlink_intra registers GPU memory only; torch is here anyway, since a
    VRAM region is a CUDA tensor)."""
    import torch

    return torch.zeros(_NOTIFY_SCRATCH_BYTES, dtype=torch.uint8, device=f"cuda:{device_id}")


def _bind_cuda_device(device_id: int) -> None:
    """A worker thread's first act: Mooncake's CUDA calls (stream sync, IPC mapping) use the thread's current
    device, which is device 0 in a new thread."""
    import torch

    torch.cuda.set_device(device_id)
