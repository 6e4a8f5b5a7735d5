"""Errors and error metadata that cross a process boundary."""

from __future__ import annotations

# gRPC trailing-metadata key a decode node sets on a failed Generate: "1" tells the proxy that prefilling
# again (maybe on another prefill node) may succeed, "0" that it would fail the same way.
RETRYABLE_KEY = "tandem-retryable"


class InvalidTicketError(ValueError):
    """A KV ticket from the wire is malformed (a missing or ill-typed field, checksums that do not match its
    blocks): the request that carried it is refused as an invalid argument."""
