"""The errors a connector raises. Every one is a `TransferError`, so a node can catch one type at its edge.

    TransferError
    ├── InvalidRequestError        bad arguments (message too large, bad region) ...
    │   └── InvalidDescriptorError ... or bad block ids: out of range, lengths differ, a local block twice
    ├── UnknownPeerError           the peer was never added, or was removed
    ├── PeerDisconnectedError      the peer went away (killed, closed) and the backend knows it
    ├── IncompatiblePeerError      handshake refused: backend, layout or block geometry differ
    │   └── InvalidMetadataError   the metadata bytes are not a peer envelope we can read
    ├── UnknownTransferError       a handle this connector never issued, or forgot long ago
    ├── ConnectorClosedError       the connector was closed
    └── BackendError               the transfer library failed or is not installed

A failed *transfer* is not an exception: `poll` answers `TransferStatus.FAILED` and `failure_reason` says why.
Exceptions are for requests that could never have worked.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error the kvtransfer package raises on purpose."""


class InvalidRequestError(TransferError):
    """The arguments of a call are invalid (checked before anything reaches the transfer library)."""


class InvalidDescriptorError(InvalidRequestError):
    """Block ids that cannot be transferred: out of range, negative, lists of different lengths, a repeated
    local block."""


class UnknownPeerError(TransferError):
    """The peer id was never returned by `add_peer`, or the peer was removed."""


class PeerDisconnectedError(TransferError):
    """The peer is gone (its process died or its connector closed)."""


class IncompatiblePeerError(TransferError):
    """The handshake refused the peer: a different backend, KV layout or block geometry."""


class InvalidMetadataError(IncompatiblePeerError):
    """The peer metadata is not a readable envelope (truncated, corrupted, or from an unknown version)."""


class UnknownTransferError(TransferError):
    """The transfer handle was not issued by this connector, or finished so long ago that it was forgotten."""


class ConnectorClosedError(TransferError):
    """The connector was closed; make a new one."""


class BackendError(TransferError):
    """The transfer library failed unexpectedly, or is not installed."""
