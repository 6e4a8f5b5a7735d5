"""What one request may ask for at most: the operator's limits on n, logprobs and max_tokens.

Flags (python -m proxy): --max-n (choices per request), --max-logprobs (vLLM's name and default: top logprobs per
token), --max-tokens-limit (max_tokens, and the default of a request that sends none). A request beyond a limit gets
HTTP 400 naming the parameter and the limit; the nodes check logprobs again themselves (node_common/limits.py), so a
client that reaches them without the proxy cannot make them compute and send a whole vocabulary per token.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# The most choices any request may have, whatever --max-n says: seeds are spread over the choices (seed + index),
# and the largest seed a request may send is this much below the wire's maximum (proxy.api.openai_api.integer_bounds).
MAX_CHOICES = 128
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


@dataclass(frozen=True)
class RequestLimits:
    """`max_n`: choices per request (for completions, prompts x n); `max_logprobs`: top logprobs per token;
    `max_tokens`: tokens a request may ask to generate (None: up to the model's context)."""

    max_n: int = MAX_CHOICES
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_CHOICES:
            raise ValueError(f"--max-n must be in [1, {MAX_CHOICES}], got {self.max_n}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must not be negative, got {self.max_logprobs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1, got {self.max_tokens}")


DEFAULT_LIMITS = RequestLimits()


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-n", type=int, default=MAX_CHOICES, metavar="N",
                        help=f"choices one request may ask for (n; for completions prompts x n), at most "
                             f"{MAX_CHOICES} (default: {MAX_CHOICES})")
    parser.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, metavar="N",
                        help="top logprobs per token a request may ask for (logprobs, top_logprobs), as vLLM's "
                             f"(default: {DEFAULT_MAX_LOGPROBS}); the nodes' own --max-logprobs must be as large")
    parser.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                        help="max_tokens (max_completion_tokens) a request may ask for; a request without one gets "
                             "this many at most (default: no limit but the model's context)")


def limits_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RequestLimits:
    try:
        return RequestLimits(args.max_n, args.max_logprobs, args.max_tokens_limit)
    except ValueError as e:
        parser.error(str(e))
