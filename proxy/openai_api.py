"""The OpenAI request and response shapes: validation into our types, and the error envelope."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.types import SamplingParams


class APIError(Exception):
    """An OpenAI-style error: HTTP status + {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_stop_str_in_output: bool


def _typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}", key)
    if not isinstance(value, kinds):
        raise bad_request(f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}", key)
    return value


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = _typed(body, "model", (str,), "")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    if isinstance(prompt, str) and not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    n = _typed(body, "n", (int,), 1)
    if n != 1:
        raise bad_request("only n=1 is supported on this endpoint for now", "n")
    seed = _typed(body, "seed", (int,), None)
    try:
        params = SamplingParams(
            temperature=float(_typed(body, "temperature", (int, float), 1.0)),
            top_p=float(_typed(body, "top_p", (int, float), 1.0)),
            top_k=_typed(body, "top_k", (int,), 0), min_p=float(_typed(body, "min_p", (int, float), 0.0)),
            seed=seed, max_tokens=_typed(body, "max_tokens", (int,), 16),
            min_tokens=_typed(body, "min_tokens", (int,), 0),
            presence_penalty=float(_typed(body, "presence_penalty", (int, float), 0.0)),
            frequency_penalty=float(_typed(body, "frequency_penalty", (int, float), 0.0)),
            repetition_penalty=float(_typed(body, "repetition_penalty", (int, float), 1.0)),
            ignore_eos=bool(_typed(body, "ignore_eos", (bool,), False)),
            stop_token_ids=_typed(body, "stop_token_ids", (list,), None))
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), field) from e
    return CompletionRequest(model, prompt, params, list(stop or []), bool(_typed(body, "stream", (bool,), False)),
                             bool(_typed(body, "include_stop_str_in_output", (bool,), False)))


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None,
                     created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
