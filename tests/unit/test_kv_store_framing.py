"""The framing of a KV block in the shared store (kvtransfer/kv_store.py): a value is only accepted for the
token ids and block size it was packed for, with the KV handoff's own per-block checksum."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from kvtransfer.base import KVRegion, MemoryKind
from kvtransfer.checksum import block_checksum, kv_checksum
from kvtransfer.errors import InvalidRequestError
from kvtransfer.kv_store import pack_block, store_key, unpack_block

TOKEN_IDS = [151643, 7, 0, 2**40, 42]
DATA = bytes(range(256)) * 16  # one 4 KiB block


def test_a_packed_block_unpacks_to_its_data() -> None:
    value = pack_block(TOKEN_IDS, DATA)
    assert value[:4] == b"TKVB"
    assert unpack_block(value, TOKEN_IDS, len(DATA)) == DATA


def test_a_flipped_data_byte_is_refused() -> None:
    value = bytearray(pack_block(TOKEN_IDS, DATA))
    value[-100] ^= 0x01
    assert unpack_block(bytes(value), TOKEN_IDS, len(DATA)) is None


def test_other_token_ids_are_refused_whether_asked_for_or_stored() -> None:
    value = pack_block(TOKEN_IDS, DATA)
    assert unpack_block(value, [*TOKEN_IDS[:-1], 43], len(DATA)) is None
    assert unpack_block(value, TOKEN_IDS[:-1], len(DATA)) is None
    stored = bytearray(value)
    ids_offset = len(value) - len(DATA) - 8 * len(TOKEN_IDS)
    stored[ids_offset:ids_offset + 8] = struct.pack("<q", 151644)  # a flipped token id in the value
    assert unpack_block(bytes(stored), TOKEN_IDS, len(DATA)) is None


def test_a_truncated_value_a_wrong_size_and_a_wrong_magic_are_refused() -> None:
    value = pack_block(TOKEN_IDS, DATA)
    assert unpack_block(value[:-1], TOKEN_IDS, len(DATA)) is None
    assert unpack_block(value[:10], TOKEN_IDS, len(DATA)) is None
    assert unpack_block(value, TOKEN_IDS, len(DATA) - 1) is None
    assert unpack_block(b"XKVB" + value[4:], TOKEN_IDS, len(DATA)) is None
    assert unpack_block(value[:4] + struct.pack("<I", 2) + value[8:], TOKEN_IDS, len(DATA)) is None


def test_block_checksum_is_the_handoffs_checksum_of_that_block() -> None:
    kv = torch.randn(6, 2, 256, dtype=torch.float16)  # 6 blocks of 1 KiB on the host
    region = KVRegion(kv.data_ptr(), kv.shape[0], kv[0].nbytes, MemoryKind.DRAM, owner=kv)
    for block_id in (0, 3, 5):
        data = kv[block_id].contiguous().view(torch.uint8).numpy().tobytes()
        assert block_checksum(data) == kv_checksum(region, [block_id], "xxh3-128")
        assert block_checksum(memoryview(data), "blake2b-128") == kv_checksum(region, [block_id], "blake2b-128")
    oracle = xxhash.xxh3_128(struct.pack("<QQ", 1, len(DATA)) + DATA).hexdigest()  # the documented message
    assert block_checksum(DATA) == f"xxh3-128:{oracle}"
    with pytest.raises(InvalidRequestError, match="host algorithms"):
        block_checksum(DATA, "mix64")


def test_a_store_key_names_the_namespace_and_the_block_hash() -> None:
    assert store_key("llama-8b", bytes([0, 255, 16])) == "tandem/llama-8b/00ff10"
