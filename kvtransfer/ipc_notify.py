"""Notifications between ipc connectors: one non-blocking AF_UNIX datagram socket per connector.

The socket is bound in the abstract namespace (no file to clean up; it disappears with the socket, so a peer
that closed or died is seen at once) under `tandem-kv/<agent name, sanitized>/<random token>`. A datagram is

    b"TKN1" | sender name length (2 bytes, big-endian) | sender agent name (UTF-8) | message (<= 4096 bytes)

Sending never blocks and never raises: Linux lets only a few datagrams (net.unix.max_dgram_qlen, often 10) wait
in a receiver's queue, so a datagram that finds the queue full waits in a bounded outbox and is sent again on
the next `flush` (every `progress`), for at most OUTBOX_TTL_S; a peer whose socket is gone drops the message,
with a log line. Messages to one peer leave in the order they were sent.

`is_bound` tells whether a name still has a socket: the ipc connector's "is the peer's connector still open?".
"""

from __future__ import annotations

import errno
import logging
import re
import secrets
import socket
import struct
import time
from collections import deque
from typing import NamedTuple

from kvtransfer.base import PeerId
from kvtransfer.common import MAX_NOTIFICATION_BYTES
from kvtransfer.errors import BackendError, InvalidRequestError

logger = logging.getLogger(__name__)

MAGIC = b"TKN1"
MAX_AGENT_NAME_BYTES = 1024
OUTBOX_CAPACITY = 4096
OUTBOX_TTL_S = 30.0
_NAME_LENGTH = struct.Struct(">H")
_RECEIVE_BYTES = 1 << 16
_QUEUE_FULL = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS)


def socket_address(name: str) -> bytes:
    """The abstract-namespace address of a socket name: a leading NUL byte, then the name."""
    return b"\x00" + name.encode("ascii")


def is_bound(name: str) -> bool:
    """Whether a socket is bound at `name` now: connect() to an abstract name nobody holds is refused. Any other
    error says nothing about the peer, so it counts as bound (a false "closed" would fail every read)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(socket_address(name))
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            logger.warning("probing the ipc socket %s failed (%s): assuming its connector is open", name, e)
    return True


class _Queued(NamedTuple):
    name: str
    datagram: bytes
    expires: float  # time.monotonic()


class NotificationSocket:
    """This connector's inbox, and its way to post to peers' inboxes."""

    def __init__(self, agent_name: str) -> None:
        sender = agent_name.encode("utf-8")
        if len(sender) > MAX_AGENT_NAME_BYTES:
            raise InvalidRequestError(f"the ipc backend takes agent names of at most {MAX_AGENT_NAME_BYTES} bytes")
        self._header = MAGIC + _NAME_LENGTH.pack(len(sender)) + sender
        readable = re.sub(r"[^A-Za-z0-9._-]", "_", agent_name)[:48]
        self.name = f"tandem-kv/{readable}/{secrets.token_hex(8)}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._socket.setblocking(False)
            self._socket.bind(socket_address(self.name))
        except OSError as e:
            self._socket.close()
            raise BackendError(f"cannot bind the ipc notification socket {self.name!r}: {e}") from None
        self._outbox: deque[_Queued] = deque()

    def send(self, name: str, message: bytes) -> None:
        """Posts `message` to the socket `name`, best effort (see the module docstring)."""
        datagram = self._header + message
        if any(queued.name == name for queued in self._outbox):  # keep the order of messages to one peer
            self._enqueue(_Queued(name, datagram, time.monotonic() + OUTBOX_TTL_S))
            return
        self._post(_Queued(name, datagram, time.monotonic() + OUTBOX_TTL_S), queue_if_full=True)

    def flush(self) -> None:
        """Sends again what waited for room in a peer's queue."""
        if not self._outbox:
            return
        waiting, self._outbox = self._outbox, deque()
        blocked: set[str] = set()
        now = time.monotonic()
        for queued in waiting:
            if queued.name in blocked:
                self._outbox.append(queued)
            elif queued.expires < now:
                logger.warning("notification to %s dropped: its queue stayed full for %g s", queued.name,
                               OUTBOX_TTL_S)
            elif not self._post(queued, queue_if_full=False):
                blocked.add(queued.name)
                self._outbox.append(queued)

    def receive(self) -> list[tuple[PeerId, bytes]]:
        """Every datagram waiting in our queue, as (sender, message); ones that are not ours are dropped."""
        received: list[tuple[PeerId, bytes]] = []
        while True:
            try:
                datagram = self._socket.recv(_RECEIVE_BYTES)
            except (BlockingIOError, InterruptedError):
                return received
            except OSError as e:
                logger.warning("receiving ipc notifications failed: %s", e)
                return received
            parsed = _parse(datagram)
            if parsed is None:
                logger.warning("ignoring a %d-byte datagram on %s that is not an ipc notification", len(datagram),
                               self.name)
            else:
                received.append(parsed)

    def close(self) -> None:
        if self._outbox:
            logger.warning("%d ipc notifications were still waiting for room at close: dropped", len(self._outbox))
            self._outbox.clear()
        self._socket.close()

    def _post(self, queued: _Queued, *, queue_if_full: bool) -> bool:
        """True when the datagram left (or was dropped for good), False when the peer's queue is full."""
        try:
            self._socket.sendto(queued.datagram, socket_address(queued.name))
            return True
        except OSError as e:
            if e.errno in _QUEUE_FULL:
                if queue_if_full:
                    self._enqueue(queued)
                    return True
                return False
            # ECONNREFUSED / ENOENT: nobody holds the name any more (the peer closed or died)
            logger.warning("notification to %s was lost: %s", queued.name, e)
            return True

    def _enqueue(self, queued: _Queued) -> None:
        if len(self._outbox) >= OUTBOX_CAPACITY:
            dropped = self._outbox.popleft()
            logger.warning("ipc notification outbox full: dropped the oldest message, to %s", dropped.name)
        self._outbox.append(queued)


def _parse(datagram: bytes) -> tuple[PeerId, bytes] | None:
    prefix = len(MAGIC) + _NAME_LENGTH.size
    if len(datagram) < prefix or not datagram.startswith(MAGIC):
        return None
    (name_length,) = _NAME_LENGTH.unpack_from(datagram, len(MAGIC))
    if name_length == 0 or prefix + name_length > len(datagram) \
            or len(datagram) - prefix - name_length > MAX_NOTIFICATION_BYTES:
        return None
    try:
        sender = datagram[prefix:prefix + name_length].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return PeerId(sender), datagram[prefix + name_length:]
