"""Turns one step's logits into next tokens, with vLLM v1's semantics.

For each row, in order:
 1. logprobs, when asked, come from the raw logits (log_softmax before any processing), as vLLM's default
    `raw_logprobs` mode; they are gathered after sampling but never see the steps below;
 2. min_tokens: eos and stop_token_ids are set to -inf while the output is shorter than min_tokens;
 3. penalties: repetition (tokens of prompt + output), then frequency and presence (output tokens only);
 4. greedy rows take the argmax;
 5. random rows: temperature, min_p, top_k, top_p, then an exponential race with the row's own generator.

min_p runs before top_k/top_p, as in vLLM v1 (it is one of its argmax-invariant logits processors, applied
right after temperature). The order matters only with top_p: min_p compares each probability to the
largest one, so it commutes with top_k but not with top_p's renormalised cumulative sum.

Batch invariance: each random row draws exactly `vocab` exponentials seeded by `noise_seed(request seed,
output index)` and every tensor operation works within a row, so a seeded request samples the same tokens
whatever else shares the batch and in whichever order. The noise depends on nothing but the seed and the
token's index either, so a request that a prefill node starts (token 0) and a decode node continues (tokens
1, 2, ...) samples what it would have sampled on one node.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.types import Logprob, PositionLogprobs, SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what the sampler needs to know of its request."""

    params: SamplingParams
    # The seed of this row's noise (noise_seed of the request's seed and this token's index); None only for
    # greedy rows.
    seed: int | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far, before this step
    # Suppressed, with params.stop_token_ids, while the output is shorter than min_tokens. The sampler
    # suppresses whatever it is given; pass an empty set to leave eos alone (vLLM does so with ignore_eos).
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SampledToken:
    token_id: int
    # When params.logprobs is not None: the sampled token and the top-N (N = params.logprobs), ranks 1-based,
    # decoded_token left None for the caller to fill.
    logprobs: PositionLogprobs | None = None


_MASK64 = (1 << 64) - 1


def noise_seed(request_seed: int, output_index: int) -> int:
    """The seed of the sampling noise for a request's output token number `output_index` (0 = the first).

    splitmix64 of the pair: nearby seeds and indices give unrelated noise."""
    x = (request_seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Samples one token per row of logits. The request state travels in the rows; the sampler only keeps
    one generator per device, re-seeded for every random row."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        # logits: [num_rows, vocab], any float dtype; never modified.
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        if not rows:
            return []
        processed = process_logits(logits, rows)
        greedy_rows = [i for i, row in enumerate(rows) if row.params.greedy]
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_rows:
            # The common case, all greedy: one argmax over the batch.
            sampled = processed.argmax(dim=-1)
        else:
            sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy_rows:
                sampled[greedy_rows] = processed[greedy_rows].argmax(dim=-1)
            # Advanced indexing copies, so the in-place steps of sample_random leave `processed` alone.
            generator = self._generators.get(logits.device)
            if generator is None:
                generator = self._generators[logits.device] = torch.Generator(device=logits.device)
            sampled[random_rows] = sample_random(
                processed[random_rows].to(torch.float32), [rows[i] for i in random_rows], generator
            )
        token_ids: list[int] = sampled.tolist()
        logprobs = gather_logprobs(logits, rows, sampled)
        return [SampledToken(token_id, logprobs.get(i)) for i, token_id in enumerate(token_ids)]


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _suppressed_token_ids(row: SamplingRow, vocab_size: int) -> list[int]:
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    stop_token_ids = row.params.stop_token_ids or []
    # Ids past the vocabulary cannot be sampled anyway; indexing with them would fail (on CUDA, fatally).
    return sorted(t for t in row.eos_token_ids.union(stop_token_ids) if t < vocab_size)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Applies min_tokens suppression and the penalties. Returns `logits` itself when no row needs either,
    else a float32 copy: the raw logits stay intact for logprobs."""
    device, vocab_size = logits.device, logits.shape[1]
    suppressed = [_suppressed_token_ids(row, vocab_size) for row in rows]
    penalized = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not any(suppressed) and not penalized:
        return logits
    processed = logits.to(torch.float32, copy=True)
    if any(suppressed):
        processed[_token_index(suppressed, device)] = -math.inf
    if penalized:
        processed[penalized] = _penalized(processed[penalized], [rows[i] for i in penalized])
    return processed


def _token_index(token_ids_per_row: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(row, token id) index tensors of every token of every row, for indexing a [num_rows, vocab] tensor.
    Built with numpy and sent in one copy: torch.tensor on Python lists costs ~30x more per id."""
    lengths = [len(token_ids) for token_ids in token_ids_per_row]
    total = sum(lengths)
    index = np.empty((2, total), dtype=np.int64)
    index[0] = np.repeat(np.arange(len(lengths)), lengths)
    index[1] = np.fromiter(itertools.chain.from_iterable(token_ids_per_row), dtype=np.int64, count=total)
    return torch.from_numpy(index).to(device).unbind(dim=0)


def _penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, batched over the rows that have any.
    logits: [num_rows, vocab] float32."""
    device = logits.device
    penalties = torch.tensor(
        [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in rows],
        dtype=torch.float32,
        device=device,
    )
    repetition, frequency, presence = (penalties[:, k : k + 1] for k in range(3))  # each [num_rows, 1]
    output_index = _token_index([r.output_token_ids for r in rows], device)
    # counts[r, t]: how often token t is in row r's output. index_put_ rather than bincount, which must read
    # the max id back to the host.
    counts = torch.zeros_like(logits).index_put_(
        output_index, torch.ones(output_index[0].numel(), device=device), accumulate=True
    )
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = counts > 0
        # Rows without a repetition penalty have a factor of 1: skip their prompts, which are no-ops.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen[_token_index(prompts, device)] = True
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    return logits - frequency * counts - presence * (counts > 0).float()


def sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    """Samples the random (temperature > 0) rows. logits: [num_rows, vocab] float32, overwritten; `generator`
    on the logits' device, re-seeded with each row's seed. Returns the token ids: [num_rows] long."""
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32, device=device)
    logits.div_(temperature.unsqueeze(1))
    min_p = [row.params.min_p for row in rows]
    if any(p > 0 for p in min_p):
        apply_min_p(logits, min_p)
    top_k = [row.params.top_k for row in rows]
    top_p = [row.params.top_p for row in rows]
    vocab_size = logits.shape[1]
    if any(0 < k < vocab_size for k in top_k) or any(p < 1 for p in top_p):
        apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i. Each row's noise
    # comes from its own seed, so its samples do not depend on the rest of the batch.
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        assert row.seed is not None, "a random (temperature > 0) row needs a seed"
        noise[i].exponential_(generator=generator.manual_seed(row.seed))
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax takes as the maximum.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(noise).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> None:
    """Masks tokens whose probability is below min_p times the row's largest. logits: [num_rows, vocab]."""
    probs = logits.softmax(dim=-1)
    min_p_t = torch.tensor(min_p, dtype=torch.float32, device=logits.device).unsqueeze(1)
    logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p_t, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Masks, per row, all but the top_k logits (ties with the k-th stay, as in vLLM), then all but the
    smallest set of the rest whose probability sums to at least top_p. top_k 0 and top_p 1 disable."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    k = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k], device=device)
    kth_logit = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_logit, -math.inf)
    # top_p 1 becomes inf: rounding could push the cumulative sum to 1 before the tail and drop it.
    p = torch.tensor([p if p < 1 else math.inf for p in top_p], dtype=torch.float32, device=device)
    probs = sorted_logits.softmax(dim=-1)
    # A token stays while the mass strictly before it is below top_p; the top token always stays (mass 0).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before >= p.unsqueeze(1), -math.inf)
    logits.scatter_(1, sorted_ids, sorted_logits)


def gather_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: torch.Tensor
) -> dict[int, PositionLogprobs]:
    """Logprobs of the sampled token and the top-N, from the raw logits, for the rows that asked.
    Returns row index -> logprobs. A rank is 1 + the number of tokens with a strictly greater logprob."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted, device=logits.device)
    logprobs = logits[index].to(torch.float32).log_softmax(dim=-1)  # [num_wanted, vocab]
    chosen = sampled[index].unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    chosen_ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    max_n = min(max(rows[i].params.logprobs or 0 for i in wanted), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1)  # sorted, largest first
    chosen_list = chosen.squeeze(1).tolist()
    chosen_logprob_list = chosen_logprobs.squeeze(1).tolist()
    chosen_rank_list = chosen_ranks.tolist()
    top_logprob_list = top_logprobs.tolist()
    top_id_list = top_ids.tolist()

    result: dict[int, PositionLogprobs] = {}
    for j, i in enumerate(wanted):
        position: PositionLogprobs = {chosen_list[j]: Logprob(chosen_logprob_list[j], chosen_rank_list[j])}
        num_top = rows[i].params.logprobs or 0
        values = top_logprob_list[j][:num_top]
        rank = 0
        for n, (token_id, value) in enumerate(zip(top_id_list[j][:num_top], values, strict=True)):
            # Sorted descending: a tie shares the rank of its first occurrence, as the sampled token's does.
            rank = rank if n and value == values[n - 1] else n + 1
            position.setdefault(token_id, Logprob(value, rank))
        result[i] = position
    return result
