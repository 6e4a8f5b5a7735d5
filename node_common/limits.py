"""What a node refuses to compute for one request, whoever sends it: the proxy checks the same limits
(proxy/api/limits.py), but a node's gRPC port may be reached by other clients, and a request for the logprobs of the
whole vocabulary at every position would cost it a vocabulary-sized sort per token and a reply of megabytes.

`--max-logprobs` (vLLM's name and default) bounds the top logprobs per token, of the output and of the prompt
(`prompt_logprobs`, as in vLLM). A request has no `n` on the wire (the proxy sends each choice alone) and its
max_tokens is bounded by the node's context anyway (the engine stops there).
"""

from __future__ import annotations

import argparse

from engine.types import SamplingParams

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default; the proxy's too


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-logprobs", type=_count, default=DEFAULT_MAX_LOGPROBS, metavar="N",
                        help="top logprobs per token a request may ask for, as vLLM's; more is refused with "
                             f"INVALID_ARGUMENT (default: {DEFAULT_MAX_LOGPROBS})")


def check_limits(params: SamplingParams, max_logprobs: int) -> None:
    """Raises ValueError, naming the limit, for a request beyond this node's limits."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(f"{name} must be at most {max_logprobs} (this node's --max-logprobs), got {value}")


def check_position_logprobs(num_entries: int, max_logprobs: int) -> None:
    """A decode request's first-token logprobs (from its prefill node): the top ones and the sampled token."""
    if num_entries > max_logprobs + 1:
        raise ValueError(f"first_logprobs holds {num_entries} entries; at most {max_logprobs + 1} (this node's "
                         "--max-logprobs, and the sampled token)")
