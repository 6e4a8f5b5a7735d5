"""What one node serves under the SLOs, from its profile (benchmark/profile.py): DistServe's analytic placement.

- A prefill node is a queue in front of a step loop. Its service time for a prompt of L tokens is the steps that
  prefill it alone (`Profile.prefill_s` less the request's fixed cost); under load the engine batches prompts up to
  the token budget, so its throughput is what a full batch computes per second. The waiting time is M/G/1's
  (Pollaczek-Khinchine mean, with the usual exponential tail: P(W > t) = rho exp(-t rho / E[W])), and the node's
  capacity is the highest arrival rate whose TTFT at the SLO's percentile stays under the TTFT SLO.
- A decode node runs the largest batch whose step (`Profile.decode_step_s(batch, context)`) stays under the ITL
  SLO, bounded by its seats (max_num_seqs) and its KV blocks; a request holds a seat for its output's steps, so a
  node finishes batch / (output_len x step) requests per second (Little's law).
- Colocation (the proxy's --colocate-max-tokens): prompts up to the threshold are prefilled on D, which then
  spends part of its time on them; they leave the prefill pool's load.

Prompt lengths are spread as `tandem bench serve --range-ratio` draws them: uniform over [L(1 - r), L(1 + r)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmark.profile import Profile, attended, chunks
from cluster.planner.types import SLO, PoolSizes

LENGTH_POINTS = 9  # how finely a spread of prompt lengths is sampled


@dataclass(frozen=True)
class Load:
    """Requests per second and their mean prompt and output lengths (lengths spread by `range_ratio`)."""

    rate: float
    input_len: float
    output_len: float
    range_ratio: float = 0.0

    def prompt_lengths(self) -> list[int]:
        """Equally likely prompt lengths that stand for the spread."""
        if self.range_ratio <= 0:
            return [max(1, round(self.input_len))]
        low, high = self.input_len * (1 - self.range_ratio), self.input_len * (1 + self.range_ratio)
        return [max(1, round(low + (high - low) * (i + 0.5) / LENGTH_POINTS)) for i in range(LENGTH_POINTS)]


@dataclass(frozen=True)
class NodeCapacity:
    """One node's capacity at a load's lengths (rates in requests per second)."""

    prefill_rate: float  # prompts per second a prefill node takes with TTFT under the SLO (0: not even one)
    decode_rate: float  # requests per second a decode node finishes with ITL under the SLO (0: not even one)
    decode_batch: int  # requests decoding together on a node at that rate (its concurrency)
    colocated_share: float  # fraction of the prompts the decode nodes prefill themselves
    prefill_tokens_per_s: float  # prompt tokens per second a prefill node computes at full batches

    def nodes(self, rate: float, utilisation: float = 1.0) -> PoolSizes:
        """Nodes for `rate` requests per second, each run at most at `utilisation` of its capacity (at least one
        node of each role: the proxy needs both pools)."""
        return PoolSizes(_count(rate * (1 - self.colocated_share), self.prefill_rate * utilisation),
                         _count(rate, self.decode_rate * utilisation))


def _count(rate: float, per_node: float) -> int:
    if rate <= 0:
        return 1
    if per_node <= 0:
        return 0  # infeasible: no count of nodes meets the SLO
    return max(1, math.ceil(rate / per_node - 1e-9))


def service_s(profile: Profile, prompt_tokens: int) -> float:
    """The steps that prefill one prompt alone."""
    return sum(profile.step.seconds(n, 1, attended(start, n))
               for start, n in chunks(prompt_tokens, profile.node.max_num_batched_tokens))


def batched_prompts_per_s(profile: Profile, prompt_tokens: int) -> float:
    """Prompts of this length a prefill node computes per second when it always has some waiting."""
    node = profile.node
    together = max(1, min(node.max_num_seqs, node.max_num_batched_tokens // max(prompt_tokens, 1)))
    if together == 1:
        return 1.0 / max(service_s(profile, prompt_tokens), 1e-9)
    step = profile.step.seconds(together * prompt_tokens, together, together * attended(0, prompt_tokens))
    return together / max(step, 1e-9)


def ttft_quantile(profile: Profile, lengths: list[int], rate: float, percentile: float) -> float:
    """TTFT at `percentile` of prompts of `lengths` (equally likely) arriving at `rate` on one prefill node."""
    services = [service_s(profile, n) for n in lengths]
    mean_service = sum(services) / len(services)
    throughput = sum(batched_prompts_per_s(profile, n) for n in lengths) / len(lengths)
    # each prompt's share of the node under batching: its alone-time scaled by the batching gain
    scale = 1.0 / max(throughput * mean_service, 1e-9)
    effective = [s * scale for s in services]
    rho = rate * sum(effective) / len(effective)
    slowest = sorted(services)[min(len(services) - 1, math.ceil(percentile / 100 * len(services)) - 1)]
    if rho >= 1:
        return math.inf
    wait = 0.0
    tail = 1 - percentile / 100
    if rho > tail and rho > 0:
        mean_wait = rate * sum(e * e for e in effective) / len(effective) / (2 * (1 - rho))
        wait = mean_wait / rho * math.log(rho / tail)
    return profile.request_s + slowest + wait


def prefill_rate(profile: Profile, lengths: list[int], slo: SLO) -> float:
    """The highest rate of these prompts one prefill node serves with TTFT at the percentile under the SLO."""
    if not lengths or ttft_quantile(profile, lengths, 0.0, slo.percentile) > slo.ttft_s:
        return 0.0
    high = sum(batched_prompts_per_s(profile, n) for n in lengths) / len(lengths)
    low = 0.0
    for _ in range(60):
        mid = (low + high) / 2
        if ttft_quantile(profile, lengths, mid, slo.percentile) <= slo.ttft_s:
            low = mid
        else:
            high = mid
    return low


def decode_batch(profile: Profile, context: int, total_len: int, itl_s: float) -> int:
    """The largest batch whose decode step stays under the ITL SLO, within the node's seats and KV blocks."""
    node = profile.node
    blocks_each = max(1, math.ceil(total_len / node.block_size))
    bound = min(node.max_num_seqs, node.num_kv_blocks // blocks_each)
    best = 0
    for batch in range(1, bound + 1):
        if profile.decode_step_s(batch, context) > itl_s:
            break
        best = batch
    return best


def capacity(profile: Profile, slo: SLO, load: Load, colocate_max_tokens: int = 0) -> NodeCapacity:
    """Per-node capacity at this load's lengths, with prompts up to `colocate_max_tokens` prefilled on D."""
    lengths = load.prompt_lengths()
    output = max(1, round(load.output_len))
    colocated = [n for n in lengths if n <= colocate_max_tokens]
    disaggregated = [n for n in lengths if n > colocate_max_tokens]
    share = len(colocated) / len(lengths)
    context = round(load.input_len + output / 2)
    batch = decode_batch(profile, context, round(load.input_len) + output, slo.itl_s)
    p_rate = prefill_rate(profile, disaggregated, slo) if disaggregated else math.inf
    tokens_per_s = batched_prompts_per_s(profile, max(lengths)) * max(lengths)
    if batch == 0:
        return NodeCapacity(p_rate, 0.0, 0, share, tokens_per_s)
    step = profile.decode_step_s(batch, context)
    busy_per_request = output * step / batch  # node-seconds of decode steps one request takes
    if colocated:
        colocated_ok = _colocation_feasible(profile, slo, colocated, batch, context, share, output, step)
        if not colocated_ok:
            return NodeCapacity(p_rate, 0.0, batch, share, tokens_per_s)
        busy_per_request += share * sum(service_s(profile, n) for n in colocated) / len(colocated)
    return NodeCapacity(p_rate, 1.0 / busy_per_request, batch, share, tokens_per_s)


def _colocation_feasible(profile: Profile, slo: SLO, colocated: list[int], batch: int, context: int,
                         share: float, output: int, step: float) -> bool:
    """Whether D can prefill these prompts itself: their TTFT (a decode step ahead, then their chunks merged into
    decode steps) under the TTFT SLO, and the decode steps they slow past the ITL SLO rarer than the SLO's tail."""
    longest = max(colocated)
    merged = [profile.step.seconds(n + batch, 1 + batch, attended(start, n) + batch * context)
              for start, n in chunks(longest, profile.node.max_num_batched_tokens)]
    if profile.request_s + step + sum(merged) > slo.ttft_s:
        return False
    if max(merged) <= slo.itl_s:
        return True
    # each colocated prompt slows len(merged) steps of the whole batch; a full node starts batch / output
    # requests per step, so this share of its steps (and of every request's gaps) is slow
    return batch * share * len(merged) / max(output, 1) <= (1 - slo.percentile / 100)
