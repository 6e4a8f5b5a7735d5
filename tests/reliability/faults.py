"""Transfer faults injected through the connector contract (kvtransfer.base.Connector), never through a production
code path: `FaultyConnector` wraps a node's real connector and, per READ, as a `FaultPlan` says,

- corrupts it: the real read runs, and once it is DONE one byte of each pulled block is flipped in the local pool
  (what a bad NIC, a torn write or a peer reusing its blocks would leave there);
- drops it: the read is never issued and reports FAILED (what a lost peer or a transport error reports);
- delays it: the real read is issued only `delay_s` after `read()` (the handle is PENDING until then), so that a
  prefill node killed in that window dies with the transfer in flight.

The plan is a small JSON file the test writes (`FaultPlan.write`); the connector reads it again whenever the file
changes, so one node serves a whole test session, faults switched on and off between scenarios. Every injected
fault is logged at WARNING ("fault injected: ...") so that a test can tell that its fault really happened.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtransfer.base import Connector, KVRegion, PeerId, TransferHandle, TransferStatus

logger = logging.getLogger("tests.reliability.faults")

FAULT_LOG_MARK = "fault injected:"


@dataclass(frozen=True)
class FaultPlan:
    corrupt_share: float = 0.0  # of reads whose pulled blocks get a flipped byte
    drop_share: float = 0.0  # of reads never issued, reported FAILED
    delay_s: float = 0.0  # every read is issued this long after read()
    seed: int = 0

    def write(self, path: Path) -> None:
        """Atomically, so that the node never reads half a plan."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> FaultPlan:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return cls()


@dataclass
class _Read:
    """One READ as the caller sees it: issued on the inner connector now, later (delayed), or never (dropped)."""

    peer: PeerId
    remote_block_ids: list[int]
    local_block_ids: list[int]
    issue_at: float
    corrupt: bool
    dropped: bool
    inner: TransferHandle | None = None
    status: TransferStatus = TransferStatus.PENDING
    reason: str | None = None


class FaultyConnector(Connector):
    """The real connector, with the faults of the plan in `plan_path` injected into its reads."""

    def __init__(self, inner: Connector, plan_path: Path, region: KVRegion | None = None) -> None:
        """`region`: the pool `inner` already registered (a node opens and registers its connector in one call)."""
        self.inner = inner
        self.backend_name = inner.backend_name
        self.plan_path = plan_path
        self._plan = FaultPlan()
        self._plan_mtime: float | None = None
        self._random = random.Random(0)
        self._region = region
        self._reads: dict[int, _Read] = {}
        self._next_id = 1 << 40  # far from the inner connector's transfer ids

    @property
    def agent_name(self) -> PeerId:
        return self.inner.agent_name

    def register(self, region: KVRegion) -> bytes:
        self._region = region
        return self.inner.register(region)

    def add_peer(self, metadata: bytes) -> PeerId:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: PeerId) -> None:
        self.inner.remove_peer(peer)
        for read in self._reads.values():  # reads not issued yet end as the contract says
            if read.peer == peer and read.inner is None and read.status is TransferStatus.PENDING:
                read.status, read.reason = TransferStatus.FAILED, f"peer {peer} was removed"

    def read(self, peer: PeerId, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        plan = self._current_plan()
        corrupt = self._random.random() < plan.corrupt_share
        dropped = not corrupt and self._random.random() < plan.drop_share
        read = _Read(peer, list(remote_block_ids), list(local_block_ids), time.monotonic() + plan.delay_s, corrupt,
                     dropped)
        if dropped:
            read.status, read.reason = TransferStatus.FAILED, "the read was dropped (fault injection)"
            logger.warning("%s dropped a read of %d blocks from %s", FAULT_LOG_MARK, len(local_block_ids), peer)
        elif plan.delay_s <= 0:
            read.inner = self.inner.read(peer, remote_block_ids, local_block_ids)
        else:
            logger.warning("%s delayed a read of %d blocks from %s by %.1f s", FAULT_LOG_MARK, len(local_block_ids),
                           peer, plan.delay_s)
        handle = TransferHandle(self._next_id, peer, len(read.local_block_ids), len(read.local_block_ids),
                                len(read.local_block_ids) * (self._region.block_bytes if self._region else 0))
        self._next_id += 1
        self._reads[handle.transfer_id] = read
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        read = self._reads[handle.transfer_id]
        if read.status is not TransferStatus.PENDING:
            return read.status
        if read.inner is None:
            if time.monotonic() < read.issue_at:
                return TransferStatus.PENDING
            # raises as the inner connector's read would (an unknown peer, a closed connector)
            read.inner = self.inner.read(read.peer, read.remote_block_ids, read.local_block_ids)
        status = self.inner.poll(read.inner)
        if status is TransferStatus.DONE and read.corrupt:
            self._flip_one_byte_per_block(read.local_block_ids)
            logger.warning("%s corrupted a read of %d blocks from %s", FAULT_LOG_MARK, len(read.local_block_ids),
                           read.peer)
        if status is TransferStatus.FAILED:
            read.reason = self.inner.failure_reason(read.inner)
        read.status = status
        return status

    def failure_reason(self, handle: TransferHandle) -> str | None:
        read = self._reads.get(handle.transfer_id)
        return None if read is None else read.reason

    def notify(self, peer: PeerId, message: bytes) -> None:
        self.inner.notify(peer, message)

    def get_notifications(self) -> list[tuple[PeerId, bytes]]:
        return self.inner.get_notifications()

    def progress(self) -> None:
        self.inner.progress()
        if len(self._reads) > 4096:  # finished reads are remembered a while, as the contract asks; then forgotten
            for transfer_id in [t for t, r in self._reads.items() if r.status is not TransferStatus.PENDING][:2048]:
                del self._reads[transfer_id]

    def close(self) -> None:
        self.inner.close()

    def _current_plan(self) -> FaultPlan:
        try:
            mtime = self.plan_path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime != self._plan_mtime:
            self._plan_mtime = mtime
            self._plan = FaultPlan.read(self.plan_path)
            self._random = random.Random(self._plan.seed)
            logger.warning("fault plan now %s", self._plan)
        return self._plan

    def _flip_one_byte_per_block(self, block_ids: list[int]) -> None:
        assert self._region is not None, "a read before register()"
        for block_id in block_ids:
            byte = ctypes.c_ubyte.from_address(self._region.block_address(block_id) + self._region.block_bytes // 2)
            byte.value ^= 0xFF
