"""The GPU half of the ipc backend: CUDA IPC through torch. Imported only when a GPU (VRAM) pool is in play.

P (the pool's owner): `export_pool` shares the storage under the KV pool once, with torch's own CUDA IPC
(`UntypedStorage._share_cuda_()`, what torch.multiprocessing sends for a CUDA tensor), and returns its fields as
a `CudaShare`: plain bytes and ints that travel in the envelope (never pickled).
D (the reader): `import_pool` maps a peer's pool once, at add_peer (`UntypedStorage._new_shared_cuda`, what
torch.multiprocessing's `rebuild_cuda_tensor` calls), as a uint8 [num_blocks, block_bytes] tensor on D's own GPU
(another GPU of the host is reached peer to peer); `CudaCopier.start` enqueues the read's block copies on a
dedicated stream (one kernel launch for any number of runs: kvtransfer/gpu_copy.py) and records an event, which
`poll` queries.

Fencing:
- P's writes: P synchronizes its KV writes before any ticket leaves it (it reads the first token on the host after
  the forward pass that wrote the prompt's blocks; the ticket is built after that), so the blocks a ticket names
  are in memory before D can read them; nothing here waits on P's streams.
- D's blocks: the copy stream first waits for D's current stream, so a kernel still writing to a block that was
  freed and handed to this read finishes first. D must not read its blocks until the event is done (DONE).
- Unmapping: a copy still running when its peer is removed, its read aborted or the connector closed is waited
  for (`synchronize`) before the mapping is dropped, so no copy touches unmapped memory and no byte lands after
  FAILED. GPU copies take milliseconds, so the wait is short.
Lifetime: each `_share_cuda_` counts one reader in torch's shared ref counter and each dropped mapping uncounts
one; P shares once, so with several readers the count goes below zero. That only matters when P frees the pool,
which P does when it exits; a read from a peer that closed or exited fails (its bytes are never used).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from kvtransfer.base import KVRegion
from kvtransfer.descriptors import BlockRuns
from kvtransfer.errors import BackendError, InvalidMetadataError, InvalidRequestError, PeerDisconnectedError
from kvtransfer.ipc_payload import CudaShare

# Pools registered in this process, by notification socket name: CUDA cannot map a process's own allocation
# through IPC, so a peer in the same process (two connectors of one process) is read through its tensor.
_LOCAL_POOLS: dict[str, weakref.ref[torch.Tensor]] = {}


def byte_view(storage: Any, offset_bytes: int, num_blocks: int, block_bytes: int, device: torch.device
              ) -> torch.Tensor:
    """The [num_blocks, block_bytes] uint8 tensor over `storage` from `offset_bytes`."""
    if offset_bytes < 0 or offset_bytes + num_blocks * block_bytes > storage.nbytes():
        raise InvalidRequestError(f"a region of {num_blocks} x {block_bytes} bytes at offset {offset_bytes} does not "
                                  f"fit in its {storage.nbytes()}-byte storage")
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, offset_bytes, (num_blocks, block_bytes), (block_bytes, 1))


def local_pool(region: KVRegion) -> torch.Tensor:
    """This process's pool as uint8 blocks, from the region's owning CUDA tensor."""
    owner = region.owner
    if not isinstance(owner, torch.Tensor) or owner.device.type != "cuda":
        raise InvalidRequestError("a GPU region for the ipc backend must be owned by a CUDA torch tensor "
                                  "(KVRegion.from_buffer(tensor))")
    if (owner.device.index or 0) != region.device_id:
        raise InvalidRequestError(f"the region says GPU {region.device_id}, its tensor is on {owner.device}")
    storage = owner.untyped_storage()
    return byte_view(storage, region.base_address - storage.data_ptr(), region.num_blocks, region.block_bytes,
                     owner.device)


def export_pool(region: KVRegion, pool: torch.Tensor, socket_name: str) -> CudaShare:
    """Shares `pool` (this process's `local_pool(region)`) through CUDA IPC, once."""
    storage = pool.untyped_storage()
    region_offset = region.base_address - storage.data_ptr()
    try:
        (device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = storage._share_cuda_()
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", f"cuda:{device}"))
    except (RuntimeError, ValueError, TypeError) as e:
        raise BackendError(f"torch could not share the GPU pool through CUDA IPC: {e} (with "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, older torch builds cannot)") from None
    if handle is None:
        raise BackendError("torch gave no CUDA IPC handle for the GPU pool (an empty storage?)")
    _LOCAL_POOLS[socket_name] = weakref.ref(pool)
    return CudaShare(bytes(handle), int(storage_bytes), int(storage_offset_bytes), bytes(ref_counter_handle),
                     int(ref_counter_offset), bytes(event_handle), bool(event_sync_required), region_offset, uuid)


def forget_local_pool(socket_name: str) -> None:
    _LOCAL_POOLS.pop(socket_name, None)


def import_pool(share: CudaShare, *, same_process: bool, socket_name: str, device_id: int, num_blocks: int,
                block_bytes: int) -> torch.Tensor:
    """A peer's pool as uint8 [num_blocks, block_bytes] blocks, mapped on our GPU `device_id`."""
    if same_process:
        pool = _LOCAL_POOLS.get(socket_name, lambda: None)()
        if pool is None:
            raise PeerDisconnectedError("the peer (a connector of this same process) has closed")
        return pool
    if share.region_offset_bytes + num_blocks * block_bytes > share.storage_bytes:
        raise InvalidMetadataError(f"the peer's region ({num_blocks} x {block_bytes} bytes at offset "
                                   f"{share.region_offset_bytes}) does not fit in its shared storage of "
                                   f"{share.storage_bytes} bytes")
    device = torch.device("cuda", device_id)
    try:
        torch.cuda.init()
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device_id, share.handle, share.storage_bytes, share.storage_offset_bytes, share.ref_counter_handle,
                share.ref_counter_offset, share.event_handle, share.event_sync_required)
    except (RuntimeError, ValueError, TypeError) as e:
        raise BackendError(f"mapping the peer's GPU pool (GPU {share.device_uuid}) through CUDA IPC failed: "
                           f"{e}") from None
    return byte_view(storage, share.region_offset_bytes, num_blocks, block_bytes, device)


def copy_runs(local: torch.Tensor, remote: torch.Tensor, runs: BlockRuns) -> None:
    """local[l : l + n] = remote[r : r + n] for every run (r, l, n), in one kernel launch on the current stream
    (kvtransfer/gpu_copy.py says why not one copy per run)."""
    from kvtransfer.gpu_copy import copy_blocks  # triton: only once a GPU pool is read

    remote_ids, local_ids = runs.block_indices()
    ids = torch.from_numpy(np.stack((local_ids, remote_ids))).to(local.device, non_blocking=True)
    copy_blocks(local, remote, ids[0], ids[1])


class CudaCopier:
    """Copies peers' blocks into this process's pool on a stream of its own."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)

    def start(self, remote: torch.Tensor, runs: BlockRuns) -> torch.cuda.Event:
        """Enqueues the runs' copies after the work already queued on our current stream; returns their event."""
        try:
            with torch.cuda.device(self.pool.device):
                self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
                with torch.cuda.stream(self.stream):
                    copy_runs(self.pool, remote, runs)
                event = torch.cuda.Event()
                event.record(self.stream)
        except RuntimeError as e:
            raise BackendError(f"enqueuing the GPU copies failed: {e}") from None
        return event

    def synchronize(self) -> None:
        """Waits for every copy enqueued so far."""
        self.stream.synchronize()
