"""The CPU-side pieces of the ipc backend: its payload, the iovec batches of process_vm_readv and the reads they
make, process identity, the notification socket, and the checks add_peer makes. The connector itself runs the
contract suite (test_contract.py); its GPU path is test_ipc_gpu.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtransfer import (
    IncompatiblePeerError,
    InvalidMetadataError,
    KVLayout,
    KVRegion,
    MemoryKind,
    PeerDisconnectedError,
    TransferStatus,
    make_connector,
)
from kvtransfer.handshake import PeerEnvelope
from kvtransfer.ipc import IpcConnector
from kvtransfer.ipc_host import IOV_MAX, explain_errno, plan_iovec_batches, read_process_memory
from kvtransfer.ipc_notify import NotificationSocket, is_bound, socket_address
from kvtransfer.ipc_payload import (
    CudaShare,
    HostIdentity,
    IpcPayload,
    ProcessRef,
    process_gone_reason,
    process_start_time,
)

LAYOUT = KVLayout("tiny", "float32", 2, 2, 8, 4, 1)
SHARE = CudaShare(handle=b"c" + bytes(range(64)), storage_bytes=1 << 20, storage_offset_bytes=0,
                  ref_counter_handle=b"/torch_123_456_0", ref_counter_offset=3, event_handle=bytes(64),
                  event_sync_required=True, region_offset_bytes=4096, device_uuid="GPU-0000")
HOST = HostIdentity("node-a", "6f809d2e-0e81-404e-a250-e55ace608d1c", "pid:[4026531836]", "net:[4026531833]")


def payload_record(cuda: bool = False) -> dict[str, object]:
    payload = IpcPayload(HOST, ProcessRef(1234, 99), "tandem-kv/P/0123456789abcdef", SHARE if cuda else None)
    record: dict[str, object] = json.loads(payload.encode())
    return record


# ---- payload ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda", [False, True])
def test_payload_round_trips_through_plain_json(cuda: bool) -> None:
    payload = IpcPayload(HOST, ProcessRef(1234, 99), "tandem-kv/P/0123456789abcdef", SHARE if cuda else None)
    data = payload.encode()
    assert IpcPayload.decode(data) == payload
    record = json.loads(data)  # plain JSON: no pickled objects, bytes as base64 text
    assert record["process"] == {"pid": 1234, "start_time": 99}
    if cuda:
        assert record["cuda"]["handle"] == "YwABAgMEBQYHCAkKCwwNDg8QERITFBUWFxgZGhscHR4fICEiIyQlJicoKSorLC0uLzA" \
                                           "xMjM0NTY3ODk6Ozw9Pj8="


def _corrupt(path: str, value: object, cuda: bool = False) -> bytes:
    record = payload_record(cuda)
    target = record
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[key]  # type: ignore[assignment, index]
    if value is KeyError:
        del target[keys[-1]]  # type: ignore[attr-defined]
    else:
        target[keys[-1]] = value  # type: ignore[index]
    return json.dumps(record).encode()


@pytest.mark.parametrize(("data", "message"), [
    (b"", "malformed"),
    (b"\x00garbage" * 8, "malformed"),
    (b"\xff\xfe not utf-8", "malformed"),
    (b"[1, 2]", "not a mapping"),
    (b"{" + b" " * (1 << 16) + b"}", "more than"),
    (_corrupt("version", 2), "version 2 is not supported"),
    (_corrupt("version", True), "version True is not supported"),
    (_corrupt("host", KeyError), "KeyError"),
    (_corrupt("host", "node-a"), "must be mappings"),
    (_corrupt("host.boot_id", 7), "boot_id must be str"),
    (_corrupt("process.pid", "1234"), "pid must be int"),
    (_corrupt("process.pid", True), "pid must be int"),
    (_corrupt("process.pid", 0), "names pid 0"),
    (_corrupt("process.start_time", -5), "start_time must be >= 0"),
    (_corrupt("socket_name", "/tmp/sock"), "not one of ours"),
    (_corrupt("socket_name", "tandem-kv/P/0123456789abcdef\x00x"), "not one of ours"),
    (_corrupt("cuda", [1]), "cuda must be a mapping"),
    (_corrupt("cuda.handle", "not base64!", cuda=True), "malformed"),
    (_corrupt("cuda.handle", "", cuda=True), "handle is empty"),
    (_corrupt("cuda.handle", "A" * 10000, cuda=True), "too long"),
    (_corrupt("cuda.event_handle", "AAAA", cuda=True), "event handle is 3 bytes"),
    (_corrupt("cuda.event_sync_required", 1, cuda=True), "event_sync_required must be bool"),
    (_corrupt("cuda.storage_bytes", 1.5, cuda=True), "storage_bytes must be int"),
    (_corrupt("cuda.ref_counter_handle", "AGE=", cuda=True), "NUL byte"),
])
def test_a_bad_payload_is_refused_with_invalid_metadata_and_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(InvalidMetadataError, match="ipc payload") as error:
        IpcPayload.decode(data)
    assert message in str(error.value)


def test_random_payload_bytes_never_raise_anything_but_invalid_metadata() -> None:
    rng = np.random.default_rng(0)
    valid = IpcPayload(HOST, ProcessRef(1234, 99), "tandem-kv/P/0123456789abcdef", SHARE).encode()
    for _ in range(300):
        data = bytearray(valid)
        for position in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            data[position] = int(rng.integers(0, 256))
        try:
            IpcPayload.decode(bytes(data))
        except InvalidMetadataError:
            pass


def test_host_identity_names_every_differing_field() -> None:
    other = dataclasses.replace(HOST, boot_id="another-boot", net_namespace="net:[1]")
    assert HOST.differences(HOST) == []
    assert HOST.differences(other) == [
        "boot_id (ours '6f809d2e-0e81-404e-a250-e55ace608d1c', peer 'another-boot')",
        "net_namespace (ours 'net:[4026531833]', peer 'net:[1]')"]
    current = HostIdentity.current()
    assert current.hostname == socket.gethostname()
    assert current.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert current.pid_namespace == os.readlink("/proc/self/ns/pid")


# ---- process identity ---------------------------------------------------------------------------------------------

def test_start_time_is_stat_field_22_even_when_the_command_name_holds_spaces_and_parentheses(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"  # the process's comm becomes this name: "pid (a) b (c) S ..."
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/comm").read_text().strip() != "a) b (c" and time.monotonic() < deadline:
            time.sleep(0.01)
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert stat.startswith(f"{child.pid} (a) b (c) ")
        fields_after_comm = stat[len(f"{child.pid} (a) b (c) "):].split()
        assert process_start_time(child.pid) == int(fields_after_comm[22 - 3])
        assert process_start_time(child.pid) >= process_start_time(os.getpid())  # type: ignore[operator]
    finally:
        child.kill()
        child.wait()


def test_an_exited_zombie_or_reused_pid_is_gone() -> None:
    me = ProcessRef.current()
    assert me is not None and me.pid == os.getpid()
    assert process_gone_reason(me) is None
    reused = dataclasses.replace(me, start_time=me.start_time + 1)
    assert "now names another process" in str(process_gone_reason(reused))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while "Z" not in Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0]:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert process_start_time(child.pid) is None  # exited, not yet reaped: a zombie
    child.wait()
    assert process_start_time(child.pid) is None
    assert "has exited" in str(process_gone_reason(ProcessRef(child.pid, 1)))


# ---- iovec batches and process_vm_readv ---------------------------------------------------------------------------

def test_iovec_batches_hold_at_most_iov_max_ranges_and_max_bytes_and_cover_every_copy() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 5000, size=2500).tolist() + [25_000]  # the last copy is cut into pieces
    local = np.cumsum([0, *lengths[:-1]]).tolist()
    remote = (np.cumsum([0, *lengths[:-1]]) + 10**6).tolist()
    batches = plan_iovec_batches(local, remote, lengths, max_bytes=10_000)
    assert all(len(b.local) == len(b.remote) <= IOV_MAX for b in batches)
    assert all(b.num_bytes == int(b.local[:, 1].sum()) == int(b.remote[:, 1].sum()) <= 10_000 for b in batches)
    assert all(b.local.dtype == np.uint64 and b.local.flags.c_contiguous for b in batches)
    # every byte of every copy appears exactly once, at the same offset on both sides
    covered = np.zeros(sum(lengths), dtype=np.int64)
    for batch in batches:
        for (l_addr, l_len), (r_addr, r_len) in zip(batch.local.tolist(), batch.remote.tolist(), strict=True):
            assert l_len == r_len and r_addr - l_addr == 10**6
            covered[l_addr:l_addr + l_len] += 1
    assert (covered == 1).all()
    assert [len(b.local) for b in plan_iovec_batches(local[:2500], remote[:2500], lengths[:2500],
                                                     max_bytes=1 << 30)] == [1024, 1024, 452]


def test_process_vm_readv_moves_scattered_ranges_in_several_calls_exactly() -> None:
    source = np.random.default_rng(2).integers(0, 256, size=(3000, 64), dtype=np.uint8)
    target = np.zeros_like(source)
    rows = np.random.default_rng(3).permutation(3000)[:2100]
    batches = plan_iovec_batches([target[i].ctypes.data for i in range(2100)],
                                 [source[r].ctypes.data for r in rows], [64] * 2100)
    assert len(batches) == 3
    assert read_process_memory(os.getpid(), batches) is None
    np.testing.assert_array_equal(target[:2100], source[rows])
    np.testing.assert_array_equal(target[2100:], 0)


def test_process_vm_readv_failures_come_back_as_reasons() -> None:
    buffer = np.zeros(64, dtype=np.uint8)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    batches = plan_iovec_batches([buffer.ctypes.data], [buffer.ctypes.data + 8], [8])
    gone = read_process_memory(child.pid, batches)
    assert gone is not None and gone.errno == errno.ESRCH and "has exited" in gone.reason
    unmapped = read_process_memory(os.getpid(), plan_iovec_batches([buffer.ctypes.data], [4096], [8]))
    assert unmapped is not None and unmapped.errno == errno.EFAULT and "not mapped" in unmapped.reason
    # the first range arrives, the second is not mapped: a short read
    short = read_process_memory(os.getpid(), plan_iovec_batches(
        [buffer.ctypes.data, buffer.ctypes.data + 8], [buffer.ctypes.data + 32, 4096], [8, 8]))
    assert short is not None and short.errno == 0 and "8 of 16 bytes" in short.reason
    assert "same user" in explain_errno(errno.EPERM, 1) and "ptrace_scope" in explain_errno(errno.EPERM, 1)


# ---- notifications ------------------------------------------------------------------------------------------------

@pytest.fixture
def sockets() -> Iterator[tuple[NotificationSocket, NotificationSocket]]:
    sender, receiver = NotificationSocket("decode node/1"), NotificationSocket("prefill-1")
    yield sender, receiver
    sender.close()
    receiver.close()


def drain(receiver: NotificationSocket, sender: NotificationSocket, count: int) -> list[tuple[str, bytes]]:
    received: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 5
    while len(received) < count and time.monotonic() < deadline:
        received += receiver.receive()
        sender.flush()
    return received


def test_notifications_carry_the_sender_and_keep_their_order_through_a_full_queue(
        sockets: tuple[NotificationSocket, NotificationSocket]) -> None:
    sender, receiver = sockets
    assert sender.name.startswith("tandem-kv/decode_node_1/") and is_bound(sender.name)
    max_queue = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    messages = [f"m{i}".encode() for i in range(max_queue + 40)] + [b"", b"\x00" * 4096]
    for message in messages:
        sender.send(receiver.name, message)  # never blocks: what finds the queue full waits in the outbox
    assert drain(receiver, sender, len(messages)) == [("decode node/1", m) for m in messages]


def test_sending_to_a_closed_socket_drops_the_message_and_is_bound_says_so(
        sockets: tuple[NotificationSocket, NotificationSocket]) -> None:
    sender, receiver = sockets
    name = receiver.name
    receiver.close()
    assert not is_bound(name)
    sender.send(name, b"lost")
    sender.flush()
    assert not is_bound("tandem-kv/nobody/0000000000000000")


def test_datagrams_that_are_not_notifications_are_dropped(sockets: tuple[NotificationSocket, NotificationSocket]
                                                          ) -> None:
    sender, receiver = sockets
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
        for datagram in (b"", b"hello", b"TKN1\x00", b"TKN1\x00\x00x", b"TKN1\x00\x09short", b"TKN1\x00\x02\xff\xfe",
                         b"TKN1\x00\x01a" + b"x" * 4097):
            stranger.sendto(datagram, socket_address(receiver.name))
    sender.send(receiver.name, b"real")
    assert drain(receiver, sender, 1) == [("decode node/1", b"real")]
    assert receiver.receive() == []


# ---- add_peer's checks, and reads in one process ------------------------------------------------------------------

@pytest.fixture
def pair() -> Iterator[tuple[IpcConnector, IpcConnector, np.ndarray, np.ndarray]]:
    prefill_kv = np.random.default_rng(4).integers(0, 256, size=(64, 1024), dtype=np.uint8)
    decode_kv = np.zeros_like(prefill_kv)
    prefill = make_connector("ipc", layout=LAYOUT, agent_name="P")
    decode = make_connector("ipc", layout=LAYOUT, agent_name="D", read_timeout_s=5.0)
    assert isinstance(prefill, IpcConnector) and isinstance(decode, IpcConnector)
    prefill.register(KVRegion.from_buffer(prefill_kv))
    decode.register(KVRegion.from_buffer(decode_kv))
    yield prefill, decode, prefill_kv, decode_kv
    prefill.close()
    decode.close()


def with_payload(metadata: bytes, **changes: object) -> bytes:
    envelope = PeerEnvelope.decode(metadata)
    payload = IpcPayload.decode(envelope.payload)
    return dataclasses.replace(envelope, payload=dataclasses.replace(payload, **changes).encode()).encode()


def test_connectors_in_one_process_read_each_other(pair: tuple[IpcConnector, IpcConnector, np.ndarray, np.ndarray]
                                                   ) -> None:
    prefill, decode, prefill_kv, decode_kv = pair
    peer = decode.add_peer(prefill.metadata)
    handle = decode.read(peer, [5, 6, 7, 60], [0, 1, 2, 63])
    assert decode.wait(handle, 5.0) is TransferStatus.DONE and handle.num_descriptors == 2
    expected = np.zeros_like(decode_kv)
    expected[[0, 1, 2, 63]] = prefill_kv[[5, 6, 7, 60]]
    np.testing.assert_array_equal(decode_kv, expected)


def test_a_peer_on_another_host_or_namespace_is_refused_naming_the_fields(
        pair: tuple[IpcConnector, IpcConnector, np.ndarray, np.ndarray]) -> None:
    prefill, decode, _, _ = pair
    elsewhere = dataclasses.replace(HostIdentity.current(), hostname="other-host", pid_namespace="pid:[1]")
    with pytest.raises(IncompatiblePeerError, match="same host|this host") as error:
        decode.add_peer(with_payload(prefill.metadata, host=elsewhere))
    assert "hostname" in str(error.value) and "pid_namespace" in str(error.value)
    assert "boot_id" not in str(error.value)
    assert decode.peers == []


def test_a_peer_with_the_other_memory_kind_is_refused(pair: tuple[IpcConnector, IpcConnector, np.ndarray, np.ndarray]
                                                      ) -> None:
    prefill, decode, _, _ = pair
    gpu_envelope = dataclasses.replace(PeerEnvelope.decode(prefill.metadata), memory_kind=MemoryKind.VRAM)
    with pytest.raises(IncompatiblePeerError, match="its KV pool is in VRAM, ours in DRAM"):
        decode.add_peer(gpu_envelope.encode())
    with pytest.raises(InvalidMetadataError, match="a CUDA IPC share"):
        decode.add_peer(with_payload(prefill.metadata, cuda=SHARE))


def test_a_peer_whose_process_is_gone_or_whose_pool_is_elsewhere_is_refused(
        pair: tuple[IpcConnector, IpcConnector, np.ndarray, np.ndarray]) -> None:
    prefill, decode, _, _ = pair
    me = ProcessRef.current()
    assert me is not None
    with pytest.raises(PeerDisconnectedError, match="now names another process"):
        decode.add_peer(with_payload(prefill.metadata, process=dataclasses.replace(me, start_time=1)))
    with pytest.raises(PeerDisconnectedError, match="has closed its connector"):
        decode.add_peer(with_payload(prefill.metadata, socket_name="tandem-kv/P/0000000000000000"))
    moved = dataclasses.replace(PeerEnvelope.decode(prefill.metadata), base_address=4096)
    with pytest.raises(InvalidMetadataError, match="not mapped where its metadata says"):
        decode.add_peer(moved.encode())
    assert decode.peers == []


def test_a_read_aborted_by_timeout_or_remove_peer_writes_nothing_after_failed() -> None:
    num_blocks, block_bytes = 64, 1 << 20  # 64 MiB: the read is still running when it is polled
    prefill_kv = np.full((num_blocks, block_bytes), 7, dtype=np.uint8)
    decode_kv = np.zeros_like(prefill_kv)
    with make_connector("ipc", layout=LAYOUT) as prefill, \
            make_connector("ipc", layout=LAYOUT, read_timeout_s=1e-6) as decode:
        prefill.register(KVRegion.from_buffer(prefill_kv))
        decode.register(KVRegion.from_buffer(decode_kv))
        peer = decode.add_peer(prefill.metadata)
        handle = decode.read(peer, list(range(num_blocks)), list(range(num_blocks)))
        assert decode.poll(handle) is TransferStatus.FAILED
        assert "timed out" in str(decode.failure_reason(handle))
        snapshot = decode_kv.copy()
        time.sleep(0.05)
        np.testing.assert_array_equal(decode_kv, snapshot)  # the worker finished before FAILED was answered

        handle = decode.read(peer, list(range(num_blocks)), list(range(num_blocks)))
        decode.remove_peer(peer)
        assert decode.poll(handle) is TransferStatus.FAILED
        assert decode.failure_reason(handle) == "the peer was removed"
        snapshot = decode_kv.copy()
        time.sleep(0.05)
        np.testing.assert_array_equal(decode_kv, snapshot)


def test_copy_runs_lands_each_run_in_its_local_blocks() -> None:
    import torch

    from kvtransfer.descriptors import coalesce_runs
    from kvtransfer.ipc_cuda import byte_view, copy_runs

    remote_owner = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 16)  # 64 bytes a block
    remote = byte_view(remote_owner.untyped_storage(), 0, 40, 64, remote_owner.device)
    local = torch.zeros(50, 64, dtype=torch.uint8)
    remote_ids, local_ids = [3, 4, 5, 10, 11, 39, 7], [20, 21, 22, 0, 1, 49, 30]
    copy_runs(local, remote, coalesce_runs(remote_ids, local_ids))
    expected = np.zeros((50, 64), dtype=np.uint8)
    expected[local_ids] = remote_owner.numpy().view(np.uint8).reshape(40, 64)[remote_ids]
    np.testing.assert_array_equal(local.numpy(), expected)


def test_byte_view_is_the_region_inside_a_larger_storage_and_refuses_one_that_does_not_fit() -> None:
    import torch

    from kvtransfer import InvalidRequestError
    from kvtransfer.ipc_cuda import byte_view

    allocation = torch.arange(12 * 16, dtype=torch.int32).reshape(12, 16)  # 64-byte rows
    pool = allocation[1:11]  # the engine's pool is such a slice: a spare block follows it
    region = KVRegion.from_buffer(pool)
    storage = pool.untyped_storage()
    view = byte_view(storage, region.base_address - storage.data_ptr(), region.num_blocks, region.block_bytes,
                     pool.device)
    assert view.data_ptr() == pool.data_ptr() and view.shape == (10, 64)
    np.testing.assert_array_equal(view.numpy(), pool.numpy().view(np.uint8).reshape(10, 64))
    with pytest.raises(InvalidRequestError, match="does not fit"):
        byte_view(storage, 3 * 64, 10, 64, pool.device)
