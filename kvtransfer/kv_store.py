"""KV blocks in a cluster-wide Mooncake Store: a client that never fails its caller, and the blocks' framing.

    store = MooncakeKVStore("10.0.0.5:50051", segment_bytes=4 << 30, buffer_bytes=256 << 20)
    stored = store.put_many([(store_key("llama-8b", block_hash), pack_block(token_ids, kv_bytes)), ...])
    values = store.get_prefix([store_key("llama-8b", h) for h in block_hashes])  # the leading hits
    data = unpack_block(values[0], token_ids, block_bytes)  # None: not the block it claims to be

The client (mooncake-transfer-engine 0.3.13 `MooncakeDistributedStore`, P2PHANDSHAKE, tcp) lends `segment_bytes`
of its memory to the pool (the values it writes usually land there; 0 for a reader) and stages values through a
local buffer of `buffer_bytes`: a batch never carries more (a bigger `put_batch` fails whole, a bigger `get_batch`
drops the keys that did not fit), and a bigger value is never stored. The library blocks: a get, put or exist
call about 4 s once the master is gone (30 s if it hangs), with the GIL released; `setup()` 4 s (90 s with its
own port retries) and `close()` 1.5 s alive, 6-11 s dead, holding the GIL. So library calls run on one worker
thread and the caller waits at most `call_timeout_s`; setup only follows a TCP connect to the master. States
(one transition function, `_set_state`):
    CONNECTING  setup() runs on the worker (started by __init__, which waits up to call_timeout_s); calls miss
    UP          calls reach the store
    DOWN        breaker open: calls miss at once for `retry_after_s`, then the next call tries again, with a new
                client (set up in the background) when the old one never set up or says it is closed
    CLOSED      after close()
A call also misses at once while the worker still runs an earlier call that timed out. A client that lost its
master reconnects by itself about 1 s after a master is back on the address (its segment is mounted again).
A put the pool refuses while it is reachable (full: `NO_AVAILABLE_HANDLE`) counts in `num_errors` and keeps the
breaker closed. Counters count keys: `num_gets` asked for, `num_hits` returned, `num_puts` stored.

Value layout (`pack_block`), little-endian: magic b"TKVB", u32 version 1, u32 number of tokens, u32 data length,
u32 checksum algorithm (its index in `CHECKSUM_ALGORITHMS`), the 16-byte digest of `block_checksum(data)` (the KV
handoff's per-block checksum), the token ids as int64, the data.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from enum import Enum
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TypeVar

from kvtransfer.checksum import CHECKSUM_ALGORITHMS, DEFAULT_CHECKSUM_ALGORITHM, MIX64, block_checksum
from kvtransfer.errors import InvalidRequestError

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC, VERSION = b"TKVB", 1
_HEADER = struct.Struct("<4sIIII16s")
_UNREACHABLE_CODES = {-900, -901}  # RPC_FAIL, RPC_TIMEOUT: the master did not answer
_HEALTHY, _CLOSED_CLIENT = 0, 1  # health_check(): 0 healthy, 1 not set up or closed, 2 master unreachable
MAX_BATCH_KEYS = 256
_ABANDONED: list[Any] = []  # clients whose teardown would stall the process on a dead master (see close)


def store_key(namespace: str, block_hash: bytes) -> str:
    """The key of a block: its chained hash (which covers the whole prefix) under a model's namespace."""
    return f"tandem/{namespace}/{block_hash.hex()}"


def pack_block(token_ids: Sequence[int], data: bytes) -> bytes:
    """A block's value: header, token ids, data (layout in the module docstring)."""
    digest = bytes.fromhex(block_checksum(data).partition(":")[2])
    header = _HEADER.pack(MAGIC, VERSION, len(token_ids), len(data),
                          CHECKSUM_ALGORITHMS.index(DEFAULT_CHECKSUM_ALGORITHM), digest)
    return header + struct.pack(f"<{len(token_ids)}q", *token_ids) + data


def unpack_block(value: bytes, token_ids: Sequence[int], block_bytes: int) -> bytes | None:
    """The data of a value packed for exactly `token_ids` and `block_bytes` of KV; None for another magic or
    version, a wrong length, other token ids or a checksum that does not match."""
    if len(value) < _HEADER.size:
        return None
    magic, version, num_tokens, data_bytes, algorithm_index, digest = _HEADER.unpack_from(value)
    if (magic, version) != (MAGIC, VERSION) or num_tokens != len(token_ids) or data_bytes != block_bytes:
        return None
    data_offset = _HEADER.size + 8 * num_tokens
    if len(value) != data_offset + data_bytes or algorithm_index >= len(CHECKSUM_ALGORITHMS):
        return None
    if list(struct.unpack_from(f"<{num_tokens}q", value, _HEADER.size)) != list(token_ids):
        return None
    data, algorithm = value[data_offset:], CHECKSUM_ALGORITHMS[algorithm_index]
    try:
        checksum = block_checksum(data, algorithm) if algorithm != MIX64 else ""
    except InvalidRequestError:  # an algorithm this node cannot compute (xxh3-128 without xxhash)
        return None
    return data if checksum == f"{algorithm}:{digest.hex()}" else None


def master_command(port: int, host: str = "127.0.0.1", *, client_ttl_s: int = 3, kv_lease_ttl_ms: int = 1000,
                   metrics_port: int = 0) -> list[str]:
    """The argv of a `mooncake_master` serving Tandem's clients on `host:port`. `--rpc_address`/`--metrics_host`:
    listen on `host` only (default: every interface). `--metrics_port=0`: any free port for its admin server (the
    default 9003 collides between masters). `--client_ttl` 3 s (default 10): a dead client's segment and values
    leave the pool 3 s after its last heartbeat (one a second), so readers stop trying it (0.5 s a get).
    `--default_kv_lease_ttl` 1 s (default 10 s): how long a value just read stays unevictable, so a full pool
    frees space sooner (eviction is on by default: above 90% used it drops 5%); a batch takes milliseconds.
    `--enable_metric_reporting=false`: no metrics summary in its log every few seconds."""
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    return [binary, f"--rpc_port={port}", f"--rpc_address={host}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port}", f"--client_ttl={client_ttl_s}",
            f"--default_kv_lease_ttl={kv_lease_ttl_ms}", "--enable_metric_reporting=false"]


class StoreState(Enum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"
    CLOSED = "closed"


class _Unreachable(Exception):
    """The master did not answer; `partial` is what the job got done before."""

    def __init__(self, reason: str, partial: Any) -> None:
        super().__init__(reason)
        self.partial = partial


class _Worker:
    """One daemon thread running the library's calls in order (a call stuck in the library must not hold up
    the process's exit, as a ThreadPoolExecutor's thread would)."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = SimpleQueue()
        threading.Thread(target=self._loop, name="mooncake-kv-store", daemon=True).start()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            if not item[1].set_running_or_notify_cancel():  # its caller stopped waiting before it started
                continue
            try:
                item[1].set_result(item[0]())
            except BaseException as e:  # noqa: B036 - handed to the caller through the future
                item[1].set_exception(e)


class MooncakeKVStore:
    """KV blocks by key in a Mooncake Store; an unreachable master makes misses, never errors. Thread-safe."""

    def __init__(self, master: str, *, local_hostname: str = "127.0.0.1", segment_bytes: int, buffer_bytes: int,
                 retry_after_s: float = 5.0, call_timeout_s: float = 2.0) -> None:
        if segment_bytes < 0 or buffer_bytes <= 0 or retry_after_s < 0 or call_timeout_s <= 0:
            raise InvalidRequestError("need segment_bytes >= 0, buffer_bytes > 0, retry_after_s >= 0 and "
                                      "call_timeout_s > 0")
        self.master, self.local_hostname = master, local_hostname
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.retry_after_s, self.call_timeout_s = retry_after_s, call_timeout_s
        self.num_gets = self.num_hits = self.num_puts = self.num_errors = self.bytes_read = self.bytes_written = 0
        self._lock, self._worker, self._client = threading.Lock(), _Worker(), None
        self._state, self._retry_at, self._in_outage, self._largest_value = StoreState.CONNECTING, 0.0, False, 0
        # the worker's job no caller waits for any more (a setup, a call that timed out): calls miss until it ends.
        # A call queued behind another caller's call waits its turn instead (a get behind a put).
        self._busy: Future[Any] = self._worker.submit(self._setup)
        try:
            self._busy.result(timeout=call_timeout_s)
        except FutureTimeout:
            pass

    @property
    def state(self) -> StoreState:
        return self._state

    def get_prefix(self, keys: Sequence[str]) -> list[bytes]:
        """The values of the leading keys that are present, up to the first miss."""
        keys, miss = list(keys), list[bytes]()
        values = self._call(lambda client: self._get_prefix_job(client, keys), miss) if keys else miss
        with self._lock:
            self.num_gets, self.num_hits = self.num_gets + len(keys), self.num_hits + len(values)
            self.bytes_read += sum(len(value) for value in values)
        return values

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Stores each (key, value); returns how many keys are stored (a key already present counts and keeps its
        value). A value larger than `buffer_bytes` is not stored; a repeated key keeps its first value."""
        first: dict[str, bytes] = {}
        for key, value in items:
            first.setdefault(key, value)
        batch = [(key, value) for key, value in first.items() if len(value) <= self.buffer_bytes]
        stored, stored_bytes = self._call(lambda client: self._put_job(client, batch), (0, 0)) if batch else (0, 0)
        with self._lock:
            self.num_puts, self.bytes_written = self.num_puts + stored, self.bytes_written + stored_bytes
        return stored

    def close(self) -> None:
        """Leaves the pool (the values in this client's segment go with it)."""
        with self._lock:
            if self._state is StoreState.CLOSED:
                return
            self._state, client, self._client = StoreState.CLOSED, self._client, None
        if client is not None and self._busy.done() and client.health_check() == _HEALTHY:
            try:
                self._worker.submit(client.close).result(timeout=self.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - closing must not fail the caller
                logger.debug("closing the Mooncake store client: %r", e)
        elif client is not None:
            _ABANDONED.append(client)
        self._worker.stop()

    def _call(self, job: Callable[[Any], T], miss: T) -> T:
        """`job(client)` on the worker, waited for at most call_timeout_s; `miss` unless the breaker lets it run."""
        with self._lock:
            if self._state is StoreState.CLOSED or not self._busy.done():
                return miss
            if self._state is StoreState.DOWN and time.monotonic() < self._retry_at:
                return miss
            if self._client is None:  # never set up, or closed under us: a new one, off the caller's path
                self._set_state(StoreState.CONNECTING)
                self._busy = self._worker.submit(self._setup)
                return miss
            client = self._client
            future = self._worker.submit(lambda: self._checked(client, job))
        try:
            result: T = future.result(timeout=self.call_timeout_s)
        except FutureTimeout:
            if future.cancel():  # still queued behind other calls: the store is slow, not gone
                return miss
            with self._lock:
                self._busy = future
            self._failed(f"no answer within {self.call_timeout_s} s")
            return miss
        except _Unreachable as e:
            self._failed(str(e))
            return e.partial if e.partial is not None else miss
        except Exception as e:  # noqa: BLE001 - a store error is a miss, never the caller's failure
            self._failed(repr(e))
            return miss
        with self._lock:
            self._set_state(StoreState.UP)
        return result

    def _checked(self, client: Any, job: Callable[[Any], T]) -> T:
        """The job between two health checks (a flag the library's heartbeat keeps: no round trip); the second
        one because a get from a master that went away returns empty values, not an error."""
        self._check_health(client, None)
        result = job(client)
        self._check_health(client, result)
        return result

    def _check_health(self, client: Any, partial: Any) -> None:
        health = client.health_check()
        if health == _CLOSED_CLIENT:
            with self._lock:
                self._client = None if self._client is client else self._client
        if health != _HEALTHY:
            raise _Unreachable(f"health check {health}", partial)

    def _setup(self) -> None:
        """Only once the master accepts a connection (setup holds the GIL), with our own port (one attempt)."""
        from mooncake.store import MooncakeDistributedStore

        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=min(1.0, self.call_timeout_s)).close()
            with socket.socket() as probe:  # a free port for the client's endpoint
                probe.bind((self.local_hostname, 0))
                local_port = probe.getsockname()[1]
        except (OSError, ValueError) as e:
            self._failed(f"no connection: {e}")
            return
        client = MooncakeDistributedStore()
        rc = client.setup(f"{self.local_hostname}:{local_port}", "P2PHANDSHAKE", self.segment_bytes,
                          self.buffer_bytes, "tcp", "", self.master)
        with self._lock:
            if rc == 0 and self._state is not StoreState.CLOSED:
                self._client = client
                self._set_state(StoreState.UP)
                return
        _ABANDONED.append(client)  # its teardown could stall the process; setup failures are rare after the probe
        if rc != 0:
            self._failed(f"setup returned {rc}")

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.num_errors += 1
            if not self._in_outage:
                logger.warning("Mooncake store at %s unreachable (%s): its calls miss, retried every %.1f s",
                               self.master, reason, self.retry_after_s)
            self._set_state(StoreState.DOWN)

    def _set_state(self, state: StoreState) -> None:
        """The one transition function (called with the lock held); logs the end of an outage."""
        if self._state is StoreState.CLOSED:
            return
        if state is StoreState.DOWN:
            self._retry_at, self._in_outage = time.monotonic() + self.retry_after_s, True
        elif state is StoreState.UP and self._in_outage:
            logger.warning("Mooncake store at %s reachable again (%d errors so far)", self.master, self.num_errors)
            self._in_outage = False
        self._state = state

    def _get_prefix_job(self, client: Any, keys: list[str]) -> list[bytes]:
        values: list[bytes] = []
        start = 0
        while start < len(keys):
            batch_keys = max(1, min(MAX_BATCH_KEYS, self.buffer_bytes // max(1, self._largest_value)))
            chunk = keys[start:start + batch_keys]
            run = list(itertools.takewhile(bool, client.get_batch(chunk)[:len(chunk)]))
            values += run
            self._largest_value = max([self._largest_value, *map(len, run)])
            if len(run) == len(chunk):
                start += len(chunk)
            elif run and sum(map(len, run)) + 2 * self._largest_value > self.buffer_bytes:
                start += len(run)  # the miss may be the local buffer running out (the library drops those keys)
            else:
                break
        return values

    def _put_job(self, client: Any, items: list[tuple[str, bytes]]) -> tuple[int, int]:
        """(keys stored, their bytes): one put_batch per run of values that fit the local buffer together."""
        stored = stored_bytes = start = 0
        while start < len(items):
            end, total = start, 0
            while end < len(items) and end - start < MAX_BATCH_KEYS and total + len(items[end][1]) <= self.buffer_bytes:
                total, end = total + len(items[end][1]), end + 1
            keys, values = [key for key, _ in items[start:end]], [value for _, value in items[start:end]]
            self._largest_value = max([self._largest_value, *map(len, values)])
            rc = client.put_batch(keys, values)
            if rc in _UNREACHABLE_CODES:
                raise _Unreachable(f"put_batch returned {rc}", (stored, stored_bytes))
            present = client.batch_is_exist(keys) if rc != 0 else [1] * len(keys)  # refused: the pool tells which
            stored += sum(code == 1 for code in present)
            stored_bytes += sum(len(value) for value, code in zip(values, present, strict=False) if code == 1)
            if rc != 0:  # reachable but refused (a full pool): no outage, and the rest would fail too
                with self._lock:
                    self.num_errors += 1
                logger.debug("Mooncake put_batch of %d keys returned %d", len(keys), rc)
                break
            start = end
        return stored, stored_bytes
