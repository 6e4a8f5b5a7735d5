"""The KV ticket a prefill node issues for a prompt's pinned blocks, and the checksum of those blocks' bytes.

P computes `kv_checksum(region, ticket.block_ids)` when it issues the ticket; D, after pulling the blocks into its
own `local_block_ids` (same order), checks `verify_kv_checksum(ticket.checksum, region, local_block_ids)`. A
mismatch is a failed transfer, never a success. The checksum covers the blocks' bytes in the order given (not
their ids, which differ on the two sides), and names its algorithm: `"xxh3-128:<hex>"` (xxhash, about 15 GB/s
on one core here) or `"blake2b-128:<hex>"` (stdlib fallback, about 0.9 GB/s).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import hashlib
import hmac
import math
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtransfer.base import KVRegion, MemoryKind
from kvtransfer.errors import InvalidTicketError

xxhash: Any
try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; the fallback keeps checksums working without it
    xxhash = None

CHECKSUM_ALGORITHMS = ("xxh3-128", "blake2b-128")
DEFAULT_CHECKSUM_ALGORITHM = "xxh3-128" if xxhash is not None else "blake2b-128"


@dataclass(frozen=True)
class KVTicket:
    """A claim on a prompt's KV blocks pinned on prefill node `prefill_node_id` (of incarnation `incarnation`)
    until `lease_deadline` (unix time). `transfer_endpoint` is that node's connector metadata."""

    ticket_id: str
    prefill_node_id: str
    incarnation: int
    transfer_endpoint: bytes
    block_ids: tuple[int, ...]
    num_tokens: int
    layout_hash: str
    lease_deadline: float
    checksum: str  # of all the blocks, in order
    # One per block, so a decode node that reuses its own prefix-cache hits (whose bytes may differ from P's
    # bit for bit) can still verify every block it pulled. Empty when not provided.
    block_checksums: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("ticket_id", "prefill_node_id", "layout_hash", "checksum"):
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
        if self.block_checksums and len(self.block_checksums) != len(self.block_ids):
            raise InvalidTicketError(f"ticket has {len(self.block_checksums)} block checksums for "
                                     f"{len(self.block_ids)} blocks")

    def is_expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.lease_deadline

    def with_lease_deadline(self, lease_deadline: float) -> KVTicket:
        return replace(self, lease_deadline=lease_deadline)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: bytes as base64, block ids as a list."""
        data = asdict(self)
        data["transfer_endpoint"] = base64.b64encode(self.transfer_endpoint).decode()
        data["block_ids"] = list(self.block_ids)
        data["block_checksums"] = list(self.block_checksums)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTicket:
        """Parses a ticket from the wire; raises InvalidTicketError (and nothing else) when it is malformed.
        Unknown keys are ignored, so later versions may add fields."""
        if not isinstance(data, Mapping):
            raise InvalidTicketError(f"a ticket is a mapping, got {type(data).__name__}")
        try:
            endpoint = data["transfer_endpoint"]
            if not isinstance(endpoint, str):
                raise InvalidTicketError("ticket transfer_endpoint must be a base64 string")
            block_ids = data["block_ids"]
            if not isinstance(block_ids, (list, tuple)):
                raise InvalidTicketError("ticket block_ids must be a list")
            return cls(ticket_id=data["ticket_id"], prefill_node_id=data["prefill_node_id"],
                       incarnation=data["incarnation"],
                       transfer_endpoint=base64.b64decode(endpoint, validate=True),
                       block_ids=tuple(block_ids), num_tokens=data["num_tokens"], layout_hash=data["layout_hash"],
                       lease_deadline=data["lease_deadline"], checksum=data["checksum"],
                       block_checksums=tuple(data.get("block_checksums") or ()))
        except KeyError as e:
            raise InvalidTicketError(f"ticket field {e.args[0]!r} is missing") from None
        except binascii.Error as e:
            raise InvalidTicketError(f"ticket transfer_endpoint is not base64: {e}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def kv_checksum(region: KVRegion, block_ids: Sequence[int], algorithm: str = DEFAULT_CHECKSUM_ALGORITHM) -> str:
    """A checksum of the bytes of `block_ids` (in that order) in `region`; detects any flipped byte."""
    ids = [int(b) for b in block_ids]
    if any(b < 0 or b >= region.num_blocks for b in ids):
        raise InvalidTicketError(f"checksum block ids must be in [0, {region.num_blocks})")
    hasher = _new_hasher(algorithm)
    hasher.update(struct.pack("<QQ", len(ids), region.block_bytes))
    start = 0
    while start < len(ids):  # hash each run of consecutive ids in one call
        end = start + 1
        while end < len(ids) and ids[end] == ids[end - 1] + 1:
            end += 1
        hasher.update(_blocks_view(region, ids[start], end - start))
        start = end
    return f"{algorithm}:{hasher.hexdigest()}"


def verify_kv_checksum(expected: str, region: KVRegion, block_ids: Sequence[int]) -> bool:
    """Whether the blocks' bytes match `expected` (computed with the algorithm it names)."""
    algorithm, _, digest = expected.partition(":") if isinstance(expected, str) else ("", "", "")
    if algorithm not in CHECKSUM_ALGORITHMS or not digest:
        raise InvalidTicketError(f"unknown checksum format {expected!r}")
    return hmac.compare_digest(kv_checksum(region, block_ids, algorithm), expected)


def _new_hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":
        if xxhash is None:
            raise InvalidTicketError("checksum algorithm xxh3-128 needs the xxhash package")
        return xxhash.xxh3_128()
    if algorithm == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    raise InvalidTicketError(f"unknown checksum algorithm {algorithm!r} (known: {CHECKSUM_ALGORITHMS})")


def _blocks_view(region: KVRegion, first_block: int, num_blocks: int) -> Any:
    """A zero-copy view of host blocks, or a host copy of GPU blocks (through the owning tensor)."""
    if region.memory_kind is MemoryKind.DRAM:
        array_type = ctypes.c_ubyte * (num_blocks * region.block_bytes)
        return memoryview(array_type.from_address(region.block_address(first_block)))
    import torch  # only GPU regions get here, and they are torch tensors

    if region.owner is None:
        raise InvalidTicketError("a checksum of GPU blocks needs the region's owning tensor")
    blocks = region.owner.reshape(-1).view(torch.uint8).reshape(region.num_blocks, region.block_bytes)
    return blocks[first_block:first_block + num_blocks].cpu().numpy()
