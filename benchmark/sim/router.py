"""The proxy's routing (proxy/routing/router.py's `prefix_load` policy without prefix hits: the simulator has no
prefix cache): D by seats + KV fullness, colocated when the prompt is short for D's load, P by queued tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmark.sim.node import Node, State

MAX_QUEUE_FACTOR = 2.0  # RouterConfig.max_queue_factor: saturated at this x max_num_seqs requests
MAX_PREFILL_QUEUE_STEPS = 8.0  # RouterConfig.max_prefill_queue_steps: P saturated at this x the budget queued


@dataclass(frozen=True)
class Route:
    decode: Node | None  # None: every decode node saturated (Overloaded), or none serving (see `no_decode`)
    prefill: Node | None  # None: colocated
    no_decode: bool = False


def route(prompt_tokens: int, decode_nodes: Sequence[Node], prefill_nodes: Sequence[Node],
          colocate_max_tokens: int) -> Route:
    serving = [n for n in decode_nodes if n.state is State.READY]
    if not serving:
        return Route(None, None, no_decode=True)
    open_d = [n for n in serving if n.seats < MAX_QUEUE_FACTOR]
    if not open_d:
        return Route(None, None)
    decode = min(open_d, key=lambda n: (n.seats + n.kv_fullness(prompt_tokens), n.nid))
    if prompt_tokens <= colocate_max_tokens * (1.0 - min(decode.seats, 1.0)):
        return Route(decode, None)
    open_p = [(n, n.queued_prompt_tokens()) for n in prefill_nodes if n.state is State.READY and n.seats <
              MAX_QUEUE_FACTOR]
    open_p = [(n, q) for n, q in open_p if q < MAX_PREFILL_QUEUE_STEPS * n.spec.max_num_batched_tokens]
    if not open_p:
        return Route(decode, None)
    prefill, _ = min(open_p, key=lambda nq: (nq[1] + prompt_tokens, len(nq[0].running), nq[0].nid))
    return Route(decode, prefill)
