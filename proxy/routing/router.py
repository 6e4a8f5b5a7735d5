"""Where a request runs: the decode node first, then whether to disaggregate, then the prefill node.

Policies (`--routing`):
- `prefix_load` (default): the cost model below.
- `round_robin`: the fallback: nodes in turn, always disaggregated, no scores (health still counts); colocated
  only when no prefill node can take the request.

The cost model, for a prompt of L tokens (its full blocks hashed as the nodes hash them):
  hit(n)    prompt tokens in the leading blocks node n can reuse (prefix index), at most L - 1: a node always
            recomputes the last prompt token, whose logits it needs. They are a run across its KV tiers
            (docs/architecture.md#kv-tiers): dev(n) in its pool, then host(n) in its host tier and store(n) in
            the cluster store of its KV layout (every node of that layout can get those), so
                hit(n) = dev(n) + host(n) + store(n)
  saved(n)  what the hit saves, in tokens of computing: a pool hit is free, a host or store hit costs a reload
                saved(n) = dev(n) + (1 - host_hit_cost) * host(n) + (1 - store_hit_cost) * store(n)
            with the reload costs as fractions of computing the same tokens (RouterConfig says why the defaults)
  busy(n)   the larger of running + waiting as n last reported, and the requests this proxy has in flight on
            n (reports lag by up to a heartbeat; the proxy's own count covers a burst in between)
  seats(n)  busy(n) / max_num_seqs(n)

1. Decode node D: among decode nodes not saturated (seats < max_queue_factor), the lowest
       score_D(n) = seats(n) + kv(n) - hit_weight * saved(n) / L
   where kv(n) = (blocks in use + blocks the prompt still needs there) / total blocks, its fullness after
   admitting the request (host and store hits are loaded into fresh pool blocks: only dev(n) needs none). Each
   term is a fraction: hit_weight = 1 makes a full pool hit worth a full batch of seats. A hit on D saves the
   transfer of those blocks, and it is what makes colocation cheap (step 2).
2. Disaggregate? D prefills the prompt itself ("colocated") when its uncached part u = L - saved(D) is short:
       u <= colocate_max_tokens * (1 - min(seats(D), 1))
   A short tail joins D's running batch as one prefill chunk, cheaper than P's round trip plus a transfer;
   the allowance shrinks to nothing as D fills, since every prefill chunk on D slows all of D's running
   requests. It is colocated too when no prefill node can take it (none healthy with D's KV layout, or all
   saturated): D prefilling beats refusing the request.
3. Prefill node P (D's KV layout): among those not saturated (queued prefill tokens below
   max_prefill_queue_steps * max_num_batched_tokens, and seats < max_queue_factor), the lowest
       score_P(n) = (queued(n) + L - saved(n)) / max_num_batched_tokens
   about how many full prefill steps until this prompt's first token; queued(n) is the larger of the reported
   queue and the prompt tokens this proxy has in flight on n. Ties go to the node with fewer running requests.
   A follow-up turn (earlier prompt + the answer + a new message) whose answer a decode node put in the store
   scores a store hit over the answer on every prefill node of the layout, and over the earlier prompt on those
   that do not hold it themselves: the node that computed the earlier prompt keeps its edge of
   store_hit_cost x its pool hit, no longer the whole of it.

No decode node at all: NoHealthyNodes; every decode node saturated: Overloaded. Unknown capacity (a static node
whose Stats never answered) scores 0 on that term and never counts as saturated.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from engine.hashing import BlockHash, block_hashes
from proxy.routing.directory import NodeView
from proxy.routing.errors import NoHealthyNodes, Overloaded
from proxy.routing.prefix_index import PrefixIndex
from wire import Role


class RoutingPolicy(enum.Enum):
    PREFIX_LOAD = "prefix_load"
    ROUND_ROBIN = "round_robin"


class Mode(enum.Enum):
    DISAGGREGATED = "disaggregated"  # P prefills, D pulls the KV and decodes
    COLOCATED = "colocated"  # D runs the whole request


@dataclass(frozen=True)
class RouterConfig:
    policy: RoutingPolicy = RoutingPolicy.PREFIX_LOAD
    block_size: int = 16  # the cluster's: the proxy hashes prompts as the nodes do
    hash_seed: str = "tandem"
    colocate_max_tokens: int = 64  # uncached prompt tokens an idle D prefills itself; 0 = always disaggregate
    hit_weight: float = 1.0
    # A reload's cost as a fraction of computing the tokens. Host: a copy back into the pool, over PCIe on a GPU
    # (~25-50 GB/s: a few µs per token of an 8B model's 128 KiB of KV, against ~100 µs of prefill per token on
    # one GPU, a few % of computing) and at memory bandwidth on a CPU node (next to nothing beside its slow
    # compute); 0.1 leaves room for the copies running before the step. Store: a network get (the node waits
    # for it before adding the prompt), a host write and that load; over TCP a few GB/s make that a sizeable
    # fraction of computing on a GPU, over RDMA much less, and a store entry is a hint that may have been
    # evicted since: 0.3.
    host_hit_cost: float = 0.1
    store_hit_cost: float = 0.3
    max_queue_factor: float = 2.0  # saturated at (running + waiting) >= this x max_num_seqs
    max_prefill_queue_steps: float = 8.0  # P saturated at queued prompt tokens >= this x max_num_batched_tokens
    retry_after_s: float = 1.0  # what Overloaded advises (about one heartbeat: loads will have been refreshed)

    def __post_init__(self) -> None:
        for name in ("host_hit_cost", "store_hit_cost"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a fraction of computing the tokens: between 0 and 1, "
                                 f"got {getattr(self, name)}")


class HitTokens(NamedTuple):
    """A node's prefix hit in prompt tokens, by the tier they are reused from (pool first)."""

    device: int = 0
    host: int = 0
    store: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.store


NO_HIT = HitTokens()


@dataclass(frozen=True)
class Route:
    mode: Mode
    decode: NodeView
    prefill: NodeView | None  # None when colocated
    num_prompt_tokens: int
    prompt_hashes: tuple[BlockHash, ...]
    decode_hit: HitTokens = NO_HIT
    prefill_hit: HitTokens = NO_HIT

    @property
    def decode_hit_tokens(self) -> int:
        return self.decode_hit.total

    @property
    def prefill_hit_tokens(self) -> int:
        return self.prefill_hit.total


class NodeSource(Protocol):
    """The live table (proxy.routing.directory.NodeDirectory; a plain list in unit tests)."""

    index: PrefixIndex

    def nodes(self, role: Role) -> list[NodeView]:
        """The nodes of a role that may take new requests."""
        ...


@dataclass
class _InFlight:
    requests: int = 0
    prefill_tokens: int = 0


@dataclass
class Router:
    source: NodeSource
    config: RouterConfig = field(default_factory=RouterConfig)
    decision_counts: Counter[str] = field(default_factory=Counter)  # by Mode value, one per request

    def __post_init__(self) -> None:
        self._inflight: dict[str, _InFlight] = {}
        self._turn = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    # ---- decisions ----
    def route(self, prompt_token_ids: Sequence[int], exclude_decode: Collection[str] = ()) -> Route:
        """Chooses D, the mode and (disaggregated) P for a prompt. Raises NoHealthyNodes or Overloaded."""
        hashes = tuple(block_hashes(prompt_token_ids, self.config.block_size, self.config.hash_seed))
        num_tokens = len(prompt_token_ids)
        decode_nodes = [n for n in self.source.nodes(Role.DECODE) if n.address not in exclude_decode]
        if not decode_nodes:
            raise NoHealthyNodes("no healthy decode node")
        if self.config.policy is RoutingPolicy.ROUND_ROBIN:
            decode = self._next(Role.DECODE, decode_nodes)
            prefill_nodes = self._prefill_candidates(decode)
            route = (Route(Mode.DISAGGREGATED, decode, self._next(Role.PREFILL, prefill_nodes), num_tokens, hashes)
                     if prefill_nodes else Route(Mode.COLOCATED, decode, None, num_tokens, hashes))
        else:
            route = self._route_by_cost(num_tokens, hashes, decode_nodes)
        self.decision_counts[route.mode.value] += 1
        return route

    def _route_by_cost(self, num_tokens: int, hashes: tuple[BlockHash, ...], decode_nodes: list[NodeView]
                       ) -> Route:
        hits = self._hits(hashes, num_tokens, decode_nodes)
        open_nodes = [n for n in decode_nodes if not self._saturated(n)]
        if not open_nodes:
            raise Overloaded(f"all {len(decode_nodes)} decode nodes are saturated", self.config.retry_after_s)
        decode = min(open_nodes, key=lambda n: (self.decode_score(n, num_tokens, hits.get(n.node_id, NO_HIT)),
                                                n.address))
        decode_hit = hits.get(decode.node_id, NO_HIT)
        uncached = num_tokens - self.saved_tokens(decode_hit)
        if uncached <= self.config.colocate_max_tokens * (1.0 - min(self._seats(decode), 1.0)):
            return Route(Mode.COLOCATED, decode, None, num_tokens, hashes, decode_hit)
        prefill, prefill_hit = self._best_prefill(num_tokens, hashes, decode, exclude=())
        if prefill is None:  # no prefill node can take it: D prefilling beats refusing
            return Route(Mode.COLOCATED, decode, None, num_tokens, hashes, decode_hit)
        return Route(Mode.DISAGGREGATED, decode, prefill, num_tokens, hashes, decode_hit, prefill_hit)

    def another_prefill(self, route: Route, decode: NodeView, exclude: Collection[str]) -> NodeView | None:
        """A prefill node for a retry: one not in `exclude` if any can take it, else the best of all (a
        transient failure may pass); None when no prefill node pairs with `decode`."""
        if self.config.policy is RoutingPolicy.ROUND_ROBIN:
            candidates = self._prefill_candidates(decode)
            others = [n for n in candidates if n.address not in exclude]
            return self._next(Role.PREFILL, others or candidates) if candidates else None
        for excluded in (exclude, ()):
            node, _ = self._best_prefill(route.num_prompt_tokens, route.prompt_hashes, decode, excluded)
            if node is not None:
                return node
        return None

    def another_decode(self, exclude: Collection[str]) -> NodeView | None:
        """A decode node to continue a request whose D failed before streaming (none: None)."""
        nodes = [n for n in self.source.nodes(Role.DECODE) if n.address not in exclude and not self._saturated(n)]
        if not nodes:
            return None
        if self.config.policy is RoutingPolicy.ROUND_ROBIN:
            return self._next(Role.DECODE, nodes)
        return min(nodes, key=lambda n: (self._seats(n), n.address))

    def _best_prefill(self, num_tokens: int, hashes: tuple[BlockHash, ...], decode: NodeView,
                      exclude: Collection[str]) -> tuple[NodeView | None, HitTokens]:
        candidates = [n for n in self._prefill_candidates(decode)
                      if n.address not in exclude and not self._saturated(n)]
        if not candidates:
            return None, NO_HIT
        hits = self._hits(hashes, num_tokens, candidates)
        best = min(candidates, key=lambda n: (self.prefill_score(n, num_tokens, hits.get(n.node_id, NO_HIT)),
                                              self._busy(n), n.address))
        return best, hits.get(best.node_id, NO_HIT)

    def _prefill_candidates(self, decode: NodeView) -> list[NodeView]:
        """Prefill nodes whose KV layout D can read (unknown layouts are given the benefit of the doubt)."""
        return [n for n in self.source.nodes(Role.PREFILL)
                if not (n.layout_hash and decode.layout_hash and n.layout_hash != decode.layout_hash)]

    # ---- scores (lower is better) ----
    def decode_score(self, node: NodeView, num_tokens: int, hit: HitTokens) -> float:
        score = self._seats(node) - self.config.hit_weight * self.saved_tokens(hit) / max(num_tokens, 1)
        total = node.capacity.total_kv_blocks
        if total:
            block_size = node.capacity.block_size or self.config.block_size
            needed = -(-num_tokens // block_size) - hit.device // block_size  # other tiers load into new blocks
            score += (total - node.load.free_kv_blocks + needed) / total
        return score

    def prefill_score(self, node: NodeView, num_tokens: int, hit: HitTokens) -> float:
        work = self._queued_prefill_tokens(node) + num_tokens - self.saved_tokens(hit)
        return work / (node.capacity.max_num_batched_tokens or 2048)

    def saved_tokens(self, hit: HitTokens) -> float:
        """saved(n): the tokens of computing a hit saves, once its reloads are paid."""
        return (hit.device + (1.0 - self.config.host_hit_cost) * hit.host
                + (1.0 - self.config.store_hit_cost) * hit.store)

    def _hits(self, hashes: tuple[BlockHash, ...], num_tokens: int, nodes: Sequence[NodeView]
              ) -> dict[str, HitTokens]:
        aware = {n.node_id: n.layout_hash for n in nodes if n.prefix_aware}
        if not aware or not hashes:
            return {}
        limit = num_tokens - 1  # the last prompt token is recomputed even on a full hit
        block_size = self.config.block_size
        hits: dict[str, HitTokens] = {}
        for node_id, match in self.source.index.match(hashes, aware).items():
            # the run ends in host or store blocks (device ones come first): the limit trims those
            device = min(match.num_device * block_size, limit)
            host = min(match.num_host * block_size, limit - device)
            store = min(match.num_store * block_size, limit - device - host)
            hits[node_id] = HitTokens(device, host, store)
        return hits

    # ---- load ----
    def _busy(self, node: NodeView) -> int:
        reported = node.load.num_running + node.load.num_waiting
        return max(reported, self._inflight_of(node).requests)

    def _seats(self, node: NodeView) -> float:
        return self._busy(node) / node.capacity.max_num_seqs if node.capacity.max_num_seqs else 0.0

    def _queued_prefill_tokens(self, node: NodeView) -> int:
        return max(node.load.num_queued_prefill_tokens, self._inflight_of(node).prefill_tokens)

    def _saturated(self, node: NodeView) -> bool:
        if self._seats(node) >= self.config.max_queue_factor:
            return True
        step = node.capacity.max_num_batched_tokens
        return (node.role is Role.PREFILL and step > 0
                and self._queued_prefill_tokens(node) >= self.config.max_prefill_queue_steps * step)

    def _inflight_of(self, node: NodeView) -> _InFlight:
        return self._inflight.get(node.address) or _InFlight()

    @contextlib.contextmanager
    def prefilling(self, node: NodeView, num_tokens: int) -> Iterator[None]:
        """Counts a prefill this proxy has in flight on `node` (its load until the node's next report)."""
        inflight = self._inflight.setdefault(node.address, _InFlight())
        inflight.requests += 1
        inflight.prefill_tokens += num_tokens
        try:
            yield
        finally:
            inflight.requests -= 1
            inflight.prefill_tokens -= num_tokens

    @contextlib.contextmanager
    def decoding(self, node: NodeView) -> Iterator[None]:
        """Counts a request this proxy has streaming from `node`."""
        inflight = self._inflight.setdefault(node.address, _InFlight())
        inflight.requests += 1
        try:
            yield
        finally:
            inflight.requests -= 1

    def _next(self, role: Role, nodes: list[NodeView]) -> NodeView:
        if not nodes:
            raise NoHealthyNodes(f"no healthy {role.value} node")
        return nodes[next(self._turn[role]) % len(nodes)]
