"""The auto backend (kvtransfer/same_host.py): ipc for a peer on this host, NIXL (or Mooncake) for the others, and
plain nixl nodes on either side of it. The contract suite (test_contract.py) runs it too, peers on one host.

Peers are real connectors in spawned processes (tests/kvtransfer/peer_process.py). "Another host" is a peer whose
ipc metadata, built with the real IpcPayload and HostIdentity types, names another boot or namespace: exactly what
the ipc connector compares, so it refuses that peer as it refuses a peer on another machine.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any
from unittest import mock

import numpy as np
import pytest

from kvtransfer import (
    IncompatiblePeerError,
    InvalidMetadataError,
    InvalidRequestError,
    KVLayout,
    MemoryKind,
    make_connector,
)
from kvtransfer.handshake import (
    BUNDLE_MAGIC,
    PeerEnvelope,
    decode_bundle,
    encode_bundle,
    select_envelope,
)
from kvtransfer.ipc_payload import HostIdentity, IpcPayload
from tests.kvtransfer.peer_process import DEFAULT_LAYOUT, PeerProcess, RemoteError, assert_read_lands, block_pattern

LAYOUT = KVLayout(**DEFAULT_LAYOUT)
FAST_S = 5.0


def auto_envelope(parts: dict[str, bytes], agent_name: str = "p0") -> PeerEnvelope:
    return PeerEnvelope("auto", agent_name, LAYOUT, 0x7F0000000000, 64, 4096, MemoryKind.DRAM, 0,
                        encode_bundle(parts))


def part_envelope(backend: str, agent_name: str = "p0", payload: bytes = b"backend bytes") -> bytes:
    return dataclasses.replace(auto_envelope({"x": b"x"}, agent_name), backend=backend, payload=payload).encode()


def with_parts(metadata: bytes, change: Any) -> bytes:
    """An auto peer's metadata with its bundle rewritten: `change(parts)` returns the new {backend: part}."""
    envelope = PeerEnvelope.decode(metadata)
    return dataclasses.replace(envelope, payload=encode_bundle(change(decode_bundle(envelope.payload)))).encode()


def on_another_host(metadata: bytes, **host_changes: str) -> bytes:
    """An auto peer's metadata whose ipc part names another host identity (boot id, namespace, host name)."""
    def change(parts: dict[str, bytes]) -> dict[str, bytes]:
        ipc = PeerEnvelope.decode(parts["ipc"])
        payload = IpcPayload.decode(ipc.payload)
        moved = dataclasses.replace(payload, host=dataclasses.replace(payload.host, **host_changes))
        return {**parts, "ipc": dataclasses.replace(ipc, payload=moved.encode()).encode()}

    return with_parts(metadata, change)


# ---- the bundle: format and errors (no connector) --------------------------------------------------------------

def test_a_bundle_is_the_documented_length_prefixed_layout() -> None:
    ipc, nixl = part_envelope("ipc"), part_envelope("nixl")
    expected = (b"TKVB" + bytes([1, 2]) + bytes([3]) + b"ipc" + struct.pack(">I", len(ipc)) + ipc
                + bytes([4]) + b"nixl" + struct.pack(">I", len(nixl)) + nixl)
    assert encode_bundle({"ipc": ipc, "nixl": nixl}) == expected
    assert decode_bundle(expected) == {"ipc": ipc, "nixl": nixl}


def _bundle_with(*, version: int = 1, count: int = 1, name: bytes = b"nixl", length: int | None = None,
                 part: bytes = b"abc", trailer: bytes = b"") -> bytes:
    length = len(part) if length is None else length
    return (BUNDLE_MAGIC + bytes([version, count, len(name)]) + name + struct.pack(">I", length) + part + trailer)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "bad magic"),
    (b"TKVP" + bytes(10), "bad magic"),
    (_bundle_with(version=2), "version 2 is not supported"),
    (_bundle_with(count=0), "has 0 parts"),
    (_bundle_with(count=200), "has 200 parts"),
    (_bundle_with(count=2), "truncated in part 1"),
    (_bundle_with(name=b""), "bad or repeated backend name"),
    (_bundle_with(name=b"NIXL"), "bad or repeated backend name"),
    (_bundle_with(name=b"\xffnixl"), "bad or repeated backend name"),
    (_bundle_with(length=0, part=b""), "empty or truncated"),
    (_bundle_with(length=1 << 31), "empty or truncated"),
    (_bundle_with(trailer=b"\x00"), "1 stray bytes"),
    (BUNDLE_MAGIC + bytes([1, 2, 4]) + b"nixl" + struct.pack(">I", 1) + b"a" + bytes([4]) + b"nixl"
     + struct.pack(">I", 1) + b"b", "bad or repeated backend name 'nixl'"),
])
def test_a_malformed_bundle_is_invalid_metadata_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(InvalidMetadataError, match="bundle|payload") as error:
        decode_bundle(data)
    assert message in str(error.value)


def test_every_truncation_and_random_corruption_of_a_bundle_is_invalid_metadata_never_a_crash() -> None:
    bundle = encode_bundle({"ipc": part_envelope("ipc"), "nixl": part_envelope("nixl")})
    for end in range(len(bundle)):
        with pytest.raises(InvalidMetadataError):
            decode_bundle(bundle[:end])
    rng = np.random.default_rng(0)
    for _ in range(500):
        data = bytearray(bundle)
        for position in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            data[position] = int(rng.integers(0, 256))
        try:
            decode_bundle(bytes(data))
        except InvalidMetadataError:
            pass
        metadata = dataclasses.replace(auto_envelope({"x": b"x"}), payload=bytes(data)).encode()
        for backend in ("nixl", "ipc"):
            try:
                select_envelope(metadata, backend)
            except IncompatiblePeerError:  # InvalidMetadataError included: a part missing, or not readable
                pass


def test_select_envelope_takes_a_backends_part_of_an_auto_peer_and_plain_metadata_as_it_is() -> None:
    ipc, nixl = part_envelope("ipc"), part_envelope("nixl")
    auto = auto_envelope({"ipc": ipc, "nixl": nixl}).encode()
    assert select_envelope(auto, "nixl") == (PeerEnvelope.decode(nixl), nixl)
    assert select_envelope(auto, "ipc") == (PeerEnvelope.decode(ipc), ipc)
    assert select_envelope(auto, "auto") == (PeerEnvelope.decode(auto), auto)
    assert select_envelope(nixl, "mooncake") == (PeerEnvelope.decode(nixl), nixl)  # check_compatible refuses it
    with pytest.raises(IncompatiblePeerError, match="backend \\(ours 'mooncake', peer 'auto' offering ipc, nixl\\)"):
        select_envelope(auto, "mooncake")
    impostor = auto_envelope({"nixl": part_envelope("nixl", agent_name="someone-else")}).encode()
    with pytest.raises(InvalidMetadataError, match="agent 'someone-else'"):
        select_envelope(impostor, "nixl")
    mislabelled = auto_envelope({"nixl": part_envelope("mooncake")}).encode()
    with pytest.raises(InvalidMetadataError, match="envelope of backend 'mooncake'"):
        select_envelope(mislabelled, "nixl")
    with pytest.raises(InvalidMetadataError, match="not a Tandem KV envelope"):
        select_envelope(auto_envelope({"nixl": b"garbage"}).encode(), "nixl")


def test_make_connector_auto_refuses_bad_options_before_starting_anything() -> None:
    with pytest.raises(InvalidRequestError, match="cross_host must be one of \\['nixl', 'mooncake'\\], got 'ipc'"):
        make_connector("auto", layout=LAYOUT, cross_host="ipc")
    with pytest.raises(InvalidRequestError, match="ipc_options must be a mapping"):
        make_connector("auto", layout=LAYOUT, ipc_options=[("read_threads", 2)])
    with pytest.raises(InvalidRequestError, match="read_threads must be an int >= 1"):
        make_connector("auto", layout=LAYOUT, ipc_options={"read_threads": 0})


# ---- auto and plain nixl peers in their own processes -----------------------------------------------------------

@dataclasses.dataclass
class Peers:
    auto_p: PeerProcess
    auto_d: PeerProcess
    nixl: PeerProcess  # read by auto_d (its blocks < 32) and reading auto_p (into its blocks >= 32)


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    started = [PeerProcess(backend, seed=seed, wait=False, read_timeout_s=FAST_S)
               for backend, seed in (("auto", 1), ("auto", 2), ("nixl", 3))]
    try:
        for peer in started:
            peer.wait_ready()
        yield Peers(*started)
    finally:
        for peer in started:
            peer.stop()


def test_an_auto_node_offers_ipc_and_nixl_under_its_agent_name(peers: Peers) -> None:
    envelope = PeerEnvelope.decode(peers.auto_p.metadata)
    assert (envelope.backend, envelope.agent_name) == ("auto", peers.auto_p.agent_name)
    parts = decode_bundle(envelope.payload)
    assert list(parts) == ["ipc", "nixl"]
    for backend, part in parts.items():
        inner = PeerEnvelope.decode(part)
        assert (inner.backend, inner.agent_name, inner.layout_hash) == (backend, envelope.agent_name,
                                                                        envelope.layout_hash)
    assert IpcPayload.decode(PeerEnvelope.decode(parts["ipc"]).payload).host == HostIdentity.current()


def test_two_auto_peers_on_this_host_read_each_other_over_ipc(peers: Peers) -> None:
    p_id = peers.auto_d.call("add_peer", peers.auto_p.metadata)
    assert p_id == peers.auto_p.agent_name
    assert peers.auto_d.call("chosen_backend", p_id) == "ipc"
    result = assert_read_lands(peers.auto_d, p_id, peers.auto_p, [1, 2, 3, 40], [10, 11, 12, 0])
    assert result["num_descriptors"] == 2
    peers.auto_d.call("remove_peer", p_id)


@pytest.mark.parametrize("host_change", [{"boot_id": "another-boot"}, {"net_namespace": "net:[1]"},
                                         {"hostname": "node-b", "pid_namespace": "pid:[1]"}])
def test_a_peer_whose_ipc_part_names_another_host_is_read_over_nixl(peers: Peers, host_change: dict[str, str]
                                                                     ) -> None:
    elsewhere = on_another_host(peers.auto_p.metadata, **host_change)
    p_id = peers.auto_d.call("add_peer", elsewhere)
    assert p_id == peers.auto_p.agent_name
    assert peers.auto_d.call("chosen_backend", p_id) == "nixl"
    assert_read_lands(peers.auto_d, p_id, peers.auto_p, [5, 6, 63], [20, 21, 1])
    # P never added D: D's release reaches P over NIXL, named by D's agent name
    peers.auto_d.call("notify", p_id, b"release t-1")
    assert peers.auto_p.call("notifications", 1, FAST_S) == [(peers.auto_d.agent_name, b"release t-1")]
    # P reads D over ipc (D's metadata is real): its message arrives over ipc, and still names the peer D knows
    d_id = peers.auto_p.call("add_peer", peers.auto_d.metadata)
    assert peers.auto_p.call("chosen_backend", d_id) == "ipc"
    peers.auto_p.call("notify", d_id, b"ack")
    assert peers.auto_d.call("notifications", 1, FAST_S) == [(p_id, b"ack")]
    # the same peer's real metadata (it re-registered, say) moves it back to ipc
    assert peers.auto_d.call("add_peer", peers.auto_p.metadata) == p_id
    assert peers.auto_d.call("chosen_backend", p_id) == "ipc"
    assert_read_lands(peers.auto_d, p_id, peers.auto_p, [7], [22])
    for reader, peer in ((peers.auto_d, p_id), (peers.auto_p, d_id)):
        reader.call("remove_peer", peer)


def test_an_auto_decode_node_reads_a_plain_nixl_prefill_node_over_nixl(peers: Peers) -> None:
    p_id = peers.auto_d.call("add_peer", peers.nixl.metadata)
    assert p_id == peers.nixl.agent_name
    assert peers.auto_d.call("chosen_backend", p_id) == "nixl"
    assert_read_lands(peers.auto_d, p_id, peers.nixl, [4, 5, 6, 9], [30, 31, 32, 2])
    assert peers.auto_d.call("add_peer", peers.nixl.metadata) == p_id  # once more: the same peer
    peers.auto_d.call("notify", p_id, b"release t-2")
    assert peers.nixl.call("notifications", 1, FAST_S) == [(peers.auto_d.agent_name, b"release t-2")]
    d_id = peers.nixl.call("add_peer", peers.auto_d.metadata)  # the nixl node reads the auto node's nixl part
    assert d_id == peers.auto_d.agent_name
    peers.nixl.call("notify", d_id, b"ack")
    assert peers.auto_d.call("notifications", 1, FAST_S) == [(p_id, b"ack")]
    peers.auto_d.call("remove_peer", p_id)
    peers.nixl.call("remove_peer", d_id)


def test_a_plain_nixl_decode_node_reads_an_auto_prefill_node(peers: Peers) -> None:
    p_id = peers.nixl.call("add_peer", peers.auto_p.metadata)
    assert p_id == peers.auto_p.agent_name
    assert_read_lands(peers.nixl, p_id, peers.auto_p, [11, 12, 50], [40, 41, 42])
    assert peers.nixl.call("add_peer", peers.auto_p.metadata) == p_id
    peers.nixl.call("notify", p_id, b"release t-3")
    assert peers.auto_p.call("notifications", 1, FAST_S) == [(peers.nixl.agent_name, b"release t-3")]
    peers.nixl.call("remove_peer", p_id)


def assert_refused(peer: PeerProcess, metadata: bytes, type_name: str, *fragments: str) -> None:
    with pytest.raises(RemoteError) as error:
        peer.call("add_peer", metadata)
    assert error.value.type_name == type_name, error.value
    for fragment in fragments:
        assert fragment in error.value.message, error.value.message
    assert peer.call("ping") == "pong"


def test_malformed_auto_metadata_is_refused_by_auto_and_nixl_nodes_without_crashing(peers: Peers) -> None:
    envelope = PeerEnvelope.decode(peers.auto_p.metadata)
    for cut in (0, 3, 6, 9, 20, len(envelope.payload) // 2, len(envelope.payload) - 1):
        truncated = dataclasses.replace(envelope, payload=envelope.payload[:cut]).encode()
        assert_refused(peers.auto_d, truncated, "InvalidMetadataError", "bundle")
        assert_refused(peers.nixl, truncated, "InvalidMetadataError", "bundle")
    assert_refused(peers.auto_d, peers.auto_p.metadata[:-5], "InvalidMetadataError")
    # a well-formed bundle whose nixl part is garbage, with an ipc part that is refused (another host)
    garbage = with_parts(on_another_host(peers.auto_p.metadata, boot_id="b"), lambda parts: {
        "ipc": parts["ipc"], "nixl": dataclasses.replace(PeerEnvelope.decode(parts["nixl"]),
                                                         payload=b"\x00garbage" * 8).encode()})
    assert_refused(peers.auto_d, garbage, "InvalidMetadataError", "NIXL rejected")
    assert_refused(peers.nixl, garbage, "InvalidMetadataError", "NIXL rejected")
    # an auto peer on another host whose cross-host backend is Mooncake: neither of our paths can read it
    mooncake_across = with_parts(on_another_host(peers.auto_p.metadata, boot_id="b"), lambda parts: {
        "ipc": parts["ipc"], "mooncake": dataclasses.replace(PeerEnvelope.decode(parts["nixl"]),
                                                             backend="mooncake").encode()})
    assert_refused(peers.auto_d, mooncake_across, "IncompatiblePeerError", "ipc refused it", "boot_id",
                   "offers no nixl metadata (it offers ipc, mooncake)")
    assert_refused(peers.nixl, mooncake_across, "IncompatiblePeerError", "peer 'auto' offering ipc, mooncake")
    # one offering ipc only: the ipc refusal itself, as from a plain ipc peer
    ipc_only = with_parts(on_another_host(peers.auto_p.metadata, boot_id="b"), lambda parts: {"ipc": parts["ipc"]})
    assert_refused(peers.auto_d, ipc_only, "IncompatiblePeerError", "differs in boot_id", "use nixl or mooncake")
    with pytest.raises(RemoteError, match="UnknownPeerError"):  # nothing of the refused peers was kept
        peers.auto_d.call("read", peers.auto_p.agent_name, [1], [1], 1.0)


# ---- cross-host Mooncake, and a node where ipc cannot run ------------------------------------------------------

def test_auto_with_mooncake_across_hosts_uses_ipc_here_and_mooncake_for_another_host() -> None:
    mooncake = {"kv_cross_host_backend": "mooncake"}
    prefill = PeerProcess("auto", seed=5, transport=mooncake, wait=False, read_timeout_s=FAST_S)
    decode = PeerProcess("auto", seed=6, transport=mooncake, wait=False, read_timeout_s=FAST_S)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        assert list(decode_bundle(PeerEnvelope.decode(prefill.metadata).payload)) == ["ipc", "mooncake"]
        p_id = decode.call("add_peer", prefill.metadata)
        assert decode.call("chosen_backend", p_id) == "ipc"
        assert_read_lands(decode, p_id, prefill, [1, 2], [3, 4])
        assert decode.call("add_peer", on_another_host(prefill.metadata, boot_id="another-boot")) == p_id
        assert decode.call("chosen_backend", p_id) == "mooncake"
        assert_read_lands(decode, p_id, prefill, [8, 9, 10, 60], [50, 51, 52, 5])
    finally:
        prefill.stop()
        decode.stop()


def _launched() -> None:
    import os

    from tests.kvtransfer.peer_process import launch_environment

    os.environ.update(launch_environment(FAST_S))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _auto_node_without_ipc() -> dict[str, Any]:
    """In a spawned process: P an auto connector, D one made where the ipc backend cannot start (no /proc: no
    process start time); D reads P over NIXL. What happened, for the test to check."""
    from kvtransfer import KVRegion, TransferStatus
    from kvtransfer.ipc_payload import ProcessRef
    from kvtransfer.same_host import AutoConnector
    from settings import TransportSettings

    records = _Records()
    logging.getLogger("kvtransfer.same_host").addHandler(records)
    logging.getLogger("kvtransfer.same_host").setLevel(logging.INFO)
    options = TransportSettings(ucx_devices="lo").connector_options("auto")
    source, destination = block_pattern(1, 64, 4096), block_pattern(2, 64, 4096)
    with make_connector("auto", layout=LAYOUT, **options) as prefill:
        assert isinstance(prefill, AutoConnector)
        prefill.register(KVRegion.from_buffer(source))
        with mock.patch.object(ProcessRef, "current", return_value=None):
            decode = make_connector("auto", layout=LAYOUT, **options)
        with decode:
            assert isinstance(decode, AutoConnector)
            decode.register(KVRegion.from_buffer(destination))
            peer_ids = [decode.add_peer(prefill.metadata) for _ in range(3)]
            handle = decode.read(peer_ids[0], [1, 2, 63], [5, 6, 7])
            while (status := decode.poll(handle)) is TransferStatus.PENDING:
                prefill.progress()
            d_id = prefill.add_peer(decode.metadata)
            return {"unavailable": decode.ipc_unavailable, "chosen": decode.chosen_backend(peer_ids[0]),
                    "peer_ids": peer_ids, "prefill_name": prefill.agent_name, "status": status.name,
                    "landed": destination.copy(), "parts": list(decode_bundle(PeerEnvelope.decode(
                        decode.metadata).payload)), "prefill_chose": prefill.chosen_backend(d_id),
                    "logs": [(r.levelname, r.getMessage()) for r in records.records]}


def test_an_auto_node_where_ipc_cannot_run_works_over_nixl_alone() -> None:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_launched) as pool:
        got = pool.submit(_auto_node_without_ipc).result(timeout=120)
    assert "needs /proc" in got["unavailable"]
    assert got["parts"] == ["nixl"]  # it offers no ipc path to its peers either
    assert got["peer_ids"] == [got["prefill_name"]] * 3 and got["chosen"] == "nixl"
    assert got["prefill_chose"] == "nixl"
    assert got["status"] == "DONE"
    expected = block_pattern(2, 64, 4096)
    expected[[5, 6, 7]] = block_pattern(1, 64, 4096)[[1, 2, 63]]
    np.testing.assert_array_equal(got["landed"], expected)
    warnings = [message for level, message in got["logs"] if level == "WARNING"]
    assert len(warnings) == 1 and "runs without ipc" in warnings[0]
    chosen = [message for level, message in got["logs"] if level == "INFO" and "reading over" in message]
    # one line per peer, however often a ticket names it, saying which path and why
    assert len(chosen) == 2, chosen
    assert f"KV peer {got['prefill_name']}: reading over nixl (the peer offers ipc, but this node runs without " \
           "it" in chosen[0]
    assert "reading over nixl (the peer offers nixl, not ipc)" in chosen[1]

