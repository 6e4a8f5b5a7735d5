"""/tokenize and /detokenize, in vLLM's shapes: what the served tokenizer makes of a prompt or a chat, and of token ids.

- POST /tokenize {"prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false} or {"messages": [...],
  "add_generation_prompt"?, "continue_final_message"?, "tools"?, "chat_template_kwargs"?, "add_special_tokens"?:
  false, "return_token_strs"?} → {"count", "max_model_len", "tokens", "token_strs"}. A chat is rendered exactly as
  /v1/chat/completions renders it (proxy/api/prepare.py: the same parser, template and tools), so the count is the
  prompt's usage.prompt_tokens; add_special_tokens adds the tokenizer's own (e.g. a BOS) on top of the template's.
- POST /detokenize {"tokens": [ids]} → {"prompt": text}, special tokens kept (as vLLM's).

`model` is optional (404 for another than the served one); any other field is refused by name (400). Both run on a
tokenizer thread (ProxyState.off_loop): their time grows with the body.
"""

from __future__ import annotations

from typing import Any

from proxy.api.errors import bad_request
from proxy.api.openai_api import flag_field, parse_chat, typed_field
from proxy.api.prepare import check_model, prepare_parsed_chat
from proxy.api.request_body import decode_json
from proxy.api.serving import ProxyState

_PROMPT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
# what /v1/chat/completions reads of these, it reads here too (chat_template: refused there, with its reason)
_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template",
                "chat_template_kwargs")
_CHAT_ONLY_FIELDS = (*_CHAT_FIELDS, "add_special_tokens", "return_token_strs")
_DETOKENIZE_FIELDS = ("model", "tokens")


def tokenize(state: ProxyState, body: bytes) -> dict[str, Any]:
    """The /tokenize answer to `body`; APIError (400 naming the field, 404 for another model) for bad input."""
    request = _object(decode_json(body))
    chat = request.get("messages") is not None
    if chat and request.get("prompt") is not None:
        raise bad_request("send either 'prompt' or 'messages', not both", "prompt")
    _refuse_unknown(request, _CHAT_ONLY_FIELDS if chat else _PROMPT_FIELDS, "messages" if chat else "prompt")
    # vLLM's defaults: the template writes a chat's special tokens, a plain prompt gets the tokenizer's
    add_special_tokens = flag_field(request, "add_special_tokens", not chat)
    if chat:
        token_ids = _chat_token_ids(state, request, add_special_tokens)
    else:
        check_model(state, typed_field(request, "model", (str,), ""))
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' (a chat) is required", "prompt")
        token_ids = list(state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    token_strs = list(state.tokenizer.convert_ids_to_tokens(token_ids)) if flag_field(
        request, "return_token_strs", False) else None
    return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}


def detokenize(state: ProxyState, body: bytes) -> dict[str, Any]:
    """The /detokenize answer to `body`: the text of its token ids, each within the vocabulary (else 400)."""
    request = _object(decode_json(body))
    _refuse_unknown(request, _DETOKENIZE_FIELDS, "tokens")
    check_model(state, typed_field(request, "model", (str,), ""))
    tokens = request.get("tokens")
    vocab = len(state.tokenizer)
    # 7.0 is an integer as JSON Schema has it; true is not
    if not isinstance(tokens, list) or not all(
            (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, float) and t.is_integer())
            for t in tokens):
        raise bad_request("'tokens' must be a list of token ids (integers)", "tokens")
    token_ids = [int(t) for t in tokens]
    outside = next((t for t in token_ids if not 0 <= t < vocab), None)
    if outside is not None:
        raise bad_request(f"'tokens' must hold token ids in [0, {vocab}), got {outside}"[:200], "tokens")
    return {"prompt": state.tokenizer.decode(token_ids)}


def _chat_token_ids(state: ProxyState, request: dict[str, Any], add_special_tokens: bool) -> list[int]:
    # tool_choice "none": the tools are rendered as a chat's would be, and no constraint or parser is made for them
    chat = {key: request[key] for key in _CHAT_FIELDS if key in request}
    prepared = prepare_parsed_chat(state, parse_chat({**chat, "tool_choice": "none"}, state.limits))
    if not add_special_tokens:
        return prepared.prompt_ids
    return list(state.tokenizer.encode(prepared.prompt_text, add_special_tokens=True))


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return value


def _refuse_unknown(request: dict[str, Any], fields: tuple[str, ...], form: str) -> None:
    unknown = sorted(str(key) for key in request if key not in fields)
    if unknown:
        raise bad_request(f"'{unknown[0][:64]}' is not a field of a {form} request; its fields are "
                          f"{', '.join(fields)}", unknown[0][:64], "unsupported_parameter")
