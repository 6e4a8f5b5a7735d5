"""The KV ticket: a prefill node's claim on a prompt's pinned KV blocks, handed to a decode node.

One type from issue to use: the prefill node builds it, protos/convert.py carries it over gRPC (through the
proxy, which only passes it on), and the decode node reads it to extend and release the lease and to pull
the blocks. Constructing one validates it: a malformed ticket from the wire is an `InvalidTicketError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wire.errors import InvalidTicketError


@dataclass(frozen=True)
class KVTicket:
    """Blocks `block_ids` (holding the first `num_tokens` prompt tokens) pinned on prefill node
    `prefill_node_id` of incarnation `incarnation` until `lease_deadline` (unix time).

    `prefill_address` is that node's advertised gRPC address (lease calls go there), `transfer_endpoint`
    its connector metadata (kvtransfer.handshake envelope). `block_checksums` has one checksum per block
    (kvtransfer.checksum.kv_block_checksums: each block alone, `"<algorithm>:<hex>"`): a decode node reuses
    its own prefix-cache hits, whose bytes need not equal P's bit for bit, and verifies exactly the blocks it
    pulled.
    """

    ticket_id: str
    prefill_node_id: str
    prefill_address: str
    incarnation: int
    transfer_endpoint: bytes
    block_ids: tuple[int, ...]
    num_tokens: int
    layout_hash: str
    lease_deadline: float
    block_checksums: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("ticket_id", "prefill_node_id", "prefill_address", "layout_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidTicketError(f"ticket {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.transfer_endpoint, bytes) or not self.transfer_endpoint:
            raise InvalidTicketError("ticket transfer_endpoint must be non-empty bytes")
        if not _is_int(self.incarnation) or self.incarnation < 0:
            raise InvalidTicketError(f"ticket incarnation must be an int >= 0, got {self.incarnation!r}")
        if not _is_int(self.num_tokens) or self.num_tokens < 1:
            raise InvalidTicketError(f"ticket num_tokens must be an int >= 1, got {self.num_tokens!r}")
        if not isinstance(self.block_ids, tuple) or not self.block_ids:
            raise InvalidTicketError("ticket block_ids must be a non-empty tuple")
        if not all(_is_int(b) and b >= 0 for b in self.block_ids) or len(set(self.block_ids)) != len(self.block_ids):
            raise InvalidTicketError("ticket block_ids must be distinct ints >= 0")
        if isinstance(self.lease_deadline, bool) or not isinstance(self.lease_deadline, (int, float)) \
                or not math.isfinite(self.lease_deadline):
            raise InvalidTicketError(f"ticket lease_deadline must be a finite unix time, got {self.lease_deadline!r}")
        if not isinstance(self.block_checksums, tuple) or not all(isinstance(c, str) and c
                                                                  for c in self.block_checksums):
            raise InvalidTicketError("ticket block_checksums must be a tuple of non-empty strings")
        if len(self.block_checksums) != len(self.block_ids):
            raise InvalidTicketError(f"ticket has {len(self.block_checksums)} block checksums for "
                                     f"{len(self.block_ids)} blocks")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
