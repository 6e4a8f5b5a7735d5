"""A node's KV pool over its tensor-parallel ranks, as one Connector, and its blocks' checksums.

Each rank registers its own slice of the KV pool with its own transfer agent, as a region of *head units* (one KV
head of one block, all layers, contiguous: the pool is head-major within a block, engine/layers/attention.py), so
block `b`'s local head `j` is unit `b * rank_heads + j`. A node's metadata is the rank set of its ranks' envelopes
(kvtransfer/handshake.py).

A decode node pulls a ticket's blocks rank by rank: each of its ranks reads the heads it owns from the prefill ranks
that hold them (the first holder, when KV heads are replicated), as unit runs. Same TP sizes: a rank's units of a
run of blocks are one run (one descriptor, as before). Different TP sizes: one descriptor per block and peer rank
(a rank's heads are a contiguous part of each block on both sides, but the next block's part is not adjacent).
A peer whose ranks do not hold every head a rank here needs is refused with the heads it lacks.

A block's checksum is over its head units in global head order: the algorithm's checksum of each unit, computed
by the rank that holds it, combined by rank 0 (`"<algorithm>:<blake2b of the unit checksums>"`), so that a node of
any TP size computes the same value for the same bytes.

Rank 0 drives the other ranks through the engine's `call_ranks` (on the engine thread, between steps); the
functions named `_rank_*` run on every rank. A worker rank's agent is kept progressing by a thread of its own
(the memory owner must progress for a peer's reads to complete: docs/environment.md#ucx-and-nixl).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.llm_engine import LLMEngine
from kvtransfer import KVLayout, KVRegion, make_connector
from kvtransfer.base import Connector, PeerId, TransferHandle, TransferStatus
from kvtransfer.checksum import checksum_algorithm, default_checksum_algorithm, kv_block_checksums
from kvtransfer.descriptors import validate_block_ids
from kvtransfer.errors import IncompatiblePeerError, InvalidRequestError, UnknownPeerError, UnknownTransferError
from kvtransfer.handshake import PeerEnvelope, decode_rank_set, encode_rank_set

logger = logging.getLogger(__name__)

_MODULE = "node_common.sharded_kv"
_PROGRESS_INTERVAL_S = 0.001


@dataclass
class _RankKV:
    """One rank's agent and region (in its rank_state["kv"])."""

    connector: Connector
    region: KVRegion
    layout: KVLayout
    lock: threading.Lock
    stop: threading.Event


def _rank_open(state: dict[str, Any], backend: str, host: str, name: str, options: dict[str, Any],
               base: dict[str, Any]) -> bytes:
    runner = state["runner"]
    parallel, split = runner.parallel, runner.head_split
    layout = KVLayout(**base, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, kv_head_start=split.kv_start,
                      num_rank_kv_heads=split.num_kv_heads)
    agent_name = name if parallel.tp_rank == 0 else f"{name}-tp{parallel.tp_rank}"
    connector = make_connector(backend, layout=layout, agent_name=agent_name, host=host, **options)
    region = KVRegion.from_buffer(runner.kv_cache, num_blocks=runner.num_blocks * split.num_kv_heads)
    # a GPU pool's checksums run a Triton kernel: compile it now, not on the first request's ticket
    kv_block_checksums(region, [0])
    metadata = connector.register(region)
    kv = _RankKV(connector, region, layout, threading.Lock(), threading.Event())
    state["kv"] = kv
    if parallel.tp_rank != 0:  # rank 0's node loop makes progress; a worker has no loop of its own between steps
        threading.Thread(target=_progress_loop, args=(kv,), daemon=True, name="kv-progress").start()
    return metadata


def _progress_loop(kv: _RankKV) -> None:
    while not kv.stop.is_set():
        with kv.lock:
            try:
                kv.connector.progress()
            except Exception:  # noqa: BLE001 - a closed connector: the loop ends with it
                return
        time.sleep(_PROGRESS_INTERVAL_S)


def _rank_add_peers(state: dict[str, Any], plan: dict[int, dict[int, list[int]]], envelopes: list[bytes]
                    ) -> dict[int, PeerId]:
    """Adds the peer ranks this rank reads from; {peer rank: its PeerId here}."""
    kv: _RankKV = state["kv"]
    with kv.lock:
        return {p: kv.connector.add_peer(envelopes[p]) for p in plan.get(kv.layout.tp_rank, {})}


def _rank_read(state: dict[str, Any], reads: dict[int, list[tuple[PeerId, np.ndarray, np.ndarray]]]
               ) -> list[TransferHandle]:
    kv: _RankKV = state["kv"]
    with kv.lock:
        # numpy ids: every backend takes them (kvtransfer.descriptors.BlockIds), though the contract names sequences
        return [kv.connector.read(peer, remote, local)  # type: ignore[arg-type]
                for peer, remote, local in reads.get(kv.layout.tp_rank, [])]


def _rank_poll(state: dict[str, Any], handles: dict[int, list[TransferHandle]]) -> list[tuple[str, str | None]]:
    kv: _RankKV = state["kv"]
    out = []
    with kv.lock:
        for handle in handles.get(kv.layout.tp_rank, []):
            status = kv.connector.poll(handle)
            out.append((status.value, kv.connector.failure_reason(handle)))
    return out


def _rank_remove_peers(state: dict[str, Any], peers: dict[int, list[PeerId]]) -> None:
    kv: _RankKV = state["kv"]
    with kv.lock:
        for peer in peers.get(kv.layout.tp_rank, []):
            try:
                kv.connector.remove_peer(peer)
            except UnknownPeerError:
                pass


def _rank_unit_checksums(state: dict[str, Any], block_ids: list[int], algorithm: str) -> tuple[int, list[str]]:
    """(first KV head held here, the checksum of each held head unit of each block, block by block)."""
    kv: _RankKV = state["kv"]
    heads = kv.layout.rank_kv_heads
    units = [b * heads + j for b in block_ids for j in range(heads)]
    return kv.layout.kv_head_start, kv_block_checksums(kv.region, units, algorithm)


def _rank_close(state: dict[str, Any]) -> None:
    kv: _RankKV | None = state.pop("kv", None)
    if kv is not None:
        kv.stop.set()
        with kv.lock:
            kv.connector.close()


# ---- rank 0 -------------------------------------------------------------------------------------------------------

def _combine(algorithm: str, unit_checksums: Sequence[str]) -> str:
    digest = hashlib.blake2b("\n".join(unit_checksums).encode(), digest_size=16).hexdigest()
    return f"{algorithm}:{digest}"


def block_checksums(engine: LLMEngine, block_ids: Sequence[int], algorithm: str | None = None) -> tuple[str, ...]:
    """One checksum per block over its head units in global head order (see the module docstring); on the
    engine thread."""
    if not block_ids:
        return ()
    algorithm = algorithm or default_checksum_algorithm(KVRegion.from_buffer(engine.kv_cache))
    results = engine.call_ranks(f"{_MODULE}:_rank_unit_checksums", list(block_ids), algorithm)
    num_heads = engine.model_config.num_kv_heads
    per_head: list[list[str] | None] = [None] * num_heads  # per global head: the unit checksum of each block
    for head_start, checksums in results:
        rank_heads = len(checksums) // len(block_ids)
        for j in range(rank_heads):
            if per_head[head_start + j] is None:  # a replicated head: the first rank holding it
                per_head[head_start + j] = checksums[j::rank_heads]
    assert all(h is not None for h in per_head), "the ranks hold every KV head"
    return tuple(_combine(algorithm, [per_head[g][i] for g in range(num_heads)])  # type: ignore[index]
                 for i in range(len(block_ids)))


def mismatched_blocks(engine: LLMEngine, block_ids: Sequence[int], expected: Sequence[str]) -> list[int]:
    """The blocks whose bytes do not match their expected checksum (each with the algorithm it names)."""
    if len(block_ids) != len(expected):
        raise InvalidRequestError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    by_algorithm: dict[str, list[int]] = {}
    for position, checksum in enumerate(expected):
        by_algorithm.setdefault(checksum_algorithm(checksum), []).append(position)
    bad = []
    for algorithm, positions in by_algorithm.items():
        actual = block_checksums(engine, [block_ids[p] for p in positions], algorithm)
        bad += [p for p, checksum in zip(positions, actual, strict=True) if checksum != expected[p]]
    return [int(block_ids[p]) for p in sorted(bad)]


@dataclass(frozen=True)
class _PeerNode:
    metadata: bytes
    layouts: list[KVLayout]  # per peer rank
    plan: dict[int, dict[int, list[int]]]  # our rank -> peer rank -> the global heads it reads from there
    peer_ids: dict[int, dict[int, PeerId]]  # our rank -> peer rank -> PeerId on our rank's agent


def plan_reads(ours: list[KVLayout], theirs: list[KVLayout], peer_name: str) -> dict[int, dict[int, list[int]]]:
    """Which heads each of our ranks reads from which peer rank (the first peer rank holding a head);
    IncompatiblePeerError naming the missing heads when the peer's ranks do not hold all a rank needs."""
    plan: dict[int, dict[int, list[int]]] = {}
    for layout in ours:
        needed = range(layout.kv_head_start, layout.kv_head_start + layout.rank_kv_heads)
        for head in needed:
            source = next((p.tp_rank for p in theirs
                           if p.kv_head_start <= head < p.kv_head_start + p.rank_kv_heads), None)
            if source is None:
                held = sorted({h for p in theirs for h in range(p.kv_head_start, p.kv_head_start + p.rank_kv_heads)})
                raise IncompatiblePeerError(
                    f"refusing peer {peer_name!r}: its {len(theirs)} rank(s) hold KV heads {held} of "
                    f"{layout.num_kv_heads}; rank {layout.tp_rank} of {layout.tp_size} here needs "
                    f"{list(needed)} (a split no rank set of the peer covers)")
            plan.setdefault(layout.tp_rank, {}).setdefault(source, []).append(head)
    return plan


def unit_ids(block_ids: Sequence[int] | np.ndarray, heads: Sequence[int], head_start: int, rank_heads: int
             ) -> np.ndarray:
    """The head units of `heads` (global ids) of each block, on a rank holding `rank_heads` heads from
    `head_start`: block by block, heads in order (vectorised: a long prompt's thousands of blocks cost microseconds
    on the handoff's path)."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    local_heads = np.asarray(heads, dtype=np.int64) - head_start
    return (blocks[:, None] * rank_heads + local_heads[None, :]).reshape(-1)


class ShardedConnector(Connector):
    """The node's connector: every rank's agent behind the Connector contract (block ids in, per-rank unit reads
    out). Must be used on the engine thread (its calls to the other ranks pair with theirs between steps)."""

    def __init__(self, engine: LLMEngine, backend: str, host: str, name: str, options: dict[str, Any],
                 base_layout: dict[str, Any]) -> None:
        self.engine = engine
        self.backend_name = backend
        self._name = PeerId(name)
        envelopes = engine.call_ranks(f"{_MODULE}:_rank_open", backend, host, name, options, base_layout)
        self._layouts = [PeerEnvelope.decode(e).layout for e in envelopes]
        self.metadata = encode_rank_set(envelopes)
        self._peers: dict[PeerId, _PeerNode] = {}
        self._reads: dict[int, tuple[TransferHandle, dict[int, list[TransferHandle]]]] = {}
        self._finished: dict[int, tuple[TransferStatus, str | None]] = {}
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def layout(self) -> KVLayout:
        """Rank 0's layout (its pairing_hash is the node's)."""
        return self._layouts[0]

    @property
    def agent_name(self) -> PeerId:
        return self._name

    def register(self, region: KVRegion) -> bytes:
        raise InvalidRequestError("a sharded connector registers every rank's pool when it is made")

    def add_peer(self, metadata: bytes) -> PeerId:
        parts = decode_rank_set(metadata)
        layouts = [PeerEnvelope.decode(part).layout for part in parts]
        peer_id = PeerId(PeerEnvelope.decode(parts[0]).agent_name)
        known = self._peers.get(peer_id)
        if known is not None and known.metadata == bytes(metadata):
            return peer_id
        if [layout.tp_rank for layout in layouts] != list(range(len(layouts))) or any(
                layout.tp_size != len(layouts) for layout in layouts):
            raise IncompatiblePeerError(f"refusing peer {peer_id!r}: its metadata is not one envelope per rank of "
                                        f"its TP size, in rank order")
        plan = plan_reads(self._layouts, layouts, peer_id)
        if known is not None:  # the peer re-registered (restarted): its old ranks go first
            self.remove_peer(peer_id)
        added = self.engine.call_ranks(f"{_MODULE}:_rank_add_peers", plan, parts)
        self._peers[peer_id] = _PeerNode(bytes(metadata), layouts, plan, dict(enumerate(added)))
        return peer_id

    def remove_peer(self, peer: PeerId) -> None:
        node = self._peers.pop(peer, None)
        if node is None:
            raise UnknownPeerError(f"unknown peer {peer!r}")
        self.engine.call_ranks(f"{_MODULE}:_rank_remove_peers",
                               {rank: list(ids.values()) for rank, ids in node.peer_ids.items()})

    def read(self, peer: PeerId, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        node = self._peers.get(peer)
        if node is None:
            raise UnknownPeerError(f"unknown peer {peer!r}: add_peer it first")
        # remote ids are checked against each peer rank's region by the rank agent that reads it (as head units)
        remote, local = validate_block_ids(remote_block_ids, local_block_ids, num_remote_blocks=1 << 62,
                                           num_local_blocks=self.engine.num_kv_blocks)
        reads: dict[int, list[tuple[PeerId, np.ndarray, np.ndarray]]] = {}
        for ours in self._layouts:
            for source, heads in node.plan.get(ours.tp_rank, {}).items():
                theirs = node.layouts[source]
                reads.setdefault(ours.tp_rank, []).append((
                    node.peer_ids[ours.tp_rank][source],
                    unit_ids(remote, heads, theirs.kv_head_start, theirs.rank_kv_heads),
                    unit_ids(local, heads, ours.kv_head_start, ours.rank_kv_heads)))
        handles = self.engine.call_ranks(f"{_MODULE}:_rank_read", reads)
        by_rank = dict(enumerate(handles))
        parts = [h for rank_handles in handles for h in rank_handles]
        handle = TransferHandle(next(self._ids), peer, len(remote), sum(h.num_descriptors for h in parts),
                                sum(h.num_bytes for h in parts))
        self._reads[handle.transfer_id] = (handle, by_rank)
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        finished = self._finished.get(handle.transfer_id)
        if finished is not None:
            return finished[0]
        record = self._reads.get(handle.transfer_id)
        if record is None or record[0] != handle:
            raise UnknownTransferError(f"transfer {handle.transfer_id} was not issued by this connector")
        results = [r for rank in self.engine.call_ranks(f"{_MODULE}:_rank_poll", record[1]) for r in rank]
        statuses = [TransferStatus(status) for status, _ in results]
        if TransferStatus.PENDING in statuses:  # a failed part waits for the others: no byte lands after FAILED
            return TransferStatus.PENDING
        reasons = [reason for status, reason in results if status == TransferStatus.FAILED.value]
        status = TransferStatus.FAILED if reasons else TransferStatus.DONE
        self._finished[handle.transfer_id] = (status, reasons[0] if reasons else None)
        del self._reads[handle.transfer_id]
        return status

    def failure_reason(self, handle: TransferHandle) -> str | None:
        finished = self._finished.get(handle.transfer_id)
        return None if finished is None else finished[1]

    def notify(self, peer: PeerId, message: bytes) -> None:
        kv: _RankKV = self.engine.rank_state["kv"]
        node = self._peers.get(peer)
        if node is None:
            raise UnknownPeerError(f"unknown peer {peer!r}")
        for peer_id in node.peer_ids.get(0, {}).values():  # best effort: through a peer rank rank 0 reads from
            kv.connector.notify(peer_id, message)
            return
        logger.debug("notification to %s dropped: rank 0 reads from none of its ranks", peer)

    def get_notifications(self) -> list[tuple[PeerId, bytes]]:
        kv: _RankKV = self.engine.rank_state["kv"]
        return kv.connector.get_notifications()

    def progress(self) -> None:
        kv: _RankKV = self.engine.rank_state["kv"]
        kv.connector.progress()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.call_ranks(f"{_MODULE}:_rank_close")
