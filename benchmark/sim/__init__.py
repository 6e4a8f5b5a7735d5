"""A cluster simulator: Tandem's proxy, prefill and decode nodes, and optionally the planner, as a discrete-event
model driven by a node profile (benchmark/profile.py). Torch-free and deterministic (no wall clock; a workload
generated from a seed gives the same result every time).

Python API (what `tandem plan` calls)::

    from benchmark.sim import SimRequest, simulate

    result = simulate(
        profile=profile,                 # benchmark.profile.Profile
        requests=[SimRequest(arrival_s=0.0, prompt_tokens=1024, output_tokens=128), ...],
        prefill_nodes=1,                 # 0: colocated only (every decode node prefills its own requests)
        decode_nodes=1,                  # at least 1
        colocate_max_tokens=64,          # the router's: prompts this short go to D alone (scaled down as D fills)
        cores=None,                      # CPU contention bound; None: profile.cores; 0: no bound (GPU nodes)
        max_concurrency=None,            # a client limit as `tandem bench serve --max-concurrency` has
        percentiles=(90.0, 99.0),        # the metrics' percentiles (`--metric-percentiles`)
        goodput_slos_ms=None,            # {"ttft": 200, "tpot": 50}: as `--goodput`
        controller=None,                 # an object with decide(now, window, current) -> Decision
        interval_s=60.0,                 # how often the controller is asked
        node_startup_s=0.0,              # a node the controller adds serves this long after it is asked for
        window_percentile=90.0,          # the percentile of the LoadWindow's TTFT and ITL (the SLO's)
    )
    result.metrics        # benchmark.metrics.BenchmarkMetrics, as `tandem bench serve` reports
    result.outputs        # list[benchmark.client.RequestOutput], in the order of `requests`
    result.colocated      # list[bool]: which requests D prefilled itself
    result.duration_s     # run start (time 0) to the last request's end
    result.node_seconds   # sum over nodes of their lifetime (from being asked for to stopping, or the end)
    result.prefill_node_seconds, result.decode_node_seconds
    result.timeline       # list[TimelinePoint(t, serving: PoolSizes, alive: PoolSizes)], one per change
    result.windows        # list[LoadWindow] the controller saw;  result.decisions: list[(t, Decision)]

`requests` are sent at their `arrival_s` (seconds from the run's start), or, under `max_concurrency`, as soon as
a slot frees after it (then a request's latency starts when it is sent, as the benchmark's does). Workloads:
`benchmark.sim.workload` (`load_trace`, `random_requests`, `day_trace`). The CLI: `python -m benchmark.sim -h`.

The model (benchmark/sim/node.py, benchmark/sim/cluster.py):
- Every node runs the engine's step loop: running requests first (a decode request 1 token, a prompt its next
  chunk), then waiting ones admitted in arrival order while the token budget (max_num_batched_tokens), the seats
  (max_num_seqs) and the KV blocks last; a step's time is `profile.step.seconds(tokens, seqs, attended)`, each
  request's attended pairs `benchmark.profile.attended(computed, new)`. Blocks are taken as tokens are scheduled;
  a running request that finds the pool dry preempts the newest running one (recomputed later), as the engine does.
- Processor sharing: when more nodes run a step at once than `cores`, every running step progresses at
  cores/busy of its speed.
- The proxy: each request costs `profile.request_s` before it reaches a node. The router picks D by the lowest
  seats + KV fullness (seats: requests routed to D and not finished / max_num_seqs; saturated at 2 x), colocates
  when prompt <= colocate_max_tokens x (1 - min(seats, 1)) or no prefill node can take it, else picks P by the
  fewest queued prompt tokens (saturated at 8 x the budget). Every decode node saturated: the request fails.
- Disaggregated: P's first token is the TTFT; P's blocks are freed then; D gets the request
  `profile.handoff_s(prompt)` later, already prefilled, and its next step makes the second token.
- The controller hook: every `interval_s` it gets the LoadWindow the simulator observed and the current pool
  sizes (nodes serving or starting); new nodes serve after `node_startup_s`; removed nodes drain (a node still
  starting is dropped at once; else the least busy ones stop taking requests and stop once their requests end).
"""

from benchmark.sim.cluster import simulate
from benchmark.sim.types import Controller, SimRequest, SimResult, TimelinePoint

__all__ = ["Controller", "SimRequest", "SimResult", "TimelinePoint", "simulate"]
