"""NIXL backend (UCX): one-sided READs between registered regions, host (DRAM) or GPU (VRAM) memory.

How it maps the contract (NIXL 1.5.1, `from nixl._api import nixl_agent`):
- register: `register_memory` of the whole pool, then a *prepared* per-block descriptor list of it
  (`prep_xfer_dlist`), so a read only picks indices. The agent metadata (`get_agent_metadata`) is the payload.
- add_peer: `add_remote_agent(payload)`, then a prepared per-block list of the peer's pool (from the envelope's
  geometry).
- read: `make_prepped_xfer("READ", local, local_indices, remote, remote_indices)` with the indices in coalesced
  run order: NIXL merges adjacent entries, so each run travels as one descriptor. `transfer` posts it,
  `check_xfer_state` polls it.
- notify: `send_notif`; notifications arrive through `get_new_notifs`, which is also what makes progress.

No progress thread (it busy-polls a core) and no listener thread (metadata travels in our envelopes): the owning
loop calls `progress()`, which the memory owner must do for a peer's first read to complete.

Transport settings come in through the API, never through `os.environ`, as the UCX backend's own parameters:
- `ucx_devices` (UCX_NET_DEVICES' equivalent; None lets UCX pick the NICs, as a real cluster wants; "lo" for one
  machine);
- `ucx_config`, UCX settings 'KEY=VALUE,...' (NIXL's `engine_config`; see kvtransfer/ucx_config.py), on top of a
  default chosen by the pool's memory kind: a VRAM pool gets `CUDA_IPC_ENABLE_GET_ZCOPY=y`, without which READs
  between GPUs that NVML reports without NVLink crawl through UCX's TCP emulation. The memory kind is known only
  at `register`, so the UCX backend is created there. Items UCX refuses are errors here (NIXL would ignore them).
What UCX and NIXL read only from the environment (UCX_MODULES, list values such as UCX_TLS=a,b, NIXL_LOG_LEVEL...)
is the launcher's to set when it starts the process: `tandem serve` starts single-machine nodes with
`UCX_MODULES=^ib` (with Debian's ibverbs providers installed, every UCX process crashes at exit without it), tests
likewise. A UCX_<KEY> variable there beats the same key in `ucx_config` (NIXL's rule).

Descriptors (verified on 1.5.1 with NIXL's transfer telemetry, tests/kvtransfer/test_nixl_options.py):
`make_prepped_xfer` merges consecutive index pairs of dense per-block lists, so the run-ordered indices of
`BlockRuns.block_indices` become exactly one descriptor per run; no run-level descriptor lists are needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.base import KVRegion, MemoryKind, PeerId, TransferStatus
from kvtransfer.common import BlockConnector, Peer
from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import (
    BackendError,
    InvalidMetadataError,
    InvalidRequestError,
    PeerDisconnectedError,
    TransferError,
)
from kvtransfer.handshake import KVLayout, PeerEnvelope
from kvtransfer.ucx_config import (
    UcxConfig,
    default_ucx_config,
    loaded_ucp_library,
    nixl_backend_params,
    parse_ucx_config,
    refused_items,
)

logger = logging.getLogger(__name__)

def block_descriptors(base_address: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] uint64 rows (address, length, device id): one descriptor per block."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows


def _translate(error: Exception, action: str) -> TransferError:
    """NIXL raises its own exception classes (nixlRemoteDisconnectError, ...); map them to ours by name."""
    if "Disconnect" in type(error).__name__:
        return PeerDisconnectedError(f"{action}: the peer disconnected ({error})")
    return BackendError(f"{action}: NIXL {type(error).__name__}: {error}")


@dataclass
class _NixlPeer:
    name: str
    remote_blocks: Any  # nixl_prepped_dlist_handle over the peer's blocks


@dataclass
class _NixlRead:
    xfer: Any  # nixl_xfer_handle
    finished: bool = False


class NixlConnector(BlockConnector):
    backend_name = "nixl"
    supported_memory_kinds = frozenset({MemoryKind.DRAM, MemoryKind.VRAM})

    def __init__(self, *, layout: KVLayout, agent_name: str | None = None, read_timeout_s: float = 30.0,
                 ucx_devices: str | None = None, ucx_config: str | None = None) -> None:
        """`ucx_devices`: the devices UCX may use ("lo", "mlx5_0:1,mlx5_1:1"); None: all it finds.
        `ucx_config`: UCX settings 'KEY=VALUE,...' on top of the memory kind's default (None: the default only)."""
        super().__init__(layout=layout, agent_name=agent_name, read_timeout_s=read_timeout_s)
        if ucx_devices is not None and (not isinstance(ucx_devices, str) or not ucx_devices.strip()):
            raise InvalidRequestError(f"ucx_devices must be a non-empty device list or None, got {ucx_devices!r}")
        self._ucx_devices = ucx_devices
        self._ucx_settings = parse_ucx_config(ucx_config) if ucx_config is not None else UcxConfig()
        self._backend_params: dict[str, str] | None = None  # once the UCX backend exists (at register)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise BackendError(f"NIXL is not installed ({e}): pip install nixl==1.5.1") from None
        # the UCX backend is created at register, with its parameters (the agent config cannot carry them)
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        try:
            self._agent: Any = nixl_agent(self.agent_name, config)
            if "UCX" not in self._agent.get_plugin_list():
                raise BackendError("NIXL's UCX plugin is missing")
        except TransferError:
            raise
        except Exception as e:
            raise _translate(e, "creating the NIXL agent") from None
        self._registration: Any = None
        self._local_blocks: Any = None
        self._uncancelled: list[Any] = []  # xfer handles NIXL could not cancel yet; released again later

    @property
    def backend_params(self) -> dict[str, str] | None:
        """The parameters the UCX backend was created with, as NIXL reports them (None before `register`)."""
        return dict(self._backend_params) if self._backend_params is not None else None

    def _create_backend(self, memory_kind: MemoryKind) -> None:
        defaults = default_ucx_config(memory_kind)
        settings = self._ucx_settings.over(defaults)
        try:
            self._agent.get_plugin_params("UCX")  # loads the plugin, and with it the libucp it was built with
            library = loaded_ucp_library()
            refused = refused_items(settings, library) if library and settings.items else []
        except TransferError:
            raise
        except Exception as e:
            raise _translate(e, "checking the UCX settings") from None
        if refused and library is not None:
            given = [item for item in refused if item.partition("=")[0] in self._ucx_settings.keys]
            if given:
                raise InvalidRequestError(
                    f"UCX ({library}) refuses the UCX setting(s) {', '.join(given)}: an unknown key, a key of a "
                    "transport module not loaded on this machine (CUDA_IPC_* without CUDA, IB_* without "
                    "InfiniBand), or a bad value; NIXL would ignore them silently")
            logger.warning("UCX refuses the default setting(s) %s for %s memory here (no such transport module?): "
                           "they have no effect", ", ".join(refused), memory_kind.value)
        params = nixl_backend_params(settings, self._ucx_devices)
        try:
            self._agent.create_backend("UCX", params)
            self._backend_params = dict(self._agent.get_backend_params("UCX"))
        except Exception as e:
            raise _translate(e, f"creating NIXL's UCX backend with {params}") from None
        logger.info("NIXL UCX backend for %s memory: %s", memory_kind.value, params)

    def _register_region(self, region: KVRegion) -> bytes:
        if self._backend_params is None:
            self._create_backend(region.memory_kind)
        memory_kind = region.memory_kind.value
        try:
            self._registration = self._agent.register_memory(
                [(region.base_address, region.num_bytes, region.device_id, "")], memory_kind)
            self._local_blocks = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_descriptors(region.base_address, region.num_blocks, region.block_bytes,
                                                     region.device_id), memory_kind)
            return bytes(self._agent.get_agent_metadata())
        except Exception as e:
            raise _translate(e, "registering the KV region") from None

    def _connect_peer(self, envelope: PeerEnvelope) -> _NixlPeer:
        try:
            loaded = self._agent.add_remote_agent(envelope.payload)
        except Exception as e:
            raise InvalidMetadataError(f"NIXL rejected the peer's agent metadata: {type(e).__name__}: {e}") from None
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if name != envelope.agent_name:
                raise InvalidMetadataError(f"the NIXL metadata names agent {name!r}, the envelope "
                                           f"{envelope.agent_name!r}")
            remote_blocks = self._agent.prep_xfer_dlist(
                name, block_descriptors(envelope.base_address, envelope.num_blocks, envelope.block_bytes,
                                        envelope.device_id), envelope.memory_kind.value)
        except Exception as e:
            self._agent.remove_remote_agent(name)
            if isinstance(e, TransferError):
                raise
            raise _translate(e, "preparing the peer's blocks") from None
        return _NixlPeer(name, remote_blocks)

    def _disconnect_peer(self, peer: Peer) -> None:
        state: _NixlPeer = peer.state
        state.remote_blocks.release()
        self._agent.remove_remote_agent(state.name)

    def _start_read(self, peer: Peer, runs: BlockRuns) -> _NixlRead:
        remote_indices, local_indices = runs.block_indices()
        try:
            xfer = self._agent.make_prepped_xfer("READ", self._local_blocks, local_indices.astype(np.int32),
                                                 peer.state.remote_blocks, remote_indices.astype(np.int32))
        except Exception as e:
            raise _translate(e, "preparing the read") from None
        try:
            state = self._agent.transfer(xfer)
        except Exception as e:
            self._release(xfer)
            raise _translate(e, "posting the read") from None
        if state == "ERR":
            self._release(xfer)
            raise BackendError("NIXL could not post the read")
        read = _NixlRead(xfer)
        if state == "DONE":
            self._complete(read)
        return read

    def _check_read(self, state: _NixlRead) -> tuple[TransferStatus, str | None]:
        if state.finished:
            return TransferStatus.DONE, None
        try:
            xfer_state = self._agent.check_xfer_state(state.xfer)
        except Exception as e:
            self._release(state.xfer)
            return TransferStatus.FAILED, str(_translate(e, "reading"))
        if xfer_state == "PROC":
            return TransferStatus.PENDING, None
        if xfer_state == "DONE":
            self._complete(state)
            return TransferStatus.DONE, None
        self._release(state.xfer)
        return TransferStatus.FAILED, "NIXL reported an error on the read"

    def _abort_read(self, state: _NixlRead) -> None:
        # Nothing to do: UCX cannot cancel a GET, and releasing the transfer would only orphan it (its bytes keep
        # landing, and we could no longer tell when they stop). `_check_read` releases it once it is over.
        pass

    def _discard_read(self, state: _NixlRead) -> None:
        if not state.finished:  # at close: the agent goes next, and with it the worker that lands the bytes
            self._release(state.xfer)

    def _send_notification(self, peer: Peer, message: bytes) -> None:
        try:
            self._agent.send_notif(peer.state.name, message)
        except Exception as e:
            logger.warning("notification to %s was lost: %s", peer.peer_id, _translate(e, "notifying"))

    def _progress(self) -> list[tuple[PeerId, bytes]]:
        if self._uncancelled:
            pending, self._uncancelled = self._uncancelled, []
            for xfer in pending:
                self._release(xfer)
        if self._backend_params is None:  # nothing registered yet: no backend to make progress on
            return []
        try:
            notifications = self._agent.get_new_notifs()
        except Exception as e:
            logger.warning("NIXL progress failed: %s", _translate(e, "progress"))
            return []
        return [(PeerId(name.decode() if isinstance(name, bytes) else name), bytes(message))
                for name, messages in notifications.items() for message in messages]

    def _shutdown(self) -> None:
        for xfer in self._uncancelled:
            self._release(xfer)
        if self._local_blocks is not None:
            self._local_blocks.release()
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
        # Every NIXL handle object refers to the agent, which is destroyed (and its peers told) only with its last
        # reference: drop them all, or a closed connector would leave peers' reads hanging until their timeout.
        self._uncancelled, self._local_blocks, self._registration, self._agent = [], None, None, None

    def _complete(self, read: _NixlRead) -> None:
        read.finished = True
        self._release(read.xfer)

    def _release(self, xfer: Any) -> None:
        try:
            xfer.release()
        except Exception as e:  # NIXL could not cancel a transfer in flight: try again on the next progress
            logger.debug("NIXL transfer release deferred: %s", e)
            self._uncancelled.append(xfer)
