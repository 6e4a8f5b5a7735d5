"""Chained block hashes: the identity of a full KV block, cluster-wide.

Each block's hash covers its own tokens and, through the parent hash, every token before it, so equal hashes
mean equal prefixes (up to a collision, which the cache guards against by comparing token ids). Torch-free and
deterministic across processes (no Python `hash()`): the proxy, prefill and decode nodes must agree on them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_DIGEST_SIZE = 16


def root_hash(seed: str) -> BlockHash:
    """The parent of a sequence's first block. Different seeds give disjoint hash spaces."""
    return hashlib.blake2b(f"tandem-root:{seed}".encode(), digest_size=_DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str, start: int = 0,
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, beginning with block `start` whose parent is `parent`.

    Only full blocks are hashed: a partial block can still change. Passing `start`/`parent` extends an
    already-hashed sequence without rehashing its prefix.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    prev = root_hash(seed) if parent is None else parent
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[begin:begin + block_size])
        hashes.append(prev)
    return hashes
