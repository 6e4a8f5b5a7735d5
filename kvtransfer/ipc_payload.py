"""What an ipc connector tells its peers (the backend payload of its envelope), and who a process is.

The ipc backend reads a peer's memory directly, so a peer must be a process on this very machine, in our PID
namespace (its pid must mean the same process to us) and our network namespace (its notification socket lives in
the abstract namespace, which is per network namespace). The payload says which machine, boot and namespaces the
peer runs in, which process it is (pid and start time: a pid alone can be reused once the process exits), where
its notification socket is, and, for a GPU pool, the CUDA IPC share of that pool. It is JSON of plain ints,
strings and base64 bytes: peer data is parsed and checked, never unpickled.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import InvalidMetadataError

PAYLOAD_VERSION = 1
_MAX_PAYLOAD_BYTES = 1 << 16
_MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle is 64 bytes; torch's expandable-segment handles are a little longer
CUDA_IPC_EVENT_HANDLE_BYTES = 64  # torch reads exactly this many bytes of the event handle: a shorter one is refused
SOCKET_NAME = re.compile(r"^tandem-kv/[A-Za-z0-9._-]{0,48}/[0-9a-f]{16}$")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")  # e.g. "pid:[4026531836]"
    except OSError:
        return ""


@dataclass(frozen=True)
class HostIdentity:
    """The machine, boot and namespaces a process runs in: equal for two processes that can use each other's
    pids and abstract sockets. A field the kernel would not show is "" (equal only to "")."""

    hostname: str
    boot_id: str  # /proc/sys/kernel/random/boot_id: a new one each boot, so a rebooted host is another host
    pid_namespace: str
    net_namespace: str

    @classmethod
    def current(cls) -> HostIdentity:
        return cls(socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id"), _namespace("pid"),
                   _namespace("net"))

    def differences(self, other: HostIdentity) -> list[str]:
        """The fields in which `other` differs, as "field (ours X, peer Y)"."""
        return [f"{name} (ours {getattr(self, name)!r}, peer {getattr(other, name)!r})"
                for name in ("hostname", "boot_id", "pid_namespace", "net_namespace")
                if getattr(self, name) != getattr(other, name)]


@dataclass(frozen=True)
class ProcessRef:
    """One process for the life of a boot: its pid and its start time (clock ticks after boot, field 22 of
    /proc/<pid>/stat), so that a pid reused by a later process is not mistaken for the peer."""

    pid: int
    start_time: int

    @classmethod
    def current(cls) -> ProcessRef | None:
        start_time = process_start_time(os.getpid())
        return None if start_time is None else cls(os.getpid(), start_time)


def process_start_time(pid: int) -> int | None:
    """The start time of live process `pid`, or None when there is none (or only its zombie)."""
    stat = _read_text(f"/proc/{pid}/stat")
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    except ValueError:
        return None


def process_gone_reason(process: ProcessRef) -> str | None:
    """Why `process` is no longer running (None while it is)."""
    start_time = process_start_time(process.pid)
    if start_time is None:
        return f"the peer process {process.pid} has exited"
    if start_time != process.start_time:
        return f"the peer process {process.pid} has exited (its pid now names another process)"
    return None


@dataclass(frozen=True)
class CudaShare:
    """A GPU pool as CUDA IPC shares it: the fields of torch's `UntypedStorage._share_cuda_()` (the storage's
    allocation handle, its place in that allocation, torch's cross-process ref counter and the producer's event),
    plus where the KV region starts inside the storage."""

    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    region_offset_bytes: int
    device_uuid: str  # the GPU the pool lives on, for error messages and logs

    def to_dict(self) -> dict[str, Any]:
        return {"handle": _b64(self.handle), "storage_bytes": self.storage_bytes,
                "storage_offset_bytes": self.storage_offset_bytes,
                "ref_counter_handle": _b64(self.ref_counter_handle), "ref_counter_offset": self.ref_counter_offset,
                "event_handle": _b64(self.event_handle), "event_sync_required": self.event_sync_required,
                "region_offset_bytes": self.region_offset_bytes, "device_uuid": self.device_uuid}

    @classmethod
    def from_dict(cls, data: Any) -> CudaShare:
        if not isinstance(data, dict):
            raise TypeError(f"cuda must be a mapping, got {type(data).__name__}")
        share = cls(handle=_unb64(data, "handle"), storage_bytes=_int(data, "storage_bytes"),
                    storage_offset_bytes=_int(data, "storage_offset_bytes"),
                    ref_counter_handle=_unb64(data, "ref_counter_handle"),
                    ref_counter_offset=_int(data, "ref_counter_offset"), event_handle=_unb64(data, "event_handle"),
                    event_sync_required=_typed(data, "event_sync_required", bool),
                    region_offset_bytes=_int(data, "region_offset_bytes"),
                    device_uuid=_typed(data, "device_uuid", str))
        if not share.handle or b"\x00" in share.ref_counter_handle:
            raise ValueError("the CUDA IPC handle is empty, or the ref counter name holds a NUL byte")
        if len(share.event_handle) != CUDA_IPC_EVENT_HANDLE_BYTES:
            raise ValueError(f"the CUDA IPC event handle is {len(share.event_handle)} bytes, not "
                             f"{CUDA_IPC_EVENT_HANDLE_BYTES}")
        return share


@dataclass(frozen=True)
class IpcPayload:
    host: HostIdentity
    process: ProcessRef
    socket_name: str  # the abstract AF_UNIX name (without its leading NUL) notifications go to
    cuda: CudaShare | None = None  # set for a GPU (VRAM) pool, None for host memory

    def encode(self) -> bytes:
        return json.dumps({
            "version": PAYLOAD_VERSION,
            "host": {"hostname": self.host.hostname, "boot_id": self.host.boot_id,
                     "pid_namespace": self.host.pid_namespace, "net_namespace": self.host.net_namespace},
            "process": {"pid": self.process.pid, "start_time": self.process.start_time},
            "socket_name": self.socket_name,
            "cuda": None if self.cuda is None else self.cuda.to_dict(),
        }, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> IpcPayload:
        """Parses a peer's payload; raises InvalidMetadataError (never anything else) when it is not valid."""
        if len(data) > _MAX_PAYLOAD_BYTES:
            raise InvalidMetadataError(f"the ipc payload is {len(data)} bytes, more than {_MAX_PAYLOAD_BYTES}")
        try:
            record = json.loads(data)
            if not isinstance(record, dict):
                raise TypeError(f"the payload is a {type(record).__name__}, not a mapping")
            version = record.get("version")
            if version != PAYLOAD_VERSION or isinstance(version, bool):
                raise InvalidMetadataError(f"ipc payload version {version!r} is not supported (this connector "
                                           f"reads version {PAYLOAD_VERSION})")
            host, process = record["host"], record["process"]
            if not isinstance(host, dict) or not isinstance(process, dict):
                raise TypeError("host and process must be mappings")
            payload = cls(
                host=HostIdentity(*(_typed(host, k, str) for k in ("hostname", "boot_id", "pid_namespace",
                                                                    "net_namespace"))),
                process=ProcessRef(_int(process, "pid"), _int(process, "start_time")),
                socket_name=_typed(record, "socket_name", str),
                cuda=None if record["cuda"] is None else CudaShare.from_dict(record["cuda"]))
        except InvalidMetadataError:
            raise
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise InvalidMetadataError(f"the ipc payload is malformed: {type(e).__name__}: {e}") from None
        if payload.process.pid <= 0:
            raise InvalidMetadataError(f"the ipc payload names pid {payload.process.pid}")
        if not SOCKET_NAME.match(payload.socket_name):
            raise InvalidMetadataError(f"the ipc payload's socket name {payload.socket_name!r} is not one of ours")
        return payload


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _unb64(mapping: dict[str, Any], key: str) -> bytes:
    text = _typed(mapping, key, str)
    if len(text) > _MAX_HANDLE_BYTES * 2:
        raise ValueError(f"{key} is too long ({len(text)} characters)")
    return base64.b64decode(text, validate=True)


def _typed(mapping: dict[str, Any], key: str, kind: type) -> Any:
    value = mapping[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _int(mapping: dict[str, Any], key: str) -> int:
    value: int = _typed(mapping, key, int)
    if value < 0:
        raise ValueError(f"{key} must be >= 0, got {value}")
    return value
