"""Who a node is and how it is doing: what the registry publishes and what the Stats RPC answers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class NodeIdentity:
    """What a node says about itself when it registers (constant while it runs)."""

    node_id: str
    role: Role
    address: str  # host:port others reach its gRPC service at (the advertised address, never a bind-all host)
    model: str
    layout_hash: str  # KV layout identity: a prefill and a decode node pair only when theirs are equal
    kv_backend: str
    hash_seed: str  # the prefix-hash seed; published only as wire.registry.hash_fingerprint(hash_seed)
    incarnation: int = 0  # changes when the node restarts; 0: drawn at random by the registrar
    # The Kubernetes pod that runs the node ("" off Kubernetes). Not the incarnation: a container restarted in
    # its pod (liveness probe, OOM kill) keeps the pod UID but must not honour its previous life's tickets.
    pod_uid: str = ""


@dataclass(frozen=True)
class NodeCapacity:
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # 0: not known (the Stats RPC does not say)


@dataclass(frozen=True)
class NodeLoad:
    free_kv_blocks: int  # blocks on the free list (including evictable cached prefixes)
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int  # prompt tokens admitted but not computed yet


@dataclass(frozen=True)
class TierStats:
    """One KV tier below a node's pool (docs/architecture.md#kv-tiers), counted as the pool's prefix cache is."""

    queries: int = 0  # prompt tokens looked up in this tier (past the tiers above it)
    hits: int = 0  # prompt tokens found there
    read_bytes: int = 0  # host: loaded into the pool; store: got from the store
    write_bytes: int = 0  # host: spilled from the pool or imported; store: put in the store
    used_blocks: int = 0  # host only: the store's occupancy is its master's
    total_blocks: int = 0
    errors: int = 0  # store: calls that failed (an unreachable master) or blocks that failed their checks


@dataclass(frozen=True)
class NodeStats:
    """A node's answer to Stats: its capacity, its load, and its counters since it started.

    Counters of the other role stay 0 (a decode node pins no tickets; a prefill node pulls no KV)."""

    capacity: NodeCapacity
    load: NodeLoad
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there
    num_pinned_tickets: int = 0  # prefill node: tickets whose blocks wait for a decode node
    num_leases_expired: int = 0  # prefill node: tickets freed because nobody released them in time
    num_transfer_failures: int = 0  # decode node: pulls that failed or were corrupt
    kv_transfer_bytes: int = 0  # decode node: bytes pulled from prefill nodes
    kv_transfer_count: int = 0  # decode node: pulls that completed
    kv_transfer_seconds_sum: float = 0.0  # decode node: their total duration (read to verified)
    # speculative decoding (decode node, --speculative-config): verification steps with drafts, drafts, accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    host_tier: TierStats | None = None  # None: the node has no such tier
    store_tier: TierStats | None = None
