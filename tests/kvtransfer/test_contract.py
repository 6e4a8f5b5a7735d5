"""The connector contract (kvtransfer.base.Connector), one suite run against every backend.

Each test drives real connectors in separate processes on loopback: a "prefill" peer P whose blocks are read and
a "decode" peer D that reads them. Every check of landed bytes compares D's whole region, so a block written
where it should not be fails the test as surely as a missing one.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtransfer import BACKENDS
from kvtransfer.handshake import PeerEnvelope
from tests.kvtransfer.peer_process import PeerProcess, RemoteError, assert_read_lands

NUM_BLOCKS = 2100  # enough for a read of more than 1024 descriptors (Mooncake splits its batches there)
BLOCK_BYTES = 2048
FAST_S = 5.0  # "quickly": how long a failure may take to show
# read the peer's memory without the peer's help (see the hung-peer test); auto reads a peer on this host over ipc
ONE_SIDED_BACKENDS = {"ipc", "auto"}
# the backend each connector reads a peer of its own kind with, on this host
READ_WITH = {"nixl": "nixl", "mooncake": "mooncake", "ipc": "ipc", "auto": "ipc"}
# the backends whose metadata each connector reads (an auto connector runs ipc and nixl, and reads their peers too)
READS = {"nixl": {"nixl"}, "mooncake": {"mooncake"}, "ipc": {"ipc"}, "auto": {"auto", "ipc", "nixl"}}


@dataclasses.dataclass
class Pair:
    backend: str
    prefill: PeerProcess
    decode: PeerProcess
    prefill_id: str  # the prefill peer as the decode side knows it
    decode_id: str  # and the other way round

    def read(self, remote_ids: list[int], local_ids: list[int]) -> dict[str, Any]:
        return self.decode.call("read", self.prefill_id, remote_ids, local_ids, 30.0)

    def assert_read_lands(self, remote_ids: list[int], local_ids: list[int]) -> dict[str, Any]:
        return assert_read_lands(self.decode, self.prefill_id, self.prefill, remote_ids, local_ids)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    backend = request.param
    prefill = PeerProcess(backend, num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, seed=1, wait=False)
    decode = PeerProcess(backend, num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, seed=2, read_timeout_s=2.0,
                         wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prefill_id = decode.call("add_peer", prefill.metadata)
        decode_id = prefill.call("add_peer", decode.metadata)
        yield Pair(backend, prefill, decode, prefill_id, decode_id)
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture
def spawn_peer(pair: Pair) -> Iterator[Callable[..., PeerProcess]]:
    """Extra prefill peers (same backend as `pair`) for tests that close, kill or stop one; stopped at teardown."""
    started: list[PeerProcess] = []

    def spawn(**kwargs: Any) -> PeerProcess:
        peer = PeerProcess(pair.backend, num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, seed=7, **kwargs)
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        if peer.is_alive():
            peer.signal(signal.SIGCONT)  # a stopped peer cannot exit
        peer.stop()


def assert_remote_error(error: pytest.ExceptionInfo[RemoteError], type_name: str, *fragments: str) -> None:
    assert error.value.type_name == type_name, error.value
    assert error.value.is_transfer_error, error.value
    for fragment in fragments:
        assert fragment in error.value.message, error.value.message


def assert_both_alive(pair: Pair) -> None:
    assert pair.prefill.call("ping") == "pong"
    assert pair.decode.call("ping") == "pong"


# ---- registration and handshake ---------------------------------------------------------------------------------

def test_register_returns_an_envelope_with_backend_layout_and_geometry(pair: Pair) -> None:
    envelope = PeerEnvelope.decode(pair.prefill.metadata)
    assert envelope.backend == pair.backend
    assert envelope.agent_name == pair.prefill.agent_name == pair.prefill_id
    assert (envelope.num_blocks, envelope.block_bytes) == (NUM_BLOCKS, BLOCK_BYTES)
    assert envelope.layout_hash == PeerEnvelope.decode(pair.decode.metadata).layout_hash


def test_add_peer_twice_with_the_same_metadata_returns_the_same_peer(pair: Pair) -> None:
    assert pair.decode.call("add_peer", pair.prefill.metadata) == pair.prefill_id


def test_peers_on_this_host_are_read_with_the_expected_backend(pair: Pair) -> None:
    assert pair.decode.call("chosen_backend", pair.prefill_id) == READ_WITH[pair.backend]
    assert pair.prefill.call("chosen_backend", pair.decode_id) == READ_WITH[pair.backend]


@pytest.mark.parametrize(("change", "named_fields"), [
    ({"block_size": 8}, ["block_size"]),
    ({"dtype": "bfloat16", "num_layers": 4}, ["dtype", "num_layers"]),
    ({"connector_version": "0"}, ["connector_version"]),
])
def test_a_peer_with_another_layout_is_refused_naming_the_fields(pair: Pair, change: dict[str, Any],
                                                                  named_fields: list[str]) -> None:
    envelope = PeerEnvelope.decode(pair.prefill.metadata)
    other = dataclasses.replace(envelope, layout=dataclasses.replace(envelope.layout, **change))
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", other.encode())
    assert_remote_error(error, "IncompatiblePeerError", "layout_hash", *named_fields)
    assert_both_alive(pair)


def test_a_peer_of_another_backend_or_block_size_is_refused(pair: Pair) -> None:
    envelope = PeerEnvelope.decode(pair.prefill.metadata)
    other_backend = next(b for b in BACKENDS if b not in READS[pair.backend])
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", dataclasses.replace(envelope, backend=other_backend).encode())
    assert_remote_error(error, "IncompatiblePeerError", "backend", other_backend)
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", dataclasses.replace(envelope, block_bytes=BLOCK_BYTES * 2).encode())
    assert_remote_error(error, "IncompatiblePeerError", "block_bytes")


@pytest.mark.parametrize("garbage", [b"", b"not metadata", b"TKVP\x00\x00\xff\xff{", b"TKVP\x00\x00\x00\x02{}"])
def test_unreadable_metadata_is_refused_without_crashing(pair: Pair, garbage: bytes) -> None:
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", garbage)
    assert_remote_error(error, "InvalidMetadataError")
    assert_both_alive(pair)


def test_metadata_with_a_corrupt_backend_payload_is_refused_without_crashing(pair: Pair) -> None:
    envelope = PeerEnvelope.decode(pair.prefill.metadata)
    corrupt = dataclasses.replace(envelope, agent_name="someone-else", payload=b"\x00garbage" * 8)
    with pytest.raises(RemoteError) as error:
        pair.decode.call("add_peer", corrupt.encode())
    assert_remote_error(error, "InvalidMetadataError")
    assert_both_alive(pair)


# ---- reads --------------------------------------------------------------------------------------------------------

def test_read_of_scattered_and_coalescable_blocks_lands_exactly_in_the_local_blocks(pair: Pair) -> None:
    remote_ids = [3, 4, 5, 10, 11, 40, 7, 2099]
    local_ids = [20, 21, 22, 0, 1, 63, 30, 1000]
    result = pair.assert_read_lands(remote_ids, local_ids)
    assert result["num_descriptors"] == 5  # 3-5→20-22, 10-11→0-1, and three single blocks
    assert result["num_bytes"] == len(remote_ids) * BLOCK_BYTES


def test_read_coalesces_a_run_given_in_any_order(pair: Pair) -> None:
    result = pair.assert_read_lands([112, 110, 111, 113], [152, 150, 151, 153])
    assert result["num_descriptors"] == 1


def test_read_of_more_than_1024_descriptors(pair: Pair) -> None:
    remote_ids = list(range(0, NUM_BLOCKS, 2))  # no two adjacent: nothing coalesces
    local_ids = np.random.default_rng(3).permutation(remote_ids).tolist()
    result = pair.assert_read_lands(remote_ids, local_ids)
    assert result["num_descriptors"] == len(remote_ids) > 1024


def test_read_of_one_remote_block_into_several_local_blocks(pair: Pair) -> None:
    pair.assert_read_lands([9, 9, 9], [300, 302, 304])


def test_empty_read_is_done_at_once(pair: Pair) -> None:
    result = pair.read([], [])
    assert (result["status"], result["num_descriptors"]) == ("DONE", 0)


def test_checksums_of_the_read_blocks_match_on_both_sides(pair: Pair) -> None:
    remote_ids, local_ids = [50, 51, 52, 90], [500, 501, 502, 7]
    pair.assert_read_lands(remote_ids, local_ids)
    assert pair.prefill.call("checksum", remote_ids) == pair.decode.call("checksum", local_ids)
    assert pair.prefill.call("checksum", remote_ids) != pair.decode.call("checksum", [7, 500, 501, 502])


def test_fp8_kv_blocks_with_their_scales_arrive_byte_for_byte(pair: Pair) -> None:
    """Blocks of a real FP8 KV pool (e4m3 values and the scale bytes inside each block, engine/layers/kv_fp8.py),
    filled by the engine's quantizer: the connector moves them as bytes, so D's blocks must equal P's exactly (the
    same bytes read back as the same K/V: the scales are in them)."""
    import torch

    from engine.kernels import reference
    from engine.layers import kv_fp8

    # 2 heads x 2 layers x (K, V) regions of 256 bytes: 4 tokens x 60 dims of e4m3 (240), 4 scale bytes, padding
    layers, block_size, heads, dim = 2, 4, 2, 60
    assert kv_fp8.fp8_block_bytes(layers, block_size, heads, dim) == BLOCK_BYTES
    num_blocks = 5
    pool, views = kv_fp8.allocate_fp8_pool(num_blocks, layers, block_size, heads, dim, "cpu")
    generator = torch.Generator().manual_seed(11)
    slots = torch.arange(num_blocks * block_size)
    for k_cache, v_cache, k_scale, v_scale in views:
        # rows from ~2**-20 to ~2**20: scales far from 1, values that would saturate e4m3 unscaled
        rows = torch.randn(len(slots), 2 * heads, dim, generator=generator) * torch.exp2(
            torch.randint(-20, 21, (len(slots), 2 * heads, 1), generator=generator).float())
        reference.store_kv(rows[:, :heads], rows[:, heads:], k_cache, v_cache, slots, k_scale, v_scale)
    assert len(torch.unique(views[0][2])) > 10  # the scales differ from row to row
    remote_ids, local_ids = [60, 61, 62, 700, 1500], [800, 33, 34, 35, 1999]
    fp8_blocks = pool.numpy().reshape(num_blocks, BLOCK_BYTES)
    pair.prefill.call("write_blocks", remote_ids, fp8_blocks)
    try:
        before = pair.decode.call("blocks")
        result = pair.read(remote_ids, local_ids)
        assert result["status"] == "DONE", result
        after = pair.decode.call("blocks")
        expected = before.copy()
        expected[local_ids] = fp8_blocks
        np.testing.assert_array_equal(after, expected)  # exactly these bytes, nowhere else
        assert pair.prefill.call("checksum", remote_ids) == pair.decode.call("checksum", local_ids)
    finally:  # later tests read P's blocks and expect its initial pattern
        pair.prefill.call("write_blocks", remote_ids, pair.prefill.initial_blocks()[remote_ids])


@pytest.mark.parametrize(("remote_ids", "local_ids", "message"), [
    ([NUM_BLOCKS], [0], "remote block id 2100 is out of range"),
    ([0], [NUM_BLOCKS + 5], "local block id 2105 is out of range"),
    ([-1], [0], "remote block id -1 is out of range"),
    ([1, 2, 3], [1, 2], "3 remote block ids but 2 local"),
    ([1, 2], [5, 5], "local block 5 is named more than once"),
    ([1.5], [0], "flat sequence of ints"),
])
def test_bad_descriptors_raise_without_crashing_either_process(pair: Pair, remote_ids: list[int],
                                                               local_ids: list[int], message: str) -> None:
    before = pair.decode.call("blocks")
    with pytest.raises(RemoteError) as error:
        pair.read(remote_ids, local_ids)
    assert_remote_error(error, "InvalidDescriptorError", message)
    assert_both_alive(pair)
    np.testing.assert_array_equal(pair.decode.call("blocks"), before)
    pair.assert_read_lands([1], [2])  # and the connector still works


def test_unknown_peers_and_handles_raise(pair: Pair) -> None:
    with pytest.raises(RemoteError) as error:
        pair.decode.call("read", "nobody", [1], [1], 1.0)
    assert_remote_error(error, "UnknownPeerError", "nobody")
    with pytest.raises(RemoteError) as error:
        pair.decode.call("notify", "nobody", b"x")
    assert_remote_error(error, "UnknownPeerError")
    with pytest.raises(RemoteError) as error:
        pair.decode.call("remove_peer", "nobody")
    assert_remote_error(error, "UnknownPeerError")
    with pytest.raises(RemoteError) as error:
        pair.decode.call("poll_unknown")
    assert_remote_error(error, "UnknownTransferError")
    assert_both_alive(pair)


# ---- notifications ------------------------------------------------------------------------------------------------

def test_notifications_travel_both_ways_with_the_sender_id(pair: Pair) -> None:
    messages = [b"release ticket-1", b"\x00\xff binary \x00", bytes(range(256)) * 4]
    for message in messages:
        pair.decode.call("notify", pair.prefill_id, message)
    received = pair.prefill.call("notifications", len(messages), FAST_S)
    assert sorted(received) == sorted((pair.decode_id, m) for m in messages)

    pair.prefill.call("notify", pair.decode_id, b"ack")
    assert pair.decode.call("notifications", 1, FAST_S) == [(pair.prefill_id, b"ack")]


def test_an_oversized_notification_is_refused(pair: Pair) -> None:
    with pytest.raises(RemoteError) as error:
        pair.decode.call("notify", pair.prefill_id, b"x" * 5000)
    assert_remote_error(error, "InvalidRequestError", "at most")


def test_a_removed_peer_can_be_added_again_and_anyone_may_notify_a_peer(
        pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    reader = spawn_peer()
    prefill_id = reader.call("add_peer", pair.prefill.metadata)
    assert reader.call("read", prefill_id, [1, 2], [1, 2], FAST_S)["status"] == "DONE"
    reader.call("remove_peer", prefill_id)
    with pytest.raises(RemoteError) as error:
        reader.call("read", prefill_id, [1], [1], 1.0)
    assert_remote_error(error, "UnknownPeerError")
    assert reader.call("add_peer", pair.prefill.metadata) == prefill_id
    assert reader.call("read", prefill_id, [3], [3], FAST_S)["status"] == "DONE"
    # the prefill side never added this reader, and still hears from it (a decode node releasing a ticket)
    reader.call("notify", prefill_id, b"release t-9")
    assert pair.prefill.call("notifications", 1, FAST_S) == [(reader.agent_name, b"release t-9")]


# ---- peers that go away -----------------------------------------------------------------------------------------

def test_read_from_a_closed_peer_fails_quickly(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    peer = spawn_peer()
    peer_id = pair.decode.call("add_peer", peer.metadata)
    assert pair.decode.call("read", peer_id, [1], [1], FAST_S)["status"] == "DONE"
    peer.call("close")
    peer.call("close")  # idempotent
    with pytest.raises(RemoteError) as error:
        peer.call("notify", pair.decode_id, b"x")
    assert_remote_error(error, "ConnectorClosedError")
    result = pair.decode.call("read", peer_id, [2, 3], [2, 3], 2 * FAST_S)
    assert result["status"] == "FAILED" and result["seconds"] < FAST_S, result
    assert result["reason"]
    pair.decode.call("notify", peer_id, b"lost")  # best effort: no error, no hang
    pair.decode.call("remove_peer", peer_id)
    assert_both_alive(pair)


def test_connectors_leave_the_process_environment_alone(pair: Pair) -> None:
    # transport settings reach the library through its API; the process environment is the launcher's
    assert pair.prefill.call("environment_changes") == {}
    assert pair.decode.call("environment_changes") == {}
    pair.assert_read_lands([3], [3])  # and the loopback settings given through the API work


def test_read_from_a_killed_peer_fails_quickly(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    peer = spawn_peer()
    peer_id = pair.decode.call("add_peer", peer.metadata)
    assert pair.decode.call("read", peer_id, [1], [1], FAST_S)["status"] == "DONE"
    peer.kill()
    result = pair.decode.call("read", peer_id, [4, 5], [4, 5], 2 * FAST_S)
    assert result["status"] == "FAILED" and result["seconds"] < FAST_S, result
    pair.decode.call("notify", peer_id, b"lost")
    pair.decode.call("remove_peer", peer_id)
    with pytest.raises(RemoteError) as error:
        pair.decode.call("read", peer_id, [1], [1], 1.0)
    assert_remote_error(error, "UnknownPeerError")
    pair.assert_read_lands([6], [6])  # the other peer is unaffected


def test_read_from_a_hung_peer_times_out_and_the_pair_recovers(pair: Pair,
                                                               spawn_peer: Callable[..., PeerProcess]) -> None:
    """A stopped (SIGSTOP) peer. A two-sided transport needs the peer to answer, so the read times out (FAILED once
    the peer runs again and the read is over) and the pair works again. ipc reads the peer's memory itself
    (process_vm_readv, CUDA IPC): a stopped process's memory is all there and the blocks a ticket names are pinned
    under its lease, so the read must land exactly and at once, and notifications must neither block nor be lost
    while the peer cannot take them."""
    if pair.backend in ONE_SIDED_BACKENDS:
        check_a_stopped_peer_is_read_exactly(pair, spawn_peer())
        return
    # NIXL over shared memory reads a stopped process's memory directly; over TCP the peer must answer.
    peer = spawn_peer(env={"UCX_TLS": "tcp"})
    peer_id = pair.decode.call("add_peer", peer.metadata)
    assert pair.decode.call("read", peer_id, [1], [1], FAST_S)["status"] == "DONE"
    peer.signal(signal.SIGSTOP)
    # past its timeout the read is given up, but stays PENDING while its bytes may still land in blocks 8-9 (the
    # caller frees them on FAILED): UCX cannot cancel a GET (tests/multihost/test_late_writes.py)
    result = pair.decode.call("read", peer_id, [8, 9], [8, 9], 2 * 2.0)  # twice the read timeout
    assert result["status"] == "PENDING", result
    peer.signal(signal.SIGCONT)
    result = pair.decode.call("wait_read", result["transfer_id"], FAST_S)
    assert result["status"] == "FAILED" and "timed out" in str(result["reason"]), result
    assert pair.decode.call("read", peer_id, [10], [10], FAST_S)["status"] == "DONE"
    pair.decode.call("remove_peer", peer_id)


def check_a_stopped_peer_is_read_exactly(pair: Pair, peer: PeerProcess) -> None:
    peer_id = pair.decode.call("add_peer", peer.metadata)
    peer.signal(signal.SIGSTOP)
    before = pair.decode.call("blocks")
    result = pair.decode.call("read", peer_id, [8, 9, 40], [8, 9, 41], 3 * FAST_S)
    assert result["status"] == "DONE" and result["seconds"] < FAST_S, result
    expected = before.copy()
    expected[[8, 9, 41]] = peer.initial_blocks()[[8, 9, 40]]
    np.testing.assert_array_equal(pair.decode.call("blocks"), expected)
    # more messages than a stopped receiver's socket queue holds (net.unix.max_dgram_qlen is often 10)
    messages = [f"release t-{i}".encode() for i in range(25)]
    started = time.monotonic()
    for message in messages:
        pair.decode.call("notify", peer_id, message)
    assert time.monotonic() - started < FAST_S
    peer.signal(signal.SIGCONT)
    received = peer.call("notifications", len(messages), FAST_S)
    assert sorted(received) == sorted((pair.decode_id, m) for m in messages)
    pair.decode.call("remove_peer", peer_id)


def test_a_closed_connector_refuses_every_call(pair: Pair, spawn_peer: Callable[..., PeerProcess]) -> None:
    reader = spawn_peer()
    prefill_id = reader.call("add_peer", pair.prefill.metadata)
    reader.call("close")
    for command, args in [("read", (prefill_id, [1], [1], 1.0)), ("add_peer", (pair.prefill.metadata,)),
                          ("notify", (prefill_id, b"x")), ("notifications", (0, 0.0))]:
        with pytest.raises(RemoteError) as error:
            reader.call(command, *args)
        assert_remote_error(error, "ConnectorClosedError")

