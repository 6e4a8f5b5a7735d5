"""Layout hash and the peer metadata envelope (kvtransfer.handshake)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from kvtransfer.base import MemoryKind
from kvtransfer.errors import IncompatiblePeerError, InvalidMetadataError
from kvtransfer.handshake import CONNECTOR_VERSION, MAGIC, KVLayout, PeerEnvelope, check_compatible, layout_hash

LAYOUT = KVLayout(model="llama-tiny", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                  tp_size=1)


def envelope(**changes: Any) -> PeerEnvelope:
    base = PeerEnvelope(backend="nixl", agent_name="p0", layout=LAYOUT, base_address=0x7F0000000000,
                        num_blocks=128, block_bytes=16384, memory_kind=MemoryKind.DRAM, device_id=0,
                        payload=b"\x00backend\xffbytes")
    return dataclasses.replace(base, **changes)


def test_layout_hash_is_the_documented_sha256_of_the_canonical_fields() -> None:
    # the documented scheme, written out by hand: sha256 of the fields as sorted, compact JSON; first 32 hex digits
    canonical = ('{"block_size":16,"connector_version":"2","dtype":"bfloat16","hash_seed":"","head_dim":64,'
                 '"kv_head_start":0,"model":"llama-tiny","num_kv_heads":2,"num_layers":4,"num_rank_kv_heads":0,'
                 '"tp_rank":0,"tp_size":1}')
    expected = hashlib.sha256(canonical.encode()).hexdigest()[:32]
    assert CONNECTOR_VERSION == "2"
    assert LAYOUT.layout_hash == expected
    assert layout_hash(model="llama-tiny", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                       tp_size=1) == expected


def test_layout_hash_changes_with_every_field() -> None:
    fields: dict[str, Any] = dict(model="llama-tiny", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64,
                                  block_size=16, tp_size=1)
    variants = [{**fields, name: value} for name, value in [
        ("model", "other"), ("dtype", "float32"), ("num_layers", 5), ("num_kv_heads", 4), ("head_dim", 128),
        ("block_size", 32), ("tp_size", 2)]]
    hashes = {layout_hash(**v) for v in variants} | {layout_hash(**fields, connector_version="3"),
                                                     layout_hash(**fields, hash_seed="s")}
    assert len(hashes) == len(variants) + 2 and LAYOUT.layout_hash not in hashes


def test_layout_rejects_wrong_types() -> None:
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(LAYOUT, block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(LAYOUT, dtype=None)  # type: ignore[arg-type]


def test_envelope_round_trips() -> None:
    original = envelope()
    data = original.encode()
    assert data.startswith(MAGIC)
    assert PeerEnvelope.decode(data) == original


def test_compatible_peers_pass_even_with_other_region_sizes() -> None:
    check_compatible(envelope(), envelope(agent_name="d0", num_blocks=4096, base_address=0x1000))


def test_incompatible_peer_error_names_every_differing_field() -> None:
    theirs = envelope(backend="mooncake", block_bytes=8192,
                      layout=dataclasses.replace(LAYOUT, dtype="float32", block_size=32))
    with pytest.raises(IncompatiblePeerError) as error:
        check_compatible(envelope(), theirs)
    message = str(error.value)
    for fragment in ["backend ", "'nixl'", "'mooncake'", "dtype ", "'bfloat16'", "'float32'", "block_size ",
                     "block_bytes ", LAYOUT.layout_hash, theirs.layout_hash]:
        assert fragment in message
    assert "num_layers" not in message


@pytest.mark.parametrize("data", [
    b"", b"TKVP", b"XXXX\x00\x00\x00\x02{}", MAGIC + b"\xff\xff\xff\xff{}", MAGIC + b"\x00\x00\x00\x05{}",
    MAGIC + b"\x00\x00\x00\x02[]", MAGIC + b"\x00\x00\x00\x02{}", MAGIC + b"\x00\x00\x00\x03\xff\xfe\xfd",
])
def test_unreadable_envelopes_raise_invalid_metadata(data: bytes) -> None:
    with pytest.raises(InvalidMetadataError):
        PeerEnvelope.decode(data)


def test_envelope_checks_version_payload_length_and_self_consistency() -> None:
    data = envelope().encode()
    with pytest.raises(InvalidMetadataError, match="version 2 is not supported"):
        PeerEnvelope.decode(data.replace(b'"envelope_version": 1', b'"envelope_version": 2'))
    with pytest.raises(InvalidMetadataError, match="payload"):
        PeerEnvelope.decode(data[:-1])
    with pytest.raises(InvalidMetadataError, match="layout_hash does not match"):
        PeerEnvelope.decode(data.replace(b'"block_size": 16', b'"block_size": 32'))
    with pytest.raises(InvalidMetadataError, match="malformed"):
        PeerEnvelope.decode(data.replace(b'"num_blocks": 128', b'"num_blocks": "x"'))
    with pytest.raises(InvalidMetadataError, match="not bytes|must be bytes"):
        PeerEnvelope.decode("text")  # type: ignore[arg-type]
