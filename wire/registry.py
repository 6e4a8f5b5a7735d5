"""The cluster registry's wire format (Redis): its keys, the node record and the KV events deltas.

Nodes write it (node_common/registrar.py), the proxy reads it (proxy/routing/directory.py); both import it from here.
- `tandem:node:<node_id>`: the node's `NodeRecord` as JSON, written with a TTL and rewritten by every
  heartbeat. A node that stops heart-beating (killed, stopped, partitioned) leaves when the TTL runs out.
- `tandem:kv:<node_id>` and `tandem:kv-host:<node_id>`: SETs of the hex chained block hashes the node's pool
  (tier device) and host tier (tier host) can find now (same TTL): the snapshot a reader loads when it first
  sees the node or has missed entries. The device set keeps its old key, so a proxy that knows no tiers reads it.
- `tandem:kv-store:<layout_hash>`: a ZSET of the hex hashes nodes of that KV layout put in the cluster store
  (tier store), each scored by the unix time of its latest put. It belongs to no node: every node of the layout
  can get those blocks. See `STORE_HINT_TTL_S` for why its entries expire.
- `tandem:kv-events`: one STREAM for the cluster; an entry is one node's `KVDelta` {node, seq, tier, stored,
  removed}. `seq` counts the node's entries (of every tier) since it last rewrote its sets; seq 0 says "my sets
  were rewritten: reload them", and a reader that sees seq skip a number reloads them too (and the store set of
  the node's layout, which the missed entries may have added to). An entry without a tier (an older node) is of
  tier device.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass

from wire.nodes import NodeCapacity, NodeLoad, Role

KEY_PREFIX = "tandem"
NODE_KEY_PATTERN = f"{KEY_PREFIX}:node:*"
KV_EVENTS_STREAM = f"{KEY_PREFIX}:kv-events"
RECORD_VERSION = 1
# About this many entries stay in the stream; a reader further behind reloads the sets it missed.
STREAM_MAX_LEN = 100_000
# The store evicts silently (a full segment drops objects, a node that leaves takes its segment with it) and says
# nothing about it, so a store entry is a hint that expires: after STORE_HINT_TTL_S since its latest put, and
# beyond the newest STORE_HINT_MAX_BLOCKS per layout. A stale hint costs a misjudged route (a node is credited with
# blocks it then computes); an expired fresh one costs only the credit. Ten minutes covers a conversation's next
# turn (the reason the store exists, docs/architecture.md#kv-tiers); 200k hex hashes are ~20 MB of Redis, about
# the blocks of a few hundred GiB of store for a mid-sized model.
STORE_HINT_TTL_S = 600.0
STORE_HINT_MAX_BLOCKS = 200_000


class Tier(enum.Enum):
    """Where a block is held (docs/architecture.md#kv-tiers), cheapest to reuse first."""

    DEVICE = "device"  # the node's KV pool
    HOST = "host"  # the node's host tier
    STORE = "store"  # the cluster store: any node of the same KV layout can get it


def node_key(node_id: str) -> str:
    return f"{KEY_PREFIX}:node:{node_id}"


def kv_set_key(node_id: str, tier: Tier = Tier.DEVICE) -> str:
    """The SET of a node's blocks in one of its own tiers (the store's set is per layout: `store_set_key`)."""
    assert tier is not Tier.STORE, "the store's blocks belong to a layout, not to a node: store_set_key"
    return f"{KEY_PREFIX}:kv:{node_id}" if tier is Tier.DEVICE else f"{KEY_PREFIX}:kv-{tier.value}:{node_id}"


def store_set_key(layout_hash: str) -> str:
    return f"{KEY_PREFIX}:kv-store:{layout_hash}"


def hash_fingerprint(hash_seed: str) -> str:
    """Tells whether two processes hash prefixes alike without publishing the seed itself."""
    return hashlib.blake2b(f"tandem-hash-seed:{hash_seed}".encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself, refreshed every heartbeat."""

    node_id: str
    role: Role
    address: str  # host:port of its gRPC service
    model: str
    layout_hash: str  # KV layout identity: a prefill and a decode node pair only when theirs are equal
    kv_backend: str
    incarnation: int  # changes when the node's process restarts (tickets carry it: older ones are refused)
    hash_fingerprint: str  # hash_fingerprint(hash seed): prefix hashes are comparable only between equal ones
    capacity: NodeCapacity
    load: NodeLoad
    draining: bool = False  # finishing its requests before it stops: takes no new ones
    updated_at: float = 0.0  # unix time of the write, for operators
    pod_uid: str = ""  # the Kubernetes pod that wrote it (wire.nodes.NodeIdentity.pod_uid); "" off Kubernetes

    def to_json(self) -> str:
        body = asdict(self)
        body["role"] = self.role.value
        return json.dumps({"version": RECORD_VERSION, **body}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        """Raises ValueError for anything that is not a record of our version."""
        try:
            body = json.loads(text)
            if body.pop("version") != RECORD_VERSION:
                raise ValueError(f"registry record version {body.get('version')!r}, expected {RECORD_VERSION}")
            body["role"] = Role(body["role"])
            body["capacity"] = NodeCapacity(**body["capacity"])
            body["load"] = NodeLoad(**body["load"])
            return cls(**body)
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed registry record: {e!r}") from e


@dataclass(frozen=True)
class KVDelta:
    """One stream entry: the hex block hashes one tier of a node gained and lost since the node's previous entry
    (disjoint). Tier store: the blocks the node put in the store; `removed` is always empty there (the store
    evicts silently)."""

    node_id: str
    seq: int
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    tier: Tier = Tier.DEVICE

    def to_fields(self) -> dict[str, str]:
        return {"node": self.node_id, "seq": str(self.seq), "tier": self.tier.value, "stored": " ".join(self.stored),
                "removed": " ".join(self.removed)}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> KVDelta:
        """Raises ValueError for a malformed entry (a tier this version does not know included)."""
        try:
            return cls(fields["node"], int(fields["seq"]), tuple(fields.get("stored", "").split()),
                       tuple(fields.get("removed", "").split()), Tier(fields.get("tier", Tier.DEVICE.value)))
        except (KeyError, ValueError) as e:
            raise ValueError(f"malformed KV event entry {fields!r}") from e
