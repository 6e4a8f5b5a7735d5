"""The offline API (contract): `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.types import CompletionOutput, RequestOutput, SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str, dtype: str = "auto", max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128, block_size: int = 16, enable_prefix_caching: bool = True,
                 num_kv_blocks: int | None = None, load_format: str = "auto", seed: int = 0,
                 **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(
            model=str(model), dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            num_kv_blocks=num_kv_blocks, load_format=load_format, seed=seed, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion. Prompts are strings or token-id lists; outputs keep their order.

        Every prompt is validated before any runs, so a bad one fails the call without partial work."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))

        engine = self.engine
        groups: list[tuple[RequestOutput, list[Request]]] = []
        pending = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            parent = str(next(self._ids))
            children = [engine.make_request(f"{parent}-{i}", prompt, params.for_sample(i))
                        for i in range(params.n)]
            out = RequestOutput(parent, prompt if isinstance(prompt, str) else None,
                                children[0].prompt_token_ids)
            groups.append((out, children))
            pending.extend(children)
        for request in pending:
            engine.submit(request)

        while engine.has_unfinished():
            engine.step()

        for out, children in groups:
            out.outputs = [self._collect(child.request_id, index) for index, child in enumerate(children)]
            out.num_cached_tokens = children[0].num_prompt_cached_tokens
            for child in children:
                engine.release(child.request_id)
        return [out for out, _ in groups]

    def _collect(self, request_id: str, index: int) -> CompletionOutput:
        output = self.engine.output(request_id)
        output.index = index
        return output

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                           num_prompts: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return list(params)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a token-id list) or many."""
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
