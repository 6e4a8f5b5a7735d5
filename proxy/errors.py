"""Conditions the routing layer reports and the HTTP layer turns into OpenAI errors."""

from __future__ import annotations


class NoHealthyNodes(Exception):
    """No prefill or no decode node can take the request now (HTTP 503)."""


class Overloaded(Exception):
    """Every candidate node is at capacity (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
