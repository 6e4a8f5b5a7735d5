"""The host tier's bytes: slots shaped like the KV pool's blocks (engine/cache/host_tier.py is their index).

On a GPU node the slots are pinned, so that a spill (pool -> slot) and a load (slot -> pool) are asynchronous copies
on the step's stream: the host does not wait for them, and stream order puts them after the last step that wrote
the spilled block and before the first that reads the loaded one. The host itself touches a slot's bytes only for
the cluster store (`read`, `write`), after waiting for the stream.
"""

from __future__ import annotations

import torch

from engine.cache.kv_cache_manager import KVCopies


class HostKVPool:
    def __init__(self, num_slots: int, pool: torch.Tensor) -> None:
        """`pool`: the KV pool, [num_blocks, ...] block-major (engine/runner.py kv_cache)."""
        self.pool = pool
        self.on_gpu = pool.device.type == "cuda"
        self.slots = torch.empty((num_slots, *pool.shape[1:]), dtype=pool.dtype, pin_memory=self.on_gpu)
        self.block_bytes = self.slots[0].numel() * self.slots.element_size()

    @property
    def num_bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def run(self, copies: KVCopies) -> None:
        """Spills, then loads, in the order planned (a block spilled may be loaded into right after)."""
        for block_id, slot in copies.spills:
            self.slots[slot].copy_(self.pool[block_id], non_blocking=self.on_gpu)
        for slot, block_id in copies.loads:
            self.pool[block_id].copy_(self.slots[slot], non_blocking=self.on_gpu)

    def sync(self) -> None:
        """Waits for the copies issued so far (a GPU's stream): before the host reads or writes a slot, or
        before a transfer library writes pool blocks outside the stream's order."""
        if self.on_gpu:
            torch.cuda.current_stream(self.pool.device).synchronize()

    def read(self, slot: int) -> bytes:
        return _as_bytes(self.slots[slot])

    def write(self, slot: int, data: bytes | memoryview) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"a KV block here is {self.block_bytes} bytes, got {len(data)}")
        self.slots[slot].view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def read_block(self, block_id: int) -> bytes:
        """A pool block's bytes (copied off the GPU: the caller has synchronized)."""
        return _as_bytes(self.pool[block_id])


def _as_bytes(block: torch.Tensor) -> bytes:
    flat = block.contiguous().view(-1).view(torch.uint8)
    return bytes(flat.cpu().numpy().tobytes())
