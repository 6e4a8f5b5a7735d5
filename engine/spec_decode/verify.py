"""Which drafts a verification step keeps, and the counters behind vLLM's spec-decode metrics.

The step samples a token at each of its k + 1 positions, position i as though drafts 0..i-1 had been generated
(the same processed logits, the same seeded noise as the non-speculative step that would sample that token:
engine/runner.py). Draft i is kept while every draft before it was kept and the sample at position i equals it;
the sample after the last kept draft is kept too (it corrects the first rejected draft, or is the bonus token
when all k are kept).

Why this is the rejection-sampling rule for a one-hot draft distribution q (n-gram drafts are deterministic):
the rule accepts draft d with probability min(1, p(d) / q(d)) = p(d) and, on rejection, samples from
normalize(max(p - q, 0)), which is p with d removed and renormalised. Here the sample at the position is drawn
from p, so it equals d with probability p(d) (accept), and otherwise it is a draw from p conditioned on not
being d: exactly the residual. Greedy rows are the special case of a one-hot p. The output distribution is thus
the target model's, and a seeded request even samples the same tokens as without speculation, since each
position's noise depends on the request's seed and the token's index only (engine/sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def num_accepted_drafts(draft_token_ids: Sequence[int], sampled_token_ids: Sequence[int]) -> int:
    """The length of the longest prefix of drafts that the samples reproduce.

    sampled_token_ids[i] is the token sampled at draft i's position (one more sample follows the last draft)."""
    assert len(sampled_token_ids) == len(draft_token_ids) + 1, (
        f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} samples, got {len(sampled_token_ids)}")
    num = 0
    while num < len(draft_token_ids) and sampled_token_ids[num] == draft_token_ids[num]:
        num += 1
    return num


@dataclass
class SpecDecodeStats:
    """Counters since the engine started, as vLLM names them (tandem:spec_decode_num_*_total)."""

    num_drafts: int = 0  # verification steps of one request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
