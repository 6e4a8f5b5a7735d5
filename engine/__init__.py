"""Tandem's engine: a paged-KV LLM engine shared by prefill and decode nodes.

The offline API mirrors vLLM: `from engine import LLM, SamplingParams`.
"""

from engine.types import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "FinishReason",
           "Logprob"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch; keep `import engine` light for torch-free users of engine.types/engine.hashing.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
