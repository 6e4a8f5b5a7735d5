"""The offline API (contract): `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputProcessor
from engine.request import Request
from engine.types import PromptLogprobs, RequestOutput, SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        """engine_args are EngineConfig's fields (engine/config.py), with its defaults: dtype,
        max_num_batched_tokens, max_num_seqs, block_size, enable_prefix_caching, num_kv_blocks, seed, device,
        gpu_memory_utilization (0.9: the fraction of the GPU's memory this engine may use), load_format,
        speculative_config (vLLM's: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N}),
        tensor_parallel_size (ranks, each a process holding its slice of the model), ..."""
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}  # decode_token's cache, shared by every request's output

    def close(self) -> None:
        """Stops the worker processes of a tensor_parallel_size > 1 engine (also done at interpreter exit)."""
        self.engine.close()

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
        outputs: dict[str, OutputProcessor] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            parent = str(next(self._ids))
            # the prompt's logprobs are the request's, not a sample's: the first sample computes them, and the
            # others may take prefix-cache hits
            children = [engine.make_request(f"{parent}-{i}", prompt, params.for_sample(i) if i == 0 else
                                            dataclasses.replace(params.for_sample(i), prompt_logprobs=None))
                        for i in range(params.n)]
            out = RequestOutput(parent, prompt if isinstance(prompt, str) else None,
                                children[0].prompt_token_ids)
            groups.append((out, children))
            for child in children:
                outputs[child.request_id] = OutputProcessor(engine.tokenizer, child.prompt_token_ids,
                                                            child.params, self._token_texts)
        for _, children in groups:
            for child in children:
                engine.submit(child)

        prompt_logprobs: dict[str, PromptLogprobs] = {}  # by the id of the sample that computed them
        while engine.has_unfinished():
            for step in engine.step():
                output = outputs[step.request_id]
                if step.prompt_logprobs is not None:
                    prompt_logprobs[step.request_id] = output.with_decoded_prompt_tokens(step.prompt_logprobs)
                if output.finished:
                    continue  # a stop string ended it at an earlier token of this step (accepted drafts)
                delta = output.update(step.token_id, step.logprobs, step.finish_reason, step.stop_reason)
                if delta.finished and not step.finished:  # a stop string: the text ended before the tokens
                    engine.abort(step.request_id)

        for out, children in groups:
            out.outputs = [outputs[child.request_id].completion_output(index) for index, child in enumerate(children)]
            out.num_cached_tokens = children[0].num_prompt_cached_tokens
            out.prompt_logprobs = prompt_logprobs.get(children[0].request_id)
        return [out for out, _ in groups]

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

