"""What goes over the wire: the vocabulary of everything that crosses a process boundary.

A node and the proxy are separate processes (often separate machines); what one says to another is defined
here, once, as plain frozen dataclasses and enums:

- `wire.nodes`: who a node is and how it is doing (`Role`, `NodeIdentity`, `NodeCapacity`, `NodeLoad`,
  `NodeStats`): what the registry holds and what the Stats RPC answers;
- `wire.registry`: the Redis keys, the node record (`NodeRecord`, versioned JSON) and the KV events deltas
  (`KVDelta`) nodes publish for the proxy's prefix index;
- `wire.ticket`: the `KVTicket` a prefill node hands out for a prompt's pinned KV blocks, which the proxy
  passes to a decode node;
- `wire.timings`: where a request's time went on each node (`PrefillTimings`, `DecodeTimings`), reported to
  the proxy with the first token of each;
- `wire.errors`: the error vocabulary shared across the boundary (`RETRYABLE_KEY`, `InvalidTicketError`).

Standard library only: no torch, redis, grpc or protobuf, and nothing of ours, so every process (the
torch-free proxy included) and every package (kvtransfer, which must not import the engine) can use it.
Protobuf conversions live at the gRPC edge, in protos/convert.py.
"""

from __future__ import annotations

from wire.errors import RETRYABLE_KEY, InvalidTicketError
from wire.nodes import NodeCapacity, NodeIdentity, NodeLoad, NodeStats, Role, TierStats
from wire.registry import (
    KV_EVENTS_STREAM,
    NODE_KEY_PATTERN,
    RECORD_VERSION,
    STREAM_MAX_LEN,
    KVDelta,
    NodeRecord,
    hash_fingerprint,
    kv_set_key,
    node_key,
)
from wire.ticket import KVTicket
from wire.timings import DecodeTimings, PrefillTimings

__all__ = [
    "KV_EVENTS_STREAM", "NODE_KEY_PATTERN", "RECORD_VERSION", "RETRYABLE_KEY", "STREAM_MAX_LEN", "DecodeTimings",
    "InvalidTicketError", "KVDelta", "KVTicket", "NodeCapacity", "NodeIdentity", "NodeLoad", "NodeRecord", "NodeStats",
    "PrefillTimings", "Role", "TierStats",
    "hash_fingerprint", "kv_set_key", "node_key",
]
