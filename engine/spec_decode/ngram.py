"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the context's tail.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of prompt + output are searched for
earlier in the same tokens; the first n that occurs wins (a longer match predicts better), and its latest
occurrence (the nearest text is the likeliest to be repeated now) gives up to k drafts: the tokens after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """At most min(k, max_drafts) drafts to follow `token_ids`; [] when no tail of n tokens recurs."""
        limit = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens <= self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # where an earlier n-gram can end: at an earlier copy of the last token, followed by at least one token.
        # Few positions hold it, so each n checks those candidates only (one pass over the tokens in all).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            candidates = ends[ends >= n - 1]
            for back in range(1, n):
                candidates = candidates[tokens[candidates - back] == tokens[-1 - back]]
            if candidates.size:
                follow = int(candidates[-1]) + 1  # the latest occurrence
                return tokens[follow:follow + limit].tolist()
        return []
