"""Conditions the routing layer reports and the HTTP layer turns into OpenAI errors."""

from __future__ import annotations

import re


class NoHealthyNodes(Exception):
    """No prefill or no decode node can take the request now (HTTP 503)."""


class Overloaded(Exception):
    """Every candidate node is at capacity (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# host:port with a dotted, bracketed or single-label host (10.0.0.7:8001, [::1]:8001, p-0.tandem.svc:8001, and
# Kubernetes' short service names such as tandem-prefill-0:50051: a label starting with a letter, so that a time
# such as 12:30 stays), gRPC's target prefixes (ipv4:, ipv6:, dns:///, unix:), and bare IPv4 addresses
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|dns|unix|unix-abstract):(?:///?)?)?"
    r"(?:\[[0-9A-Fa-f:.%]+\](?::\d+)?|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+:\d+\b|\b[A-Za-z][A-Za-z0-9-]*:\d{1,5}\b"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b)")


def without_addresses(text: str, known: tuple[str, ...] = ()) -> str:
    """`text` for a client: internal node addresses (the `known` ones and anything shaped like one) replaced by
    "<node>". The full text belongs in the proxy's log."""
    for address in known:
        if address:
            text = text.replace(address, "<node>")
    return _ADDRESS.sub("<node>", text)
