"""One node's engine, as engine/scheduler.py batches: running requests first (a decode request 1 token, a prompt
its next chunk), then waiting ones admitted in arrival order while the token budget, the seats and the KV blocks
last; blocks are taken as tokens are scheduled, and a running request that finds the pool dry preempts the newest
running one (its blocks freed, its tokens recomputed later as a prompt)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from benchmark.profile import NodeSpec, Profile, attended


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # takes no new requests, stops once its own have ended
    STOPPED = "stopped"


@dataclass(eq=False)
class Flight:
    """One request from its send to its end; `known`, `computed` and `blocks` are its state on the node holding
    it now (tokens known: prompt + generated; tokens whose K/V the node has; KV blocks it holds there)."""

    rid: int
    prompt: int
    output: int
    sent_s: float = 0.0
    known: int = 0
    computed: int = 0
    blocks: int = 0
    generated: int = 0
    token_times: list[float] = field(default_factory=list)
    decode: Node | None = None
    prefill: Node | None = None  # None: colocated
    done: bool = False


@dataclass(frozen=True)
class Step:
    batch: tuple[tuple[Flight, int], ...]  # (request, tokens computed)
    seconds: float  # at full speed


class Node:
    def __init__(self, nid: int, role: Role, profile: Profile, created_s: float, ready: bool) -> None:
        self.nid, self.role, self.profile = nid, role, profile
        self.spec: NodeSpec = profile.node
        self.created_s = created_s
        self.stopped_s: float | None = None
        self.state = State.READY if ready else State.STARTING
        self.running: list[Flight] = []
        self.waiting: deque[Flight] = deque()
        self.used_blocks = 0
        self.assigned = 0  # requests routed here and not yet gone (the proxy's in-flight count)
        self.step: Step | None = None
        # processor sharing: the running step's work left (seconds at full speed) as of `updated_s`
        self.work_left = 0.0
        self.updated_s = 0.0
        self.version = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size)

    @property
    def free_blocks(self) -> int:
        return self.spec.num_kv_blocks - self.used_blocks

    @property
    def seats(self) -> float:
        return self.assigned / self.spec.max_num_seqs

    def kv_fullness(self, prompt_tokens: int) -> float:
        return (self.used_blocks + self.blocks_for(prompt_tokens)) / self.spec.num_kv_blocks

    def queued_prompt_tokens(self) -> int:
        """Tokens not yet computed of the requests here (on a prefill node: the prompt tokens queued)."""
        return sum(f.known - f.computed for f in self.running) + sum(f.known - f.computed for f in self.waiting)

    @property
    def idle(self) -> bool:
        return self.step is None and not self.running and not self.waiting

    def schedule(self) -> Step | None:
        """The next step, its blocks taken; None when nothing can run."""
        budget, block_size = self.spec.max_num_batched_tokens, self.spec.block_size
        batch: list[tuple[Flight, int]] = []
        pairs = 0.0
        i = 0
        while i < len(self.running) and budget > 0:
            f = self.running[i]
            n = min(f.known - f.computed, budget)
            if -(-(f.computed + n) // block_size) > f.blocks and not self._take_blocks(f, n):
                break
            batch.append((f, n))
            pairs += n * f.computed + n * (n + 1) / 2  # attended(f.computed, n), inlined: the hot loop
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            f = self.waiting[0]
            n = min(f.known - f.computed, budget)
            need = self.blocks_for(f.computed + n) - f.blocks
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.running.append(f)
            self.used_blocks += need
            f.blocks += need
            batch.append((f, n))
            pairs += attended(f.computed, n)
            budget -= n
        if not batch:
            return None
        tokens = self.spec.max_num_batched_tokens - budget
        return Step(tuple(batch), self.profile.step.seconds(tokens, len(batch), pairs))

    def _take_blocks(self, f: Flight, n: int) -> bool:
        """Blocks for `n` more tokens of running request `f`, preempting the newest running requests while the
        pool is dry; False when `f` itself was preempted."""
        need = self.blocks_for(f.computed + n) - f.blocks
        while need > self.free_blocks:
            victim = self.running.pop()
            self._free(victim)
            victim.computed = 0
            self.waiting.appendleft(victim)
            if victim is f:
                return False
        self.used_blocks += need
        f.blocks += need
        return True

    def finish_step(self, now: float) -> list[Flight]:
        """Apply the running step's results: the requests that sampled a token (its time recorded)."""
        assert self.step is not None
        sampled = []
        for f, n in self.step.batch:
            f.computed += n
            if f.computed == f.known:
                f.known += 1
                f.generated += 1
                f.token_times.append(now)
                sampled.append(f)
        self.step = None
        return sampled

    def remove(self, f: Flight) -> None:
        self.running.remove(f)
        self._free(f)

    def _free(self, f: Flight) -> None:
        self.used_blocks -= f.blocks
        f.blocks = 0
