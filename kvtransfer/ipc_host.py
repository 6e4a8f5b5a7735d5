"""The OS calls of the ipc backend: reading another process's memory, and who may read ours.

`read_process_memory` runs Linux `process_vm_readv` (ctypes on libc): one call moves a list of remote byte ranges
into a list of local ones without a copy through the kernel's buffers or any help from the other process. A
call takes at most IOV_MAX (1024) ranges per side, and the kernel quietly truncates one call at about 2 GiB, so
`plan_iovec_batches` cuts a read's coalesced runs into calls of at most 1024 ranges and `MAX_BYTES_PER_CALL`
bytes (a bound that also keeps an aborted read from writing for long after the abort).

Reading needs ptrace access to the peer: the same user, and with Yama's `ptrace_scope=1` (Ubuntu's default) only
a process's descendants may read it unless it says otherwise: `allow_same_user_readers` says so for the process
that owns a pool (prctl PR_SET_PTRACER_ANY). Scope 2 or 3, or a container without CAP_SYS_PTRACE under a seccomp
profile that forbids the call, refuse reads with EPERM: `read_process_memory` explains that in its reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvtransfer.errors import BackendError

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # the kernel's UIO_MAXIOV: more ranges on either side make process_vm_readv fail with EINVAL
MAX_BYTES_PER_CALL = 256 << 20
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


class IovecBatch(NamedTuple):
    """The ranges of one process_vm_readv call: `local` and `remote` are [n, 2] uint64 arrays of (address,
    length) rows, the memory layout of `struct iovec` on 64-bit Linux, so they pass to the call as they are."""

    local: np.ndarray
    remote: np.ndarray
    num_bytes: int


def plan_iovec_batches(local_addresses: Sequence[int], remote_addresses: Sequence[int], lengths: Sequence[int], *,
                       max_entries: int = IOV_MAX, max_bytes: int = MAX_BYTES_PER_CALL) -> list[IovecBatch]:
    """Cuts copies `remote[k] → local[k]` of `lengths[k]` bytes into calls of at most `max_entries` ranges and
    `max_bytes` bytes, in order; a copy longer than `max_bytes` is split into pieces of `max_bytes`."""
    assert max_entries > 0 and max_bytes > 0, "a batch must hold at least one byte range"
    batches: list[IovecBatch] = []
    rows: list[tuple[int, int, int]] = []
    batch_bytes = 0

    def close_batch() -> None:
        nonlocal rows, batch_bytes
        if rows:
            table = np.array(rows, dtype=np.uint64)
            batches.append(IovecBatch(np.ascontiguousarray(table[:, [0, 2]]),
                                      np.ascontiguousarray(table[:, [1, 2]]), batch_bytes))
        rows, batch_bytes = [], 0

    for local, remote, length in zip(local_addresses, remote_addresses, lengths, strict=True):
        local, remote, length = int(local), int(remote), int(length)
        assert length > 0, f"a copy of {length} bytes"
        offset = 0
        while offset < length:
            piece = min(length - offset, max_bytes)
            if len(rows) == max_entries or batch_bytes + piece > max_bytes:
                close_batch()
            rows.append((local + offset, remote + offset, piece))
            batch_bytes += piece
            offset += piece
    close_batch()
    return batches


def _load_process_vm_readv() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError) as e:
        raise BackendError(f"the ipc backend needs Linux's process_vm_readv (glibc >= 2.15): {e}") from None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                         ctypes.c_ulong]
    function.restype = ctypes.c_ssize_t
    return function


_process_vm_readv: Any = None
_load_lock = threading.Lock()


def process_vm_readv_function() -> Any:
    """libc's process_vm_readv, loaded once; raises BackendError where there is none (not Linux)."""
    global _process_vm_readv
    with _load_lock:
        if _process_vm_readv is None:
            _process_vm_readv = _load_process_vm_readv()
    return _process_vm_readv


class ReadFailure(NamedTuple):
    """Why a read did not move every byte: `errno` of the failed call (0 for a short read or an abort)."""

    errno: int
    reason: str


def read_process_memory(pid: int, batches: Sequence[IovecBatch], cancelled: threading.Event | None = None
                        ) -> ReadFailure | None:
    """Runs the calls; returns None when every byte arrived, else why not (never raises). ctypes releases the GIL
    during each call, so a worker thread can run this while the caller's loop goes on. `cancelled` is looked at
    between calls."""
    readv = process_vm_readv_function()
    for batch in batches:
        if cancelled is not None and cancelled.is_set():
            return ReadFailure(0, "the read was aborted")
        moved = readv(pid, batch.local.ctypes.data, len(batch.local), batch.remote.ctypes.data, len(batch.remote),
                      0)
        if moved < 0:
            code = ctypes.get_errno()
            return ReadFailure(code, explain_errno(code, pid))
        if moved != batch.num_bytes:
            # partial transfers stop at the first range that is not mapped in the peer (or in us)
            return ReadFailure(0, f"short read from process {pid}: {moved} of {batch.num_bytes} bytes (part of the "
                                  f"peer's KV pool is no longer mapped: it freed its pool, or is exiting)")
    return None


def explain_errno(code: int, pid: int) -> str:
    if code == errno.ESRCH:
        return f"the peer process {pid} has exited"
    if code == errno.EPERM:
        return (f"not permitted to read process {pid}'s memory (process_vm_readv EPERM): both nodes must run as "
                f"the same user, and kernel.yama.ptrace_scope must be 0 or 1 (it is "
                f"{_read_ptrace_scope() or 'not set'}), or the reader needs CAP_SYS_PTRACE; containers also need a "
                f"seccomp profile that allows process_vm_readv")
    if code == errno.EFAULT:
        return f"an address range of process {pid} (or of our own pool) is not mapped (process_vm_readv EFAULT)"
    return f"process_vm_readv from process {pid} failed: {os.strerror(code)} (errno {code})"


def _read_ptrace_scope() -> str:
    try:
        with open(_YAMA_PTRACE_SCOPE, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def allow_same_user_readers() -> bool:
    """Under Yama's ptrace_scope=1, lets any process of our user read this process's memory (what every peer of a
    pool owner needs: it is not our ancestor); a no-op under scope 0 (already so) or without Yama. Returns whether
    it changed anything. Under scope 2 or 3 nothing can help: reads fail with a reason saying so."""
    if _read_ptrace_scope() != "1":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PTRACER_ANY) failed (%s): peers may not be able to read this process's KV "
                       "pool", os.strerror(ctypes.get_errno()))
        return False
    logger.info("kernel.yama.ptrace_scope=1: allowed processes of this user to read this process's memory, as "
                "the ipc KV transfer backend needs")
    return True
