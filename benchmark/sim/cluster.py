"""The event loop: arrivals (under a client concurrency limit), the proxy's cost and routing, the nodes' steps
under processor sharing, handoffs, and the controller hook that adds and drains nodes."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from benchmark.client import RequestOutput
from benchmark.metrics import calculate_metrics
from benchmark.profile import Profile
from benchmark.sim.control import WindowCounter
from benchmark.sim.node import Flight, Node, Role, State
from benchmark.sim.router import route
from benchmark.sim.types import Controller, SimRequest, SimResult, TimelinePoint
from cluster.planner.types import Decision, LoadWindow, PoolSizes

ARRIVE, REACH, HANDOFF, STEP, READY, TICK, WAKE = range(7)
OVERLOADED = "Overloaded: every decode node is saturated"


def simulate(*, profile: Profile, requests: Sequence[SimRequest], prefill_nodes: int, decode_nodes: int,
             colocate_max_tokens: int = 64, cores: int | None = None, max_concurrency: int | None = None,
             percentiles: Sequence[float] = (90.0, 99.0), goodput_slos_ms: dict[str, float] | None = None,
             controller: Controller | None = None, interval_s: float = 60.0, node_startup_s: float = 0.0,
             window_percentile: float = 90.0) -> SimResult:
    """Run `requests` through a cluster of `prefill_nodes` + `decode_nodes` nodes of `profile` (see
    benchmark/sim/__init__.py)."""
    if decode_nodes < 1 or prefill_nodes < 0:
        raise ValueError("a cluster needs at least 1 decode node and no negative pool")
    if not requests:
        raise ValueError("the workload has no requests")
    if max_concurrency is not None and max_concurrency <= 0:
        raise ValueError("max_concurrency must be positive")
    if controller is not None and interval_s <= 0:
        raise ValueError("interval_s must be positive")
    sim = _Sim(profile, requests, colocate_max_tokens, profile.cores if cores is None else cores,
               max_concurrency, controller, interval_s, node_startup_s, window_percentile)
    sim.add_nodes(Role.PREFILL, prefill_nodes, ready=True)
    sim.add_nodes(Role.DECODE, decode_nodes, ready=True)
    sim.run()
    return sim.result(percentiles, goodput_slos_ms)


class _Sim:
    def __init__(self, profile: Profile, requests: Sequence[SimRequest], colocate_max_tokens: int, cores: int,
                 max_concurrency: int | None, controller: Controller | None, interval_s: float,
                 node_startup_s: float, window_percentile: float) -> None:
        self.profile, self.colocate_max_tokens, self.cores = profile, colocate_max_tokens, cores
        self.max_concurrency, self.controller, self.interval_s = max_concurrency, controller, interval_s
        self.node_startup_s, self.window_percentile = node_startup_s, window_percentile
        self.flights = [Flight(i, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)]
        self.errors: dict[int, str] = {}
        self.colocated = [False] * len(requests)
        self.nodes: list[Node] = []
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.end_s = 0.0
        self.busy: list[Node] = []  # nodes running a step
        self.waking: set[int] = set()  # idle nodes with a WAKE event queued
        self.in_flight = 0
        self.resolved = 0
        self.backlog: deque[int] = deque()  # sends held back by the concurrency limit
        self.pending: deque[Flight] = deque()  # reached the proxy while no decode node served
        self.window = WindowCounter()
        self.timeline: list[TimelinePoint] = []
        self.windows: list[LoadWindow] = []
        self.decisions: list[tuple[float, Decision]] = []
        for i, r in enumerate(requests):
            self.push(r.arrival_s, ARRIVE, i)
        if controller is not None:
            self.push(interval_s, TICK, 0)

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        handlers = {ARRIVE: self.on_arrive, REACH: self.on_reach, HANDOFF: self.on_handoff, STEP: self.on_step,
                    READY: self.on_ready, TICK: self.on_tick, WAKE: self.on_wake}
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            self.now = t
            handlers[kind](a, b)

    # --- requests ---

    def on_arrive(self, rid: int, _: int) -> None:
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            self.backlog.append(rid)
        else:
            self.send(rid)

    def send(self, rid: int) -> None:
        f = self.flights[rid]
        f.sent_s = self.now
        self.in_flight += 1
        self.window.arrived(f.prompt)
        self.push(self.now + self.profile.request_s, REACH, rid)

    def on_reach(self, rid: int, _: int) -> None:
        self.dispatch(self.flights[rid])

    def dispatch(self, f: Flight) -> None:
        spec = self.profile.node
        if -(-(f.prompt + f.output) // spec.block_size) > spec.num_kv_blocks:
            return self.fail(f, f"prompt + output ({f.prompt + f.output} tokens) exceed one node's KV pool")
        choice = route(f.prompt, self.pool(Role.DECODE), self.pool(Role.PREFILL), self.colocate_max_tokens)
        if choice.no_decode:
            self.pending.append(f)
            return None
        if choice.decode is None:
            return self.fail(f, OVERLOADED)
        f.decode, f.prefill = choice.decode, choice.prefill
        f.decode.assigned += 1
        target = f.prefill or f.decode
        if f.prefill is None:
            self.colocated[f.rid] = True
        else:
            f.prefill.assigned += 1
        f.known = f.prompt
        target.waiting.append(f)
        self.kick(target)
        return None

    def fail(self, f: Flight, error: str) -> None:
        self.errors[f.rid] = error
        self.resolve(f)

    def resolve(self, f: Flight) -> None:
        f.done = True
        self.resolved += 1
        self.in_flight -= 1
        self.end_s = max(self.end_s, self.now)
        if self.backlog:
            self.send(self.backlog.popleft())

    def on_handoff(self, rid: int, _: int) -> None:
        f = self.flights[rid]
        assert f.decode is not None
        f.computed, f.known = f.prompt, f.prompt + 1
        f.decode.waiting.append(f)
        self.kick(f.decode)

    def on_tokens(self, node: Node, sampled: list[Flight]) -> None:
        for f in sampled:
            first = f.generated == 1
            gap = self.now - (f.sent_s if first else f.token_times[-2])
            self.window.token(gap, first)
            if node.role is Role.PREFILL:
                node.remove(f)
                node.assigned -= 1
                if f.output > 1:
                    self.push(self.now + self.profile.handoff_s(f.prompt), HANDOFF, f.rid)
                else:
                    self.finish(f)
                self.maybe_stop(node)
            elif f.generated >= f.output:
                node.remove(f)
                self.finish(f)

    def finish(self, f: Flight) -> None:
        assert f.decode is not None
        f.decode.assigned -= 1
        self.window.completed += 1
        self.resolve(f)
        self.maybe_stop(f.decode)

    # --- nodes' steps, processor sharing ---

    def rate(self, busy: int) -> float:
        return 1.0 if self.cores <= 0 or busy <= self.cores else self.cores / busy

    def kick(self, node: Node) -> None:
        """New work for `node`: an idle engine wakes after every request that reaches it at this same instant is
        queued (a WAKE event behind them), so that requests sent together are batched together, as the engine's
        loop batches what reached it while it slept; a busy one takes it at its next step."""
        if node.step is not None or node.state is State.STOPPED or node.nid in self.waking:
            return
        self.waking.add(node.nid)
        self.push(self.now, WAKE, node.nid)

    def on_wake(self, nid: int, _: int) -> None:
        self.waking.discard(nid)
        self.start_step(self.nodes[nid])

    def start_step(self, node: Node) -> None:
        if node.step is not None or node.state is State.STOPPED:
            return
        step = node.schedule()
        if step is None:
            return
        node.step = step
        self.set_busy(node, step.seconds)

    def set_busy(self, node: Node, work: float | None) -> None:
        """Add `node` to the running steps (with `work` seconds at full speed) or, for None, take it off."""
        if self.cores <= 0:  # no bound: a step takes its own time
            if work is None:
                self.busy.remove(node)
            else:
                node.version += 1
                self.busy.append(node)
                self.push(self.now + work, STEP, node.nid, node.version)
            return
        before = len(self.busy)
        after = before + (1 if work is not None else -1)
        shared = self.rate(before) != self.rate(after)
        if shared:
            old = self.rate(before)
            for n in self.busy:
                n.work_left -= (self.now - n.updated_s) * old
                n.updated_s = self.now
        if work is None:
            self.busy.remove(node)
        else:
            node.work_left, node.updated_s = work, self.now
            self.busy.append(node)
        rate = self.rate(after)
        for n in self.busy if shared else ([node] if work is not None else []):
            n.version += 1
            self.push(self.now + max(n.work_left, 0.0) / rate, STEP, n.nid, n.version)

    def on_step(self, nid: int, version: int) -> None:
        node = self.nodes[nid]
        if version != node.version or node.step is None:
            return
        self.set_busy(node, None)
        self.on_tokens(node, node.finish_step(self.now))
        self.start_step(node)

    # --- pools ---

    def pool(self, role: Role) -> list[Node]:
        return [n for n in self.nodes if n.role is role]

    def add_nodes(self, role: Role, count: int, ready: bool) -> None:
        for _ in range(count):
            node = Node(len(self.nodes), role, self.profile, self.now, ready)
            self.nodes.append(node)
            if not ready:
                self.push(self.now + self.node_startup_s, READY, node.nid)
        self.record()

    def on_ready(self, nid: int, _: int) -> None:
        node = self.nodes[nid]
        if node.state is not State.STARTING:
            return
        node.state = State.READY
        self.record()
        if node.role is Role.DECODE:
            pending, self.pending = self.pending, deque()
            for f in pending:
                self.dispatch(f)

    def drain(self, role: Role, count: int) -> None:
        """Take `count` nodes of `role` out: those still starting first (newest first), then the least busy."""
        starting = [n for n in reversed(self.pool(role)) if n.state is State.STARTING]
        serving = sorted((n for n in self.pool(role) if n.state is State.READY), key=lambda n: (n.assigned, -n.nid))
        for node in (starting + serving)[:count]:
            node.state = State.DRAINING
            self.maybe_stop(node)
        self.record()

    def maybe_stop(self, node: Node) -> None:
        if node.state is State.DRAINING and node.assigned == 0 and node.idle:
            node.state, node.stopped_s = State.STOPPED, self.now
            self.record()

    def sizes(self, *states: State) -> PoolSizes:
        count = {role: sum(n.state in states for n in self.pool(role)) for role in Role}
        return PoolSizes(prefill=count[Role.PREFILL], decode=count[Role.DECODE])

    def record(self) -> None:
        point = TimelinePoint(self.now, self.sizes(State.READY),
                              self.sizes(State.STARTING, State.READY, State.DRAINING))
        if self.timeline and (self.timeline[-1].serving, self.timeline[-1].alive) == (point.serving, point.alive):
            return
        if self.timeline and self.timeline[-1].t == point.t:
            self.timeline.pop()
        self.timeline.append(point)

    # --- the controller ---

    def on_tick(self, _: int, __: int) -> None:
        assert self.controller is not None
        queued = sum(n.queued_prompt_tokens() for n in self.pool(Role.PREFILL) if n.state is not State.STOPPED)
        window = self.window.close(self.now, self.window_percentile, self.in_flight, queued)
        self.window = WindowCounter(self.now)
        self.windows.append(window)
        current = self.sizes(State.STARTING, State.READY)
        decision = self.controller.decide(self.now, window, current)
        self.decisions.append((self.now, decision))
        for role, have, want in ((Role.PREFILL, current.prefill, max(decision.sizes.prefill, 0)),
                                 (Role.DECODE, current.decode, max(decision.sizes.decode, 1))):
            if want > have:
                self.add_nodes(role, want - have, ready=self.node_startup_s <= 0)
            elif want < have:
                self.drain(role, have - want)
        if self.resolved < len(self.flights):
            self.push(self.now + self.interval_s, TICK, 0)

    # --- the result ---

    def result(self, percentiles: Sequence[float], goodput_slos_ms: dict[str, float] | None) -> SimResult:
        outputs = [self.output(f) for f in self.flights]
        duration = self.end_s if self.end_s > 0 else math.ulp(1.0)
        seconds = {role: sum((n.stopped_s if n.stopped_s is not None else self.end_s) - n.created_s
                             for n in self.pool(role)) for role in Role}
        return SimResult(
            metrics=calculate_metrics(outputs, duration, percentiles, goodput_slos_ms), outputs=outputs,
            colocated=self.colocated, duration_s=self.end_s, prefill_node_seconds=max(seconds[Role.PREFILL], 0.0),
            decode_node_seconds=max(seconds[Role.DECODE], 0.0), timeline=self.timeline, windows=self.windows,
            decisions=self.decisions)

    def output(self, f: Flight) -> RequestOutput:
        if f.rid in self.errors or not f.token_times:
            return RequestOutput(prompt_len=f.prompt, start_time=f.sent_s, success=False,
                                 error=self.errors.get(f.rid, "never served"))
        times = f.token_times
        latency = times[-1] - f.sent_s
        while f.sent_s + latency > times[-1]:  # rounding: the end must not pass the next send it frees
            latency = math.nextafter(latency, 0.0)
        return RequestOutput(prompt_len=f.prompt, output_tokens=len(times), ttft=times[0] - f.sent_s,
                             itl=[b - a for a, b in zip(times, times[1:], strict=False)],
                             latency=latency, start_time=f.sent_s, success=True)
