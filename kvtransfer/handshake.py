"""The handshake: a KV layout hash, and the self-describing envelope that carries a peer's metadata.

Two nodes may pair only if their KV blocks mean the same bytes: same model, dtype, layer count, KV heads, head
dim, block size, TP size (and hash seed and connector version). Each connector's metadata travels as

    b"TKVP" | header length (4 bytes, big-endian) | JSON header | backend payload

where the header names the envelope version, backend, agent name, the layout (fields and hash) and the region
geometry, and the payload is the backend's own bytes (NIXL agent metadata, Mooncake endpoint record,
ipc process and CUDA IPC record).
`check_compatible` refuses a peer with a clear message naming every differing field.

The `auto` connector (kvtransfer/same_host.py) runs two backends and offers both: its envelope's backend is
"auto" and its payload a *bundle* of whole envelopes, one per backend it runs (binary, never pickled):

    b"TKVB" | version (1 byte) | number of parts (1 byte)
           | per part: backend name length (1 byte) | backend name (ASCII) | part length (4 bytes, big-endian) | part

`select_envelope` is how any connector reads a peer's metadata: its own backend's part of an auto peer's bundle, so
a plain nixl (or mooncake, or ipc) node can read from an auto node.

Tensor parallelism: each rank of a node registers its own slice of the KV pool, in *head units* (one KV head of one
block, all layers: the pool is head-major within a block), and its layout says which heads it holds (`tp_size`,
`tp_rank`, `kv_head_start`, `num_rank_kv_heads`: the split). Two layouts that differ only in their split hold the
same bytes per head unit, so nodes of different TP sizes pair (`pairing_hash` leaves the split out;
`check_compatible` compares everything else); which rank reads which heads from which peer rank is the node's
business (node_common/sharded_kv.py), which refuses a split it cannot cover. A node's metadata is a *rank set*,
every rank's envelope in rank order (a single-rank node's is its one envelope, as before):

    b"TKVR" | version (1 byte) | number of ranks (1 byte) | per rank: length (4 bytes, big-endian) | envelope
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvtransfer.base import MemoryKind
from kvtransfer.errors import IncompatiblePeerError, InvalidMetadataError

# bump when the bytes a connector moves, or how, change incompatibly (2: head-major blocks, regions of head units)
CONNECTOR_VERSION = "2"
ENVELOPE_VERSION = 1
MAGIC = b"TKVP"
_HEADER_LENGTH = struct.Struct(">I")
_MAX_HEADER_BYTES = 1 << 16
AUTO_BACKEND = "auto"
BUNDLE_MAGIC = b"TKVB"
BUNDLE_VERSION = 1
MAX_BUNDLE_PARTS = 8
_BUNDLE_HEAD = struct.Struct(">4sBB")  # magic, version, number of parts
_PART_LENGTH = struct.Struct(">I")
_BACKEND_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
RANK_SET_MAGIC = b"TKVR"
RANK_SET_VERSION = 1
MAX_RANKS = 64
_RANK_SET_HEAD = struct.Struct(">4sBB")  # magic, version, number of ranks
# the fields that say which heads a rank holds: nodes whose layouts differ only in these pair
SPLIT_FIELDS = ("tp_size", "tp_rank", "kv_head_start", "num_rank_kv_heads")


def layout_hash(model: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                tp_size: int, connector_version: str = CONNECTOR_VERSION, hash_seed: str = "") -> str:
    """A stable hash of everything that must match for two nodes' KV blocks to be interchangeable."""
    return KVLayout(model, dtype, num_layers, num_kv_heads, head_dim, block_size, tp_size, connector_version,
                    hash_seed).layout_hash


@dataclass(frozen=True)
class KVLayout:
    """What a KV block means. `model` is any stable identifier of the weights (a name or a config hash)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int
    connector_version: str = CONNECTOR_VERSION
    hash_seed: str = ""  # the cluster's prefix-hash seed (docs/architecture.md#handoff: a pair must agree)
    # the split: this rank of tp_size holds KV heads [kv_head_start, kv_head_start + num_rank_kv_heads)
    tp_rank: int = 0
    kv_head_start: int = 0
    num_rank_kv_heads: int = 0  # 0: all num_kv_heads (a single-rank pool)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and not isinstance(value, str):
                raise ValueError(f"KVLayout.{f.name} must be a str, got {value!r}")
            minimum = 0 if f.name in SPLIT_FIELDS[1:] else 1
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"KVLayout.{f.name} must be an int >= {minimum}, got {value!r}")
        if self.tp_rank >= self.tp_size or self.kv_head_start + self.rank_kv_heads > self.num_kv_heads:
            last = self.kv_head_start + self.rank_kv_heads
            raise ValueError(f"KVLayout: rank {self.tp_rank} of {self.tp_size} cannot hold KV heads "
                             f"[{self.kv_head_start}, {last}) of {self.num_kv_heads}")

    @property
    def rank_kv_heads(self) -> int:
        """How many KV heads this rank's pool holds (head units per block)."""
        return self.num_rank_kv_heads or self.num_kv_heads

    @property
    def layout_hash(self) -> str:
        """The first 32 hex digits of the SHA-256 of the fields as JSON with sorted keys and no spaces."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    @property
    def pairing_hash(self) -> str:
        """layout_hash of the fields without the split: equal for nodes whose head units mean the same bytes,
        whatever their TP sizes (what a node publishes, and what a ticket names)."""
        content = {k: v for k, v in asdict(self).items() if k not in SPLIT_FIELDS}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        if not isinstance(data, dict):
            raise ValueError(f"a KVLayout is a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown KVLayout fields: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class PeerEnvelope:
    """A connector's metadata: who it is, what its blocks mean, where they live, and the backend's bytes."""

    backend: str
    agent_name: str
    layout: KVLayout
    base_address: int
    num_blocks: int
    block_bytes: int
    memory_kind: MemoryKind
    device_id: int
    payload: bytes = b""

    @property
    def layout_hash(self) -> str:
        """The first 32 hex digits of the SHA-256 of the fields as JSON with sorted keys and no spaces."""
        return self.layout.layout_hash

    def encode(self) -> bytes:
        header = {
            "envelope_version": ENVELOPE_VERSION,
            "backend": self.backend,
            "agent_name": self.agent_name,
            "layout": self.layout.to_dict(),
            "layout_hash": self.layout_hash,
            "region": {"base_address": self.base_address, "num_blocks": self.num_blocks,
                       "block_bytes": self.block_bytes, "memory_kind": self.memory_kind.value,
                       "device_id": self.device_id},
            "payload_bytes": len(self.payload),
        }
        header_bytes = json.dumps(header, sort_keys=True).encode()
        return MAGIC + _HEADER_LENGTH.pack(len(header_bytes)) + header_bytes + self.payload

    @classmethod
    def decode(cls, data: bytes) -> PeerEnvelope:
        """Parses metadata bytes; raises InvalidMetadataError (never anything else) when they are not valid."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidMetadataError(f"peer metadata must be bytes, got {type(data).__name__}")
        data = bytes(data)
        prefix = len(MAGIC) + _HEADER_LENGTH.size
        if len(data) < prefix or not data.startswith(MAGIC):
            raise InvalidMetadataError("peer metadata is not a Tandem KV envelope (bad magic)")
        (header_length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
        if header_length > _MAX_HEADER_BYTES or prefix + header_length > len(data):
            raise InvalidMetadataError(f"peer metadata is truncated or corrupt (header of {header_length} bytes "
                                       f"in {len(data)} bytes)")
        try:
            header = json.loads(data[prefix:prefix + header_length])
            version = header["envelope_version"]
            if not isinstance(version, int) or version != ENVELOPE_VERSION:
                raise InvalidMetadataError(f"peer metadata envelope version {version!r} is not supported "
                                           f"(this connector reads version {ENVELOPE_VERSION})")
            region = header["region"]
            payload = data[prefix + header_length:]
            if header["payload_bytes"] != len(payload):
                raise InvalidMetadataError(f"peer metadata payload is {len(payload)} bytes, the header says "
                                           f"{header['payload_bytes']}")
            envelope = cls(backend=_typed(header, "backend", str), agent_name=_typed(header, "agent_name", str),
                           layout=KVLayout.from_dict(header["layout"]),
                           base_address=_typed(region, "base_address", int),
                           num_blocks=_typed(region, "num_blocks", int),
                           block_bytes=_typed(region, "block_bytes", int),
                           memory_kind=MemoryKind(region["memory_kind"]),
                           device_id=_typed(region, "device_id", int), payload=payload)
        except InvalidMetadataError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise InvalidMetadataError(f"peer metadata header is malformed: {type(e).__name__}: {e}") from None
        if header.get("layout_hash") != envelope.layout_hash:
            raise InvalidMetadataError("peer metadata layout_hash does not match the layout it describes")
        if min(envelope.base_address, envelope.num_blocks, envelope.block_bytes) <= 0 or not envelope.agent_name:
            raise InvalidMetadataError("peer metadata describes an empty region or has no agent name")
        return envelope


def _typed(mapping: dict[str, Any], key: str, kind: type) -> Any:
    value = mapping[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def check_compatible(ours: PeerEnvelope, theirs: PeerEnvelope) -> None:
    """Raises IncompatiblePeerError naming every field in which the peer differs from us."""
    differences = []
    if ours.backend != theirs.backend:
        differences.append(f"backend (ours {ours.backend!r}, peer {theirs.backend!r})")
    for f in fields(KVLayout):
        if f.name in SPLIT_FIELDS:  # ranks of another split hold other heads, in units of the same bytes
            continue
        mine, peer = getattr(ours.layout, f.name), getattr(theirs.layout, f.name)
        if mine != peer:
            differences.append(f"{f.name} (ours {mine!r}, peer {peer!r})")
    if ours.block_bytes != theirs.block_bytes:
        differences.append(f"block_bytes (ours {ours.block_bytes}, peer {theirs.block_bytes})")
    if differences:
        raise IncompatiblePeerError(f"refusing peer {theirs.agent_name!r}: layout_hash ours {ours.layout_hash}, "
                                    f"peer {theirs.layout_hash}; differs in " + ", ".join(differences)
                                    + _fp8_hint(ours.layout.dtype, theirs.layout.dtype))


def _fp8_hint(ours: str, theirs: str) -> str:
    """Why an FP8 node and a 16/32-bit node cannot share blocks, and what to do (the likely cause of that dtype
    mismatch is one node started without --kv-cache-dtype)."""
    if ours.startswith("fp8") == theirs.startswith("fp8"):
        return ""
    return (f". An FP8 KV cache pairs only with FP8 (ours is {ours}, the peer's {theirs}): its blocks hold e4m3 "
            f"values and their scales; start every node with the same --kv-cache-dtype")


def encode_bundle(parts: Mapping[str, bytes]) -> bytes:
    """The payload of an auto envelope: each backend's whole envelope, in the order given."""
    if not 0 < len(parts) <= MAX_BUNDLE_PARTS:
        raise ValueError(f"a bundle holds 1 to {MAX_BUNDLE_PARTS} parts, got {len(parts)}")
    chunks = [_BUNDLE_HEAD.pack(BUNDLE_MAGIC, BUNDLE_VERSION, len(parts))]
    for backend, part in parts.items():
        assert _BACKEND_NAME.match(backend), f"bad backend name {backend!r}"
        chunks += [bytes([len(backend)]), backend.encode("ascii"), _PART_LENGTH.pack(len(part)), bytes(part)]
    return b"".join(chunks)


def decode_bundle(data: bytes) -> dict[str, bytes]:
    """Parses an auto envelope's payload into {backend: that backend's envelope bytes}; raises
    InvalidMetadataError (never anything else) when the bytes are not a bundle of this version."""
    data = bytes(data)
    if len(data) < _BUNDLE_HEAD.size or not data.startswith(BUNDLE_MAGIC):
        raise InvalidMetadataError("the auto peer's payload is not a bundle of backend envelopes (bad magic)")
    _, version, num_parts = _BUNDLE_HEAD.unpack_from(data)
    if version != BUNDLE_VERSION:
        raise InvalidMetadataError(f"the auto peer's bundle version {version} is not supported (this connector "
                                   f"reads version {BUNDLE_VERSION})")
    if not 0 < num_parts <= MAX_BUNDLE_PARTS:
        raise InvalidMetadataError(f"the auto peer's bundle has {num_parts} parts (1 to {MAX_BUNDLE_PARTS} allowed)")
    parts: dict[str, bytes] = {}
    offset = _BUNDLE_HEAD.size
    for index in range(num_parts):
        name_end = offset + 1 + (data[offset] if offset < len(data) else 0)
        if name_end + _PART_LENGTH.size > len(data):
            raise InvalidMetadataError(f"the auto peer's bundle is truncated in part {index}")
        name = data[offset + 1:name_end].decode("ascii", errors="replace")
        if not _BACKEND_NAME.match(name) or name in parts:
            raise InvalidMetadataError(f"the auto peer's bundle part {index} has a bad or repeated backend name "
                                       f"{name!r}")
        (length,) = _PART_LENGTH.unpack_from(data, name_end)
        offset = name_end + _PART_LENGTH.size
        if length == 0 or offset + length > len(data):
            raise InvalidMetadataError(f"the auto peer's bundle part {name!r} is empty or truncated ({length} "
                                       f"bytes announced, {len(data) - offset} left)")
        parts[name] = data[offset:offset + length]
        offset += length
    if offset != len(data):
        raise InvalidMetadataError(f"the auto peer's bundle has {len(data) - offset} stray bytes after its parts")
    return parts


def select_envelope(metadata: bytes, backend: str) -> tuple[PeerEnvelope, bytes]:
    """The envelope a `backend` connector reads in a peer's metadata, and its bytes: the metadata itself, or, when
    the peer runs the auto connector, the part of its bundle for `backend` (IncompatiblePeerError when it offers
    none). An auto part must name the same agent as the envelope around it."""
    envelope = PeerEnvelope.decode(metadata)
    if envelope.backend != AUTO_BACKEND or backend == AUTO_BACKEND:
        return envelope, bytes(metadata)
    parts = decode_bundle(envelope.payload)
    part = parts.get(backend)
    if part is None:
        raise IncompatiblePeerError(f"refusing peer {envelope.agent_name!r}: backend (ours {backend!r}, peer "
                                    f"{AUTO_BACKEND!r} offering {', '.join(parts)})")
    inner = PeerEnvelope.decode(part)
    if inner.backend != backend or inner.agent_name != envelope.agent_name:
        raise InvalidMetadataError(f"the auto peer {envelope.agent_name!r}'s {backend} part is an envelope of "
                                   f"backend {inner.backend!r} for agent {inner.agent_name!r}")
    return inner, part


def encode_rank_set(envelopes: list[bytes]) -> bytes:
    """A node's metadata: one rank's envelope as it is, several ranks' as a rank set (in rank order)."""
    if not 0 < len(envelopes) <= MAX_RANKS:
        raise ValueError(f"a rank set holds 1 to {MAX_RANKS} envelopes, got {len(envelopes)}")
    if len(envelopes) == 1:
        return bytes(envelopes[0])
    chunks = [_RANK_SET_HEAD.pack(RANK_SET_MAGIC, RANK_SET_VERSION, len(envelopes))]
    for envelope in envelopes:
        chunks += [_PART_LENGTH.pack(len(envelope)), bytes(envelope)]
    return b"".join(chunks)


def decode_rank_set(data: bytes) -> list[bytes]:
    """Every rank's envelope bytes from a node's metadata (one for a plain envelope); InvalidMetadataError (never
    anything else) when the bytes are neither."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidMetadataError(f"peer metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(RANK_SET_MAGIC):
        return [data]
    if len(data) < _RANK_SET_HEAD.size:
        raise InvalidMetadataError("the peer's rank set is truncated")
    _, version, num_ranks = _RANK_SET_HEAD.unpack_from(data)
    if version != RANK_SET_VERSION or not 0 < num_ranks <= MAX_RANKS:
        raise InvalidMetadataError(f"the peer's rank set (version {version}, {num_ranks} ranks) is not one this "
                                   f"node reads (version {RANK_SET_VERSION}, 1 to {MAX_RANKS} ranks)")
    envelopes, offset = [], _RANK_SET_HEAD.size
    for rank in range(num_ranks):
        if offset + _PART_LENGTH.size > len(data):
            raise InvalidMetadataError(f"the peer's rank set is truncated at rank {rank}")
        (length,) = _PART_LENGTH.unpack_from(data, offset)
        offset += _PART_LENGTH.size
        if length == 0 or offset + length > len(data):
            raise InvalidMetadataError(f"the peer's rank set has an empty or truncated envelope for rank {rank}")
        envelopes.append(data[offset:offset + length])
        offset += length
    if offset != len(data):
        raise InvalidMetadataError(f"the peer's rank set has {len(data) - offset} stray bytes")
    return envelopes
