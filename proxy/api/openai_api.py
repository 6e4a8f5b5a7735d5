"""The OpenAI request shapes, validated into our types, and the error envelope.

Both endpoints take OpenAI's parameters plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
repetition_penalty, stop_token_ids, include_stop_str_in_output, skip_special_tokens, and structured output:
response_format, structured_outputs, guided_*, read in proxy/api/structured_outputs.py). Anything malformed
becomes an APIError (HTTP 400 with the field in `param`); a parameter we cannot honour yet is refused
rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.types import SamplingParams, logit_bias_from_json
from proxy.api.chat_messages import ChatMessage, parse_messages
from proxy.api.errors import bad_request
from proxy.api.fields import Endpoint, check_fields
from proxy.api.limits import DEFAULT_LIMITS, MAX_CHOICES, RequestLimits
from proxy.api.tools import NO_TOOLS, ToolUse, parse_tools


@dataclass(frozen=True)
class Generation:
    """What both endpoints share: how to sample and how to answer.

    `params.n` is the number of choices per prompt; `params.logprobs` the top-N logprobs asked for per
    token (None: no logprobs at all). `params.max_tokens` None means up to the model's context."""

    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far in every chunk


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # one or more; choices come prompt-major: index = prompt * n + sample
    generation: Generation
    add_special_tokens: bool = True  # the tokenizer's (a BOS, for models that have one) around text prompts
    echo: bool = False  # each choice's text starts with its prompt's


@dataclass(frozen=True)
class ChatRequest:
    messages: list[ChatMessage]
    add_generation_prompt: bool
    generation: Generation
    tools: ToolUse = NO_TOOLS
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, to the template as is
    add_special_tokens: bool = False  # the template writes the special tokens itself


# ---- field readers: each raises a 400 naming the field ----

def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def typed_field(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    """body[key] if it is one of `kinds` (null: `default`), else a 400 naming the key."""
    value = body.get(key)
    if value is None:
        return default
    # bool is an int subclass: true is no integer, and 1 is no boolean
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad_request(f"'{key}' must be {_kind_names(kinds)}, got {value!r}"[:300], key)
    return value


def _number(body: dict[str, Any], key: str, default: float) -> float:
    try:
        value = float(typed_field(body, key, (int, float), default))
    except OverflowError:  # an integer of hundreds of digits: no float holds it
        value = math.inf
    if not math.isfinite(value):  # Python's json reads NaN and Infinity
        raise bad_request(f"'{key}' must be a finite number", key)
    return value


def integer_bounds(bits: int = 32) -> tuple[int, int]:
    """The integers a request field may hold (both ends included): those of the wire's signed `bits`-bit field,
    less MAX_CHOICES at the top so that a seed + the sample's index still fits."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - MAX_CHOICES - 1


def _integer(body: dict[str, Any], key: str, default: int | None, bits: int = 32) -> int | None:
    """An integer that fits the wire's signed `bits`-bit field."""
    value = body.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some clients send 16.0
    else:
        value = typed_field(body, key, (int,), default)
    lowest, highest = integer_bounds(bits)
    if value is not None and not lowest <= value <= highest:
        raise bad_request(f"'{key}' is out of range", key)
    result: int | None = value
    return result


def flag_field(body: dict[str, Any], key: str, default: bool) -> bool:
    return bool(typed_field(body, key, (bool,), default))


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    return stop


def _whole_number(value: Any) -> bool:
    """An integer as JSON Schema has it: 7 and 7.0, not true."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _token_ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(_whole_number(t) for t in value):
        raise bad_request(f"'{key}' must be a list of integers", key)
    token_ids = [int(t) for t in value]
    if any(not 0 <= t < 2**31 for t in token_ids):
        raise bad_request(f"'{key}' must hold token ids (non-negative integers)", key)
    return token_ids


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """OpenAI's token id (a decimal string) -> bias in [-100, 100]; ids beyond the vocabulary are the nodes' 400."""
    try:
        bias = logit_bias_from_json(body.get("logit_bias"))
    except ValueError as e:
        raise bad_request(str(e)[:300], "logit_bias") from None
    for token_id, value in (bias or {}).items():
        if token_id >= 2**31:  # the wire's int32: such an id is in no vocabulary
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"logit_bias of token {token_id} must be a number, got {value!r}"[:300], "logit_bias")
    return bias or None


def _limited_max_tokens(max_tokens: int | None, default: int | None, limits: RequestLimits, param: str
                        ) -> int | None:
    """max_tokens as asked (else `default`), within the server's --max-tokens-limit: a request that asks for more
    is refused, one that asks for nothing gets at most the limit."""
    limit = limits.max_tokens
    if max_tokens is None:
        return limit if default is None else default if limit is None else min(default, limit)
    if limit is not None and max_tokens > limit:
        raise bad_request(f"'{param}' must be at most {limit} (this server's limit), got {max_tokens}", param)
    return max_tokens


def _generation(body: dict[str, Any], max_tokens: int | None, num_top_logprobs: int | None,
                limits: RequestLimits) -> Generation:
    model = typed_field(body, "model", (str,), "")
    n = _integer(body, "n", 1)
    assert n is not None
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"'n' must be in [1, {limits.max_n}] (this server's limit), got {n}", "n")
    best_of = _integer(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than n is not supported", "best_of", "unsupported_parameter")
    if num_top_logprobs is not None and not 0 <= num_top_logprobs <= limits.max_logprobs:
        raise bad_request(f"the number of top logprobs must be in [0, {limits.max_logprobs}] (this server's "
                          f"limit), got {num_top_logprobs}", "top_logprobs" if "top_logprobs" in body else "logprobs")
    prompt_logprobs = _integer(body, "prompt_logprobs", None)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= limits.max_logprobs:
        raise bad_request(f"'prompt_logprobs' must be in [0, {limits.max_logprobs}] (this server's limit), got "
                          f"{prompt_logprobs}", "prompt_logprobs")
    # response_format and vLLM's structured_outputs / guided_*; imported here: that module raises our APIError
    from proxy.api.structured_outputs import parse_structured_outputs

    structured_outputs = parse_structured_outputs(body)
    stop_token_ids = body.get("stop_token_ids")
    try:
        params = SamplingParams(
            n=n, temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=_integer(body, "top_k", 0) or 0, min_p=_number(body, "min_p", 0.0),
            seed=_integer(body, "seed", None, bits=64), max_tokens=max_tokens,
            min_tokens=_integer(body, "min_tokens", 0) or 0,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            stop=_stop(body),
            stop_token_ids=None if stop_token_ids is None else _token_ids(stop_token_ids, "stop_token_ids"),
            include_stop_str_in_output=flag_field(body, "include_stop_str_in_output", False),
            ignore_eos=flag_field(body, "ignore_eos", False), logprobs=num_top_logprobs,
            skip_special_tokens=flag_field(body, "skip_special_tokens", True), structured_outputs=structured_outputs,
            logit_bias=_logit_bias(body), prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), field) from e
    stream = flag_field(body, "stream", False)
    stream_options = typed_field(body, "stream_options", (dict,), None)
    if stream_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    options = stream_options or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"stream_options.{str(unknown[0])[:40]} is not supported; the options are include_usage "
                          "and continuous_usage_stats", "stream_options", "unsupported_parameter")
    include_usage = bool(typed_field(options, "include_usage", (bool,), False))
    continuous_usage = bool(typed_field(options, "continuous_usage_stats", (bool,), False))
    return Generation(model, params, stream, include_usage, continuous_usage)


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


# ---- the two endpoints ----

def parse_completion(raw: Any, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    body = _body(raw)
    check_fields(body, Endpoint.COMPLETIONS)
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = [_token_ids(prompt, "prompt")]
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if any(not p for p in prompts):
        raise bad_request("'prompt' must not be empty", "prompt")
    echo = flag_field(body, "echo", False)
    max_tokens = _limited_max_tokens(_integer(body, "max_tokens", None), 16, limits, "max_tokens")
    generation = _generation(body, max_tokens, _integer(body, "logprobs", None), limits)
    params = generation.params
    if echo and params.logprobs is not None:  # the echoed prompt's tokens get logprobs too: the prefill computes them
        wanted = max(params.logprobs, params.prompt_logprobs or 0)
        generation = dataclasses.replace(generation, params=dataclasses.replace(params, prompt_logprobs=wanted))
    if len(prompts) * generation.params.n > limits.max_n:
        raise bad_request(f"prompts x n must be at most {limits.max_n} (this server's limit)", "n")
    return CompletionRequest(prompts, generation, flag_field(body, "add_special_tokens", True), echo)


# apply_chat_template's own arguments: chat_template_kwargs may not set them (each has its request field)
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask"})


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = typed_field(body, "chat_template_kwargs", (dict,), {})
    clashing = sorted(k for k in kwargs if k in _TEMPLATE_ARGUMENTS or not isinstance(k, str))
    if clashing:
        raise bad_request(f"chat_template_kwargs may not set {str(clashing[0])[:40]!r}: it has its own field or "
                          "is the server's", "chat_template_kwargs")
    return dict(kwargs)


def parse_chat(raw: Any, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    body = _body(raw)
    check_fields(body, Endpoint.CHAT)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body)
    # both are checked, the newer name wins
    max_tokens = _integer(body, "max_tokens", None)
    max_completion_tokens = _integer(body, "max_completion_tokens", None)
    param = "max_tokens"
    if max_completion_tokens is not None:
        max_tokens, param = max_completion_tokens, "max_completion_tokens"
    max_tokens = _limited_max_tokens(max_tokens, None, limits, param)
    num_top_logprobs = _integer(body, "top_logprobs", None)
    if flag_field(body, "logprobs", False):
        num_top_logprobs = num_top_logprobs or 0
    elif num_top_logprobs is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    generation = _generation(body, max_tokens, num_top_logprobs, limits)
    continue_final = flag_field(body, "continue_final_message", False)
    add_generation_prompt = flag_field(body, "add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    return ChatRequest(messages, add_generation_prompt, generation, tools, continue_final, _template_kwargs(body),
                       flag_field(body, "add_special_tokens", False))
