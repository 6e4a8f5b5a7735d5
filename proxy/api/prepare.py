"""A request's preparation, on a tokenizer thread (its time grows with the body): decode the JSON, parse it into
our types, check the model, render the chat template, tokenize, check the context length.

A chat's tools and reasoning decide two more things here: the constraint the nodes hold the output to
(proxy/api/tools.py) and how each choice's text is parsed on the way back (proxy/api/choice_parser.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from proxy.api.chat_template import render_chat
from proxy.api.choice_parser import ChoiceParser, choice_parsers
from proxy.api.errors import APIError, bad_request
from proxy.api.openai_api import ChatRequest, CompletionRequest, Generation, parse_chat, parse_completion
from proxy.api.request_body import decode_json
from proxy.api.responses import EchoedPrompt
from proxy.api.serving import ProxyState
from proxy.api.tools import ToolChoice, tool_constraint


@dataclass(frozen=True)
class PreparedChat:
    request: ChatRequest
    generation: Generation  # the request's, with the tools' constraint
    prompt_text: str
    prompt_ids: list[int]
    parsing: Callable[[], ChoiceParser] | None  # each choice's text parser; None: plain content


def prepare_completion(state: ProxyState, body: bytes) -> tuple[CompletionRequest, list[list[int]]]:
    parsed = parse_completion(decode_json(body), state.limits)
    check_model(state, parsed.generation.model)
    return parsed, [prompt_ids(state, p, parsed.add_special_tokens) for p in parsed.prompts]


def prepare_chat(state: ProxyState, body: bytes) -> PreparedChat:
    return prepare_parsed_chat(state, parse_chat(decode_json(body), state.limits))


def prepare_parsed_chat(state: ProxyState, parsed: ChatRequest) -> PreparedChat:
    """A parsed chat (from /v1/chat/completions, or /v1/responses' input) made ready to generate."""
    check_model(state, parsed.generation.model)
    use = parsed.tools
    chat = state.chat
    if use.choice is ToolChoice.AUTO and not chat.enable_auto_tool_choice:
        raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                          '--tool-call-parser; send tool_choice "required", "none" or a named function',
                          "tool_choice")
    params = parsed.generation.params
    constraint = tool_constraint(use, chat, params.structured_outputs)
    generation = dataclasses.replace(parsed.generation,
                                     params=dataclasses.replace(params, structured_outputs=constraint))
    text = render_chat(state.tokenizer, [m.as_template_input() for m in parsed.messages],
                       [t.as_template_input() for t in use.tools] or None, parsed.add_generation_prompt,
                       parsed.continue_final_message, parsed.template_kwargs)
    ids = list(state.tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens))
    return PreparedChat(parsed, generation, text, ids,
                        choice_parsers(use, chat, text))


def echoed_prompts(state: ProxyState, prompts: list[str | list[int]], token_ids: list[list[int]]
                   ) -> list[EchoedPrompt]:
    """What `echo` puts before each prompt's completions: its text as sent (token ids decoded), its tokens."""
    return [EchoedPrompt(prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt), ids,
                         state.tokenizer.decode(ids[:1]))
            for prompt, ids in zip(prompts, token_ids, strict=True)]


def check_model(state: ProxyState, model: str) -> None:
    if model and model != state.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def prompt_ids(state: ProxyState, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, str):
        return list(state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return prompt


def check_length(max_model_len: int | None, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
    if max_model_len is None:
        return
    for prompt in prompts:
        wanted = len(prompt) + (max_tokens or 1)
        if wanted > max_model_len:
            completion = f"{max_tokens} in the completion" if max_tokens else "at least 1 to generate"
            # OpenAI's status, code and message (vLLM's too): a 400, not a 413
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {wanted} tokens ({len(prompt)} in the {param}, {completion}). Please "
                              f"reduce the length of the {param} or completion.", param, "context_length_exceeded")

