"""The cluster registry's wire format (Redis): its keys, the node record and the KV events deltas.

Nodes write it (node_common/registrar.py), the proxy reads it (proxy/routing/directory.py); both import it from here.
- `tandem:node:<node_id>`: the node's `NodeRecord` as JSON, written with a TTL and rewritten by every
  heartbeat. A node that stops heart-beating (killed, stopped, partitioned) leaves when the TTL runs out.
- `tandem:kv:<node_id>`: a SET of the hex chained block hashes the node's prefix cache can find now (same
  TTL): the snapshot a reader loads when it first sees the node or has missed entries.
- `tandem:kv-events`: one STREAM for the cluster; an entry is one node's `KVDelta` {node, seq, stored,
  removed}. `seq` counts the node's entries since it last rewrote its set; seq 0 says "my set was
  rewritten: reload it", and a reader that sees seq skip a number reloads the set too.
"""

from __future__ import annotations

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


def node_key(node_id: str) -> str:
    return f"{KEY_PREFIX}:node:{node_id}"


def kv_set_key(node_id: str) -> str:
    return f"{KEY_PREFIX}:kv:{node_id}"


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
    """One stream entry: the hex block hashes a node's cache gained and lost since its previous entry
    (disjoint)."""

    node_id: str
    seq: int
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def to_fields(self) -> dict[str, str]:
        return {"node": self.node_id, "seq": str(self.seq), "stored": " ".join(self.stored),
                "removed": " ".join(self.removed)}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> KVDelta:
        """Raises ValueError for a malformed entry."""
        try:
            return cls(fields["node"], int(fields["seq"]), tuple(fields.get("stored", "").split()),
                       tuple(fields.get("removed", "").split()))
        except (KeyError, ValueError) as e:
            raise ValueError(f"malformed KV event entry {fields!r}") from e
