"""The offline API (contract): `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.types import CompletionOutput, FinishReason, PositionLogprobs, RequestOutput, SamplingParams, StepOutput

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
        texts: dict[str, _Text] = {}
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
            texts[request.request_id] = _Text(engine.tokenizer, request)

        while engine.has_unfinished():
            for step in engine.step():
                text = texts[step.request_id]
                if text.add(step) and not step.finished:
                    engine.abort(step.request_id)  # a stop string: the text ended before the tokens did

        for out, children in groups:
            out.outputs = [texts[child.request_id].output(index) for index, child in enumerate(children)]
            out.num_cached_tokens = children[0].num_prompt_cached_tokens
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


class _Text:
    """PROVISIONAL: one request's output while the shared output processor is being written."""

    def __init__(self, tokenizer: Any, request: Request) -> None:
        self.params = request.params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.params) \
            if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.tokenizer = tokenizer

    def add(self, step: StepOutput) -> bool:
        self.token_ids.append(step.token_id)
        if step.logprobs is not None and self.logprobs is not None:
            lps = step.logprobs
            if self.tokenizer is not None:
                lps = {t: replace(lp, decoded_token=decode_token(self.tokenizer, t)) for t, lp in lps.items()}
            self.logprobs.append(lps)
            self.cumulative_logprob += lps[step.token_id].logprob
        stop_token = step.finish_reason is FinishReason.STOP
        if self.detok is not None and (not stop_token or self.params.include_stop_str_in_output):
            self.detok.push(step.token_id)
        self.finish_reason, self.stop_reason = step.finish_reason, step.stop_reason
        if self.detok is not None and not stop_token and (stop := self.detok.check_stop()) is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop
        if self.finish_reason is not None and self.detok is not None:
            self.detok.flush()
        return self.finish_reason is not None

    def output(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, self.detok.text if self.detok is not None else "", self.token_ids,
                                self.finish_reason, self.stop_reason, self.logprobs,
                                self.cumulative_logprob if self.logprobs is not None else None)
