"""The fault suite (issue 13, item 3): each scenario injects one fault into a real cluster under a load of
concurrent greedy streaming clients, and checks the invariants every scenario must keep:

- every request ends by its deadline (none hung);
- no corrupted success: every 200 carries the transformers greedy reference, token for token;
- every failure is an OpenAI error with a message, a type and a code (no dropped connection, no bare 5xx page);
- no 5xx where the cluster had somewhere else to run the request (everywhere but the deadline scenario);
- no leaked KV block on any node once the load stops (Stats: free == total, nothing running, no ticket pinned);
- the cluster recovers: a request sent after the fault succeeds (the time it took is reported).

The scenarios share one cluster (tests/reliability/harness.py), brought back to full strength before each. Every
scenario adds its row to the report `--reliability-report PATH` names (bench/results/reliability-<date>.md for the
record), written when the session ends.

The SIGSTOP scenarios took over tests/integration/test_frozen_nodes.py (issue 13, defect 3: requests sent to a
frozen node are given up there and complete elsewhere with the greedy output; the thawed node frees everything).
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from engine.types import SamplingParams
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from protos.convert import params_to_proto
from tests.fixtures.tiny_models import hf_greedy_cached
from tests.reliability.faults import FaultPlan
from tests.reliability.harness import (
    LEASE_S,
    LONG_MAX_TOKENS,
    MAX_TOKENS,
    PROMPT_LENGTH,
    REQUEST_TIMEOUT_S,
    SHORT_DEADLINE_S,
    ClientBehaviour,
    Cluster,
    Kind,
    Load,
    Outcome,
    Row,
    burst,
    recovery_seconds,
    wait_for,
)

pytestmark = pytest.mark.integration

NUM_CLIENTS = 4
AFTER_FAULT_S = 2.0  # load kept on after the fault
LEAK_TIMEOUT_S = LEASE_S + 12.0  # leases expire, reads in flight end, aborts reach thawed nodes
FREEZE_S = 4.0  # long enough for the proxy to give a frozen node up (two failed 1 s health checks)
NUM_RPCS = 160  # deadline-cancelled Prefill RPCs (defect 2)


def run_scenario(cluster: Cluster, rows: list[Row], name: str, fault: Callable[[], None], *,
                 behaviour: ClientBehaviour | None = None, num_clients: int = NUM_CLIENTS, notes: str = "",
                 allow_5xx: bool = False, proxy_killed: Callable[[], bool] = lambda: False, url: str | None = None,
                 deadline_s: float = REQUEST_TIMEOUT_S) -> Row:
    """Full strength, load (to `url`: the cluster's proxy by default), the fault, AFTER_FAULT_S more load, the
    leak check; the row recorded, its must-be-zero columns checked."""
    cluster.restore()
    load = Load(cluster, num_clients, behaviour, proxy_killed, seed=len(rows), url=url, deadline_s=deadline_s)
    with load:
        wait_for(lambda: len(load.outcomes) >= num_clients, 60, "the load's first answers")
        fault_at = time.monotonic()
        fault()
        time.sleep(AFTER_FAULT_S)
    row = Row(name, list(load.outcomes), cluster.leaked_blocks(LEAK_TIMEOUT_S),
              recovery_seconds(load.outcomes, fault_at), notes)
    rows.append(row)
    check_invariants(row, allow_5xx)
    return row


def check_invariants(row: Row, allow_5xx: bool = False) -> None:
    for kind in (Kind.HUNG, Kind.CORRUPTED, Kind.UNCLEAR):
        found = row.failures(kind)
        assert not found, f"{row.scenario}: {len(found)} {kind.value} of {len(row.outcomes)}, e.g. {found[:2]}"
    assert row.leaked_blocks == 0, f"{row.scenario}: blocks, requests or tickets left on nodes: {row.leaked}"
    if not allow_5xx:
        errors = [o for o in row.outcomes if o.server_error]
        assert not errors, f"{row.scenario}: {len(errors)} server errors, e.g. {errors[:2]}"
    assert row.recovery_s is not None, f"{row.scenario}: no request sent after the fault succeeded"


def busy(cluster: Cluster, name: str, min_running: int) -> bool:
    stats = cluster.stats(name, timeout=1.0)
    if stats is None:
        return False
    return stats.num_running >= min_running if min_running else stats.num_running + stats.num_waiting > 0


def kill_when_busy(cluster: Cluster, name: str, min_running: int = 0, settle_s: float = 0.0) -> None:
    """kill -9 as soon as Stats shows the node holding a request (with `min_running`: that many running, then
    `settle_s` later, so that they have streamed), at the latest after 5 s; it starts again at once (and serves
    again once loaded)."""
    deadline = time.monotonic() + 5
    while not busy(cluster, name, min_running) and time.monotonic() < deadline:
        pass
    time.sleep(settle_s)
    cluster.kill(name)


def test_no_fault_baseline(cluster: Cluster, report_rows: list[Row]) -> None:
    row = run_scenario(cluster, report_rows, "no fault (baseline)", lambda: None)
    assert row.count(Kind.FAILED) == 0


def test_kill_prefill_node_mid_prefill(cluster: Cluster, report_rows: list[Row]) -> None:
    retries = cluster.metric("tandem:request_retries_total", role="prefill")
    row = run_scenario(cluster, report_rows, "kill -9 P mid-prefill", lambda: kill_when_busy(cluster, "prefill-0"),
                       notes="retried on the other P")
    assert cluster.metric("tandem:request_retries_total", role="prefill") > retries, "no prefill was cut"
    assert row.count(Kind.FAILED) == 0


def test_kill_prefill_node_mid_transfer(cluster: Cluster, report_rows: list[Row]) -> None:
    """decode-1 issues its reads 1 s late (fault plan): prefill-0 dies with reads from it in flight."""
    def fault() -> None:
        FaultPlan(delay_s=1.0).write(cluster.fault_plan)
        delayed = cluster.fault_log_lines("decode-1", "delayed")
        wait_for(lambda: cluster.fault_log_lines("decode-1", "delayed") > delayed + 1, 10, "a delayed read")
        kill_when_busy(cluster, "prefill-0")

    row = run_scenario(cluster, report_rows, "kill -9 P mid-transfer", fault,
                       notes="D's reads delayed 1 s; P killed while they wait")
    assert row.count(Kind.FAILED) == 0


def test_kill_decode_node_mid_stream(cluster: Cluster, report_rows: list[Row]) -> None:
    migrated = cluster.metric("tandem:decode_migrations_total", outcome="migrated")

    def fault() -> None:
        """kill -9 decode-0 while it streams; on a slow box the kill can land before any of its streams sent a
        token (then the proxy retries the request elsewhere, not a migration): once it is back, again, at most
        three times."""
        for _ in range(3):
            kill_when_busy(cluster, "decode-0", min_running=1, settle_s=0.2)
            try:
                wait_for(lambda: cluster.metric("tandem:decode_migrations_total", outcome="migrated") > migrated,
                         3, "a migrated stream")
                return
            except TimeoutError:
                process = cluster.nodes["decode-0"].process
                assert process is not None
                process.wait_for_line("READY", timeout=60)
                wait_for(lambda: cluster.ready_nodes().get("decode") == 2, 30, "decode-0 back at the proxy")

    row = run_scenario(cluster, report_rows, "kill -9 D mid-stream", fault,
                       behaviour=ClientBehaviour(max_tokens=LONG_MAX_TOKENS), notes="streams migrated to the other D")
    assert cluster.metric("tandem:decode_migrations_total", outcome="migrated") > migrated, "no stream migrated"
    assert row.count(Kind.FAILED) == 0


def frozen_for(cluster: Cluster, name: str, seconds: float) -> Callable[[], None]:
    def fault() -> None:
        process = cluster.nodes[name].process
        assert process is not None
        process.popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            process.popen.send_signal(signal.SIGCONT)

    return fault


def test_sigstop_prefill_node(cluster: Cluster, report_rows: list[Row]) -> None:
    """Requests sent to a frozen P are given up there (health checks) and prefilled on the other P, rather than
    waiting for the thaw; once thawed it frees what it took for them (issue 13, defect 3)."""
    abandoned = cluster.metric("tandem:attempts_abandoned_total", role="prefill", reason="node_lost")
    row = run_scenario(cluster, report_rows, f"SIGSTOP P ({FREEZE_S:g} s)", frozen_for(cluster, "prefill-0", FREEZE_S),
                       notes="given up on, retried on the other P")
    assert cluster.metric("tandem:attempts_abandoned_total", role="prefill", reason="node_lost") > abandoned
    assert row.count(Kind.FAILED) == 0


def test_sigstop_decode_node(cluster: Cluster, report_rows: list[Row]) -> None:
    """Requests on a frozen D, before or after it streamed, continue on the other D."""
    abandoned = cluster.metric("tandem:attempts_abandoned_total", role="decode", reason="node_lost")
    row = run_scenario(cluster, report_rows, f"SIGSTOP D ({FREEZE_S:g} s)", frozen_for(cluster, "decode-0", FREEZE_S),
                       behaviour=ClientBehaviour(max_tokens=32), notes="given up on, retried or migrated")
    assert cluster.metric("tandem:attempts_abandoned_total", role="decode", reason="node_lost") > abandoned
    assert row.count(Kind.FAILED) == 0


def test_redis_restart(cluster: Cluster, report_rows: list[Row]) -> None:
    row = run_scenario(cluster, report_rows, "Redis restart (empty)", cluster.redis.restart,
                       notes="nodes register again")
    # the nodes are found again in the new, empty Redis
    wait_for(lambda: cluster.ready_nodes() == {"prefill": 2, "decode": 2}, 30, "all nodes ready after the restart")
    assert row.count(Kind.FAILED) == 0


def test_transfer_corruption(cluster: Cluster, report_rows: list[Row]) -> None:
    corrupted = cluster.fault_log_lines("decode-1", "corrupted")
    row = run_scenario(cluster, report_rows, "transfer corruption (50% of D-1's reads)",
                       lambda: FaultPlan(corrupt_share=0.5, seed=1).write(cluster.fault_plan),
                       notes="checksum mismatch: prefilled again")
    assert cluster.fault_log_lines("decode-1", "corrupted") > corrupted, "no read was corrupted"
    assert row.count(Kind.FAILED) == 0


def test_transfer_drop(cluster: Cluster, report_rows: list[Row]) -> None:
    dropped = cluster.fault_log_lines("decode-1", "dropped")
    row = run_scenario(cluster, report_rows, "transfer drop (50% of D-1's reads)",
                       lambda: FaultPlan(drop_share=0.5, seed=2).write(cluster.fault_plan),
                       notes="failed read: prefilled again")
    assert cluster.fault_log_lines("decode-1", "dropped") > dropped, "no read was dropped"
    assert row.count(Kind.FAILED) == 0


def test_random_client_disconnects(cluster: Cluster, report_rows: list[Row]) -> None:
    row = run_scenario(cluster, report_rows, "random client disconnects (50%)", lambda: None,
                       behaviour=ClientBehaviour(max_tokens=32, leave_share=0.5), num_clients=6)
    assert row.count(Kind.LEFT) > 0


def test_slow_reader(cluster: Cluster, report_rows: list[Row]) -> None:
    """Two clients read one event per 50 ms of long streams while the others stream as fast as they can."""
    slow = Load(cluster, 2, ClientBehaviour(max_tokens=LONG_MAX_TOKENS, read_pause_s=0.05), seed=99)

    def fault() -> None:
        slow.__enter__()
        time.sleep(1.0)

    try:
        row = run_scenario(cluster, report_rows, "slow readers (2, 50 ms per event)", fault)
    finally:
        slow.stop()
    slow_row = Row("slow readers themselves", slow.outcomes, {}, None)
    check_invariants(Row(row.scenario, slow.outcomes, row.leaked, row.recovery_s))
    row.outcomes += slow.outcomes
    row.notes = f"{slow_row.count(Kind.OK)} slow streams of {LONG_MAX_TOKENS} tokens ok"
    assert slow_row.count(Kind.OK) > 0
    assert row.count(Kind.FAILED) == 0


def test_proxy_restart(cluster: Cluster, report_rows: list[Row]) -> None:
    down = threading.Event()

    def fault() -> None:
        assert cluster.proxy is not None
        down.set()
        cluster.proxy.stop(signal.SIGKILL)
        cluster.start_proxy()  # on the same port
        wait_for(lambda: cluster.ready_nodes() == {"prefill": 2, "decode": 2}, 60, "the new proxy ready")
        down.clear()

    row = run_scenario(cluster, report_rows, "proxy restart (kill -9)", fault, proxy_killed=down.is_set,
                       notes="cut: requests on the killed proxy")
    assert row.count(Kind.FAILED) == 0


def test_deadline_cancelled_requests(cluster: Cluster, report_rows: list[Row]) -> None:
    """Clients of a proxy whose deadline is 0.5 s while a decode node is frozen for 2 s: the requests sent there
    pass their deadline (the proxy gives a frozen node up only after its health checks fail), so the proxy
    cancels their RPCs and answers a clear 504 by the deadline; the others succeed; the thawed node frees what it
    held for the cancelled ones."""
    url = cluster.short_url
    wait_for(lambda: cluster.ready_nodes(url) == {"prefill": 2, "decode": 2}, 60, "the 0.5 s proxy ready")
    row = run_scenario(cluster, report_rows, f"deadline-cancelled requests ({SHORT_DEADLINE_S} s deadline, D frozen)",
                       frozen_for(cluster, "decode-0", 2.0), url=url, deadline_s=SHORT_DEADLINE_S, allow_5xx=True,
                       notes="the fault is the deadline: 504s expected")
    deadline_errors = [o for o in row.outcomes if o.kind is Kind.FAILED and "deadline" in o.detail]
    assert deadline_errors, "no request was cut by its deadline"
    assert all(o.kind is Kind.OK or o in deadline_errors for o in row.outcomes), "a failure other than the deadline"
    late = max(o.seconds for o in row.outcomes)
    assert late < SHORT_DEADLINE_S + 2.0, f"a request took {late:.2f} s with a {SHORT_DEADLINE_S} s deadline"


async def deadline_cancelled_prefills(address: str, num_rpcs: int, seed: int) -> dict[str, int]:
    """Prefill RPCs straight to a node, in waves of 16, each with a deadline of 1-60 ms (the gRPC deadline, and on
    every other one the request's own too), most cancelled while queued or prefilling: what each ended with."""
    rng = random.Random(seed)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ends: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tandem_pb2_grpc.PrefillServiceStub(channel)

        async def one(i: int) -> None:
            timeout = rng.uniform(0.001, 0.06)
            prompt = [rng.randrange(100, 1000) for _ in range(rng.randrange(16, 160))]
            request = pb.PrefillRequest(request_id=f"deadline-{seed}-{i}", prompt_token_ids=prompt, params=params,
                                        deadline=time.time() + timeout if i % 2 else 0.0)
            try:
                await stub.Prefill(request, timeout=timeout)
                end = "done"
            except grpc.aio.AioRpcError as e:
                end = e.code().name
            ends[end] = ends.get(end, 0) + 1

        for wave in range(0, num_rpcs, 16):
            await asyncio.gather(*(one(i) for i in range(wave, min(wave + 16, num_rpcs))))
    return ends


def test_deadline_cancelled_prefill_rpcs_leak_nothing_and_sigterm_is_prompt(cluster: Cluster,
                                                                             report_rows: list[Row]) -> None:
    """Defect 2 again: many Prefill RPCs cancelled by their deadline on a busy prefill node (the load's requests
    run there too) leave no pinned block once their leases are over, and the node then exits on SIGTERM at once
    (0 RPCs in flight), not after the drain timeout (120 s) as it did."""
    ends: dict[str, int] = {}

    def fault() -> None:
        ends.update(asyncio.run(deadline_cancelled_prefills(cluster.nodes["prefill-1"].address, NUM_RPCS, seed=7)))

    row = run_scenario(cluster, report_rows, "deadline-cancelled Prefill RPCs on a busy P (defect 2)", fault)
    assert ends.get("DEADLINE_EXCEEDED", 0) > 0, f"no Prefill RPC was cancelled by its deadline: {ends}"
    process = cluster.nodes["prefill-1"].process
    assert process is not None
    started = time.monotonic()
    process.popen.send_signal(signal.SIGTERM)
    process.popen.wait(60)
    exit_s = time.monotonic() - started
    row.notes = f"{NUM_RPCS} RPCs of 1-60 ms: {ends}; then SIGTERM: exit in {exit_s:.1f} s (drain timeout 120 s)"
    log = process.log()
    cluster.kill("prefill-1", restart=True)  # already gone: started again for the scenarios after this one
    assert "drain timed out" not in log
    assert exit_s < 15, f"the prefill node took {exit_s:.1f} s to exit on SIGTERM"


def test_kill_the_kv_store_master_mid_load(cluster: Cluster, report_rows: list[Row]) -> None:
    """The cluster KV store's master killed -9 under load (issue 40): every node meets the dead store (fresh
    prompts: their blocks are in no pool, so the prefill nodes ask the store, and every node puts), no request
    fails or is served wrong, and once the master is back (empty, on the same address) the nodes put again."""
    rng = random.Random(40)
    fresh = [[rng.randrange(3, 1000) for _ in range(PROMPT_LENGTH)] for _ in range(16)]
    cluster.references.update(zip(map(tuple, fresh), hf_greedy_cached(cluster.model, fresh, MAX_TOKENS),
                                  strict=True))
    errors = cluster.metric("tandem:kv_tier_errors_total", tier="store")
    during: list[Outcome] = []

    def fault() -> None:
        cluster.store.kill()
        during.extend(burst(cluster, fresh[:4], MAX_TOKENS))

    row = run_scenario(cluster, report_rows, "kill -9 the KV store's master", fault)
    assert row.count(Kind.FAILED) == 0
    assert [o.kind for o in during] == [Kind.OK] * 4, during
    store_errors = cluster.metric("tandem:kv_tier_errors_total", tier="store") - errors
    assert store_errors > 0, "no node met the dead store"

    cluster.restore()  # the master starts again, empty
    written = cluster.metric("tandem:kv_tier_write_bytes_total", tier="store")
    started = time.monotonic()
    for prompt in fresh[4:]:  # the nodes' breakers retry after 5 s; each burst's blocks are new to the store
        assert all(o.kind is Kind.OK for o in burst(cluster, [prompt], MAX_TOKENS))
        if cluster.metric("tandem:kv_tier_write_bytes_total", tier="store") > written:
            break
        time.sleep(1.0)
    else:
        raise AssertionError("no node put a block in the restarted store")
    resumed_s = time.monotonic() - started
    row.notes = f"{store_errors:.0f} store calls failed (each a miss); puts resumed {resumed_s:.1f} s after the restart"
