"""Speculative decoding: n-gram (prompt lookup) drafts, verified by the target model in one step.

- `config.py`: `SpeculativeConfig`, vLLM's `speculative_config` (torch-free: nodes and `tandem serve` validate it).
- `ngram.py`: the proposer (numpy): the tokens that followed the latest earlier occurrence of the context's tail.
- `verify.py`: which drafts a verification step keeps, and the counters vLLM's metrics name.

How a step runs with drafts (engine/scheduler.py, engine/runner.py): a running request whose next step would
compute one token (its last sampled one) is scheduled with k drafts appended instead, a query of k + 1 tokens
over its cached context, which the paged prefill path attends like a chunk of a prompt (never the decode CUDA
graphs: those take one query token per sequence). The step samples a token at each of the k + 1 positions, as
if the drafts before it had been generated; the longest prefix of drafts that the samples reproduce is kept,
plus the sample that follows it, and `num_computed_tokens` goes back over the rejected drafts (their K/V is
overwritten by later steps).
"""

from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
