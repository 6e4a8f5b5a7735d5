"""The ipc backend between GPU pools (CUDA IPC): the contract's key checks, with two processes that each hold
their KV pool in a CUDA tensor. Needs a CUDA device (a second one for the cross-GPU check, marked multi_gpu).

    python -m pytest -q tests/kvtransfer/test_ipc_gpu.py
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.kvtransfer.peer_process import PeerProcess, RemoteError
from tests.kvtransfer.test_contract import BLOCK_BYTES, FAST_S, NUM_BLOCKS, Pair, assert_both_alive, assert_remote_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    prefill = PeerProcess("ipc", num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, seed=1, device="cuda", wait=False)
    decode = PeerProcess("ipc", num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, seed=2, read_timeout_s=5.0,
                         device="cuda", wait=False)
    try:
        prefill.wait_ready(120)
        decode.wait_ready(120)
        prefill_id = decode.call("add_peer", prefill.metadata, timeout=60)
        decode_id = prefill.call("add_peer", decode.metadata, timeout=60)
        yield Pair("ipc", prefill, decode, prefill_id, decode_id)
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    started: list[PeerProcess] = []

    def spawn(**kwargs: Any) -> PeerProcess:
        options = {"num_blocks": NUM_BLOCKS, "block_bytes": BLOCK_BYTES, "seed": 7, "device": "cuda", **kwargs}
        peer = PeerProcess("ipc", wait=False, **options).wait_ready(120)
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        if peer.is_alive():
            peer.signal(signal.SIGCONT)
        peer.stop()


def test_gpu_reads_of_scattered_and_coalesced_blocks_land_exactly(pair: Pair) -> None:
    result = pair.assert_read_lands([3, 4, 5, 10, 11, 40, 7, 2099], [20, 21, 22, 0, 1, 63, 30, 1000])
    assert result["num_descriptors"] == 5
    assert pair.assert_read_lands([112, 110, 111, 113], [152, 150, 151, 153])["num_descriptors"] == 1
    pair.assert_read_lands([9, 9, 9], [300, 302, 304])


def test_gpu_read_of_more_than_1024_runs(pair: Pair) -> None:
    remote_ids = list(range(0, NUM_BLOCKS, 2))
    local_ids = np.random.default_rng(3).permutation(remote_ids).tolist()
    assert pair.assert_read_lands(remote_ids, local_ids)["num_descriptors"] == len(remote_ids)


def test_gpu_checksums_of_the_read_blocks_match_on_both_sides(pair: Pair) -> None:
    remote_ids, local_ids = [50, 51, 52, 90], [500, 501, 502, 7]
    pair.assert_read_lands(remote_ids, local_ids)
    assert pair.prefill.call("checksum", remote_ids) == pair.decode.call("checksum", local_ids)


def test_gpu_notifications_travel_both_ways_with_the_sender_id(pair: Pair) -> None:
    messages = [b"release ticket-1", bytes(range(256)) * 16]
    for message in messages:
        pair.decode.call("notify", pair.prefill_id, message)
    assert sorted(pair.prefill.call("notifications", 2, FAST_S)) == sorted((pair.decode_id, m) for m in messages)
    pair.prefill.call("notify", pair.decode_id, b"ack")
    assert pair.decode.call("notifications", 1, FAST_S) == [(pair.prefill_id, b"ack")]


def test_gpu_peer_removed_and_added_again_is_mapped_again(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    reader = spawn_peer(seed=8)
    prefill_id = reader.call("add_peer", pair.prefill.metadata, timeout=60)
    assert reader.call("read", prefill_id, [1, 2], [1, 2], FAST_S)["status"] == "DONE"
    reader.call("remove_peer", prefill_id)
    assert reader.call("add_peer", pair.prefill.metadata, timeout=60) == prefill_id
    assert reader.call("read", prefill_id, [3], [4], FAST_S)["status"] == "DONE"
    np.testing.assert_array_equal(reader.call("blocks")[[1, 2, 4]], pair.prefill.initial_blocks()[[1, 2, 3]])


def test_gpu_read_from_a_closed_or_killed_peer_fails_quickly(pair: Pair, spawn_peer: Callable[..., PeerProcess]
                                                             ) -> None:
    for end in ("close", "kill"):
        peer = spawn_peer()
        peer_id = pair.decode.call("add_peer", peer.metadata, timeout=60)
        assert pair.decode.call("read", peer_id, [1], [1], FAST_S)["status"] == "DONE"
        if end == "close":
            peer.call("close")
        else:
            peer.kill()
        result = pair.decode.call("read", peer_id, [2, 3], [2, 3], 2 * FAST_S)
        assert result["status"] == "FAILED" and result["seconds"] < FAST_S and result["reason"], result
        pair.decode.call("notify", peer_id, b"lost")
        pair.decode.call("remove_peer", peer_id)
    assert_both_alive(pair)
    pair.assert_read_lands([6], [6])


def test_gpu_read_from_a_stopped_peer_lands_exactly(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    peer = spawn_peer()
    peer_id = pair.decode.call("add_peer", peer.metadata, timeout=60)
    peer.signal(signal.SIGSTOP)
    before = pair.decode.call("blocks")
    result = pair.decode.call("read", peer_id, [8, 9, 40], [8, 9, 41], 3 * FAST_S)
    assert result["status"] == "DONE", result
    expected = before.copy()
    expected[[8, 9, 41]] = peer.initial_blocks()[[8, 9, 40]]
    np.testing.assert_array_equal(pair.decode.call("blocks"), expected)
    peer.signal(signal.SIGCONT)
    pair.decode.call("remove_peer", peer_id)


def test_gpu_and_host_pools_refuse_each_other(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    host_peer = spawn_peer(device="cpu")
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", host_peer.metadata)
    assert_remote_error(error, "IncompatiblePeerError", "its KV pool is in DRAM, ours in VRAM")
    with pytest.raises(RemoteError) as error:
        host_peer.call("add_peer", pair.prefill.metadata)
    assert_remote_error(error, "IncompatiblePeerError", "its KV pool is in VRAM, ours in DRAM")


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_read_from_a_pool_on_another_gpu_of_the_host(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    reader = spawn_peer(device="cuda:1", seed=9)
    prefill_id = reader.call("add_peer", pair.prefill.metadata, timeout=60)
    before = reader.call("blocks")
    result = reader.call("read", prefill_id, [5, 6, 7, 100], [10, 11, 12, 0], FAST_S)
    assert result["status"] == "DONE", result
    expected = before.copy()
    expected[[10, 11, 12, 0]] = pair.prefill.initial_blocks()[[5, 6, 7, 100]]
    np.testing.assert_array_equal(reader.call("blocks"), expected)
