"""Every request field of /v1/completions and /v1/chat/completions — OpenAI's, and vLLM's extras — with what Tandem
does with it. One table, three readers: the parsers refuse what it refuses (a 400 that names the field), the
OpenAPI document lists exactly its fields, and the README's table is rendered from it (a test keeps them equal).

- HONOURED: the field does what OpenAI or vLLM documents.
- ACCEPTED: the field asks nothing of the output (the caller's bookkeeping: `user`, `metadata`), so it is taken
  and has no effect.
- REFUSED: only its neutral values are taken (absent, null, and those listed, e.g. `store: false`); anything
  else is a 400 `unsupported_parameter` naming the field.
A field in no row is a 400 `unknown_parameter`, as OpenAI answers: a misspelt parameter never passes silently.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from proxy.api.errors import bad_request


class Support(enum.Enum):
    HONOURED = "honoured"
    ACCEPTED = "accepted, no effect"
    REFUSED = "refused (400)"


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


BOTH = (Endpoint.COMPLETIONS, Endpoint.CHAT)
COMPLETIONS = (Endpoint.COMPLETIONS,)
CHAT = (Endpoint.CHAT,)


@dataclass(frozen=True)
class Field:
    name: str
    endpoints: tuple[Endpoint, ...]
    support: Support
    origin: str  # "OpenAI" or "vLLM"
    note: str
    neutral: tuple[Any, ...] = ()  # a REFUSED field's values that ask for nothing (null is always one)


def _h(name: str, endpoints: tuple[Endpoint, ...], note: str, origin: str = "OpenAI") -> Field:
    return Field(name, endpoints, Support.HONOURED, origin, note)


def _a(name: str, endpoints: tuple[Endpoint, ...], note: str, origin: str = "OpenAI") -> Field:
    return Field(name, endpoints, Support.ACCEPTED, origin, note)


def _r(name: str, endpoints: tuple[Endpoint, ...], note: str, neutral: tuple[Any, ...] = (),
       origin: str = "OpenAI") -> Field:
    return Field(name, endpoints, Support.REFUSED, origin, note, neutral)


FIELDS: tuple[Field, ...] = (
    # ---- OpenAI: both endpoints ----
    _h("model", BOTH, "the served model; absent or empty means it, any other name is a 404"),
    _h("n", BOTH, "choices per prompt, each seeded seed + i"),
    _h("best_of", BOTH, "equal to n only (no beam search)"),
    _h("temperature", BOTH, "0 samples greedily"),
    _h("top_p", BOTH, ""),
    _h("seed", BOTH, "the same tokens offline, colocated and disaggregated"),
    _h("presence_penalty", BOTH, ""),
    _h("frequency_penalty", BOTH, ""),
    _h("logit_bias", BOTH, "token id -> bias in [-100, 100], added before sampling; logprobs stay the model's"),
    _h("stop", BOTH, "stop strings"),
    _h("stream", BOTH, "server-sent events"),
    _h("stream_options", BOTH, "include_usage; continuous_usage_stats (usage in every chunk)"),
    _h("max_tokens", BOTH, ""),
    _h("logprobs", BOTH, "completions: top-N per token (legacy shape); chat: true/false with top_logprobs"),
    _h("response_format", BOTH, "text, json_object, json_schema (strict), enforced by the nodes; with tools "
                                "see the README"),
    _a("user", BOTH, "an end-user id for the caller's records"),
    # ---- OpenAI: completions ----
    _h("prompt", COMPLETIONS, "text, token ids, or a list of either"),
    _h("echo", COMPLETIONS, "the prompt before the completion, with its logprobs when logprobs is set"),
    _r("suffix", COMPLETIONS, "no fill-in-the-middle", ("",)),
    # ---- OpenAI: chat ----
    _h("messages", CHAT, "system, developer, user, assistant (with tool_calls), tool; text parts only"),
    _h("max_completion_tokens", CHAT, "wins over max_tokens; counts reasoning too"),
    _h("top_logprobs", CHAT, "needs logprobs: true"),
    _h("tools", CHAT, "function tools, rendered through the chat template (README: fallback)"),
    _h("tool_choice", CHAT, "none, auto (--enable-auto-tool-choice), required, a named function"),
    _h("parallel_tool_calls", CHAT, "false: at most one call"),
    _a("metadata", CHAT, "the caller's key-value tags"),
    _a("safety_identifier", CHAT, "an end-user id for the caller's records"),
    _a("prompt_cache_key", CHAT, "prefix caching is automatic (and prefix-aware routing)"),
    _a("service_tier", CHAT, "one tier"),
    _r("store", CHAT, "nothing is stored (stateless)", (False,)),
    _r("functions", CHAT, "deprecated by OpenAI: send tools", ([],)),
    _r("function_call", CHAT, "deprecated by OpenAI: send tool_choice"),
    _r("audio", CHAT, "text models only"),
    _r("modalities", CHAT, "text models only", (["text"],)),
    _r("prediction", CHAT, "predicted outputs are not used"),
    _r("reasoning_effort", CHAT, "no served template reads it: send chat_template_kwargs"),
    _r("verbosity", CHAT, "no served template reads it"),
    _r("web_search_options", CHAT, "no built-in tools"),
    _r("moderation", CHAT, "no moderation"),
    _r("prompt_cache_retention", CHAT, "the KV cache's own eviction decides"),
    _r("prompt_cache_options", CHAT, "the KV cache's own eviction decides"),
    # ---- vLLM's extras: both endpoints ----
    _h("top_k", BOTH, "-1 or 0: off", "vLLM"),
    _h("min_p", BOTH, "", "vLLM"),
    _h("min_tokens", BOTH, "", "vLLM"),
    _h("repetition_penalty", BOTH, "", "vLLM"),
    _h("stop_token_ids", BOTH, "", "vLLM"),
    _h("include_stop_str_in_output", BOTH, "", "vLLM"),
    _h("ignore_eos", BOTH, "", "vLLM"),
    _h("skip_special_tokens", BOTH, "", "vLLM"),
    _h("prompt_logprobs", BOTH, "computed where the prompt is prefilled (the prefill node in P/D)", "vLLM"),
    _h("add_special_tokens", BOTH, "completions default true, chat false (the template writes them)", "vLLM"),
    _h("structured_outputs", BOTH, "json, regex, choice, grammar, json_object, structural_tag", "vLLM"),
    _h("guided_json", BOTH, "older name of structured_outputs.json", "vLLM"),
    _h("guided_regex", BOTH, "older name of structured_outputs.regex", "vLLM"),
    _h("guided_choice", BOTH, "older name of structured_outputs.choice", "vLLM"),
    _h("guided_grammar", BOTH, "older name of structured_outputs.grammar", "vLLM"),
    _h("guided_decoding_backend", BOTH, "xgrammar or auto", "vLLM"),
    _a("request_id", BOTH, "responses carry the proxy's own id", "vLLM"),
    _r("guided_whitespace_pattern", BOTH, "use structured_outputs.disable_any_whitespace", origin="vLLM"),
    _r("use_beam_search", BOTH, "no beam search", (False,), "vLLM"),
    _r("length_penalty", BOTH, "no beam search", (1, 1.0), "vLLM"),
    _r("allowed_token_ids", BOTH, "use logit_bias or structured_outputs", ([],), "vLLM"),
    _r("bad_words", BOTH, "use logit_bias", ([],), "vLLM"),
    _r("truncate_prompt_tokens", BOTH, "prompts are never cut: too long is a 400", origin="vLLM"),
    _r("priority", BOTH, "first come, first served", (0,), "vLLM"),
    _r("spaces_between_special_tokens", BOTH, "always true", (True,), "vLLM"),
    _r("return_tokens_as_token_ids", BOTH, "tokens are returned as text", (False,), "vLLM"),
    _r("return_token_ids", BOTH, "tokens are returned as text (see /tokenize)", (False,), "vLLM"),
    _r("logits_processors", BOTH, "no custom logits processors", ([],), "vLLM"),
    _r("cache_salt", BOTH, "one prefix cache for all", ("",), "vLLM"),
    _r("kv_transfer_params", BOTH, "the P/D handoff is Tandem's own", origin="vLLM"),
    _r("vllm_xargs", BOTH, "no extra arguments", origin="vLLM"),
    # ---- vLLM's extras: chat ----
    _h("add_generation_prompt", CHAT, "", "vLLM"),
    _h("continue_final_message", CHAT, "", "vLLM"),
    _h("chat_template_kwargs", CHAT, "to the template, e.g. {\"enable_thinking\": false}", "vLLM"),
    _r("echo", CHAT, "use continue_final_message", (False,), "vLLM"),
    _r("chat_template", CHAT, "the served template only (vLLM's --trust-request-chat-template)", origin="vLLM"),
    _r("documents", CHAT, "RAG documents are not rendered", ([],), "vLLM"),
    _r("mm_processor_kwargs", CHAT, "text models only", origin="vLLM"),
    _r("media_io_kwargs", CHAT, "text models only", origin="vLLM"),
)


def fields_of(endpoint: Endpoint) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


def check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """A 400 for a field this endpoint does not know, or a refused one given a value that asks for something."""
    known = fields_of(endpoint)
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            raise bad_request(f"Unrecognized request argument supplied: {str(name)[:64]}", str(name)[:64],
                              "unknown_parameter")
        if field.support is Support.REFUSED and value is not None and not _neutral(value, field.neutral):
            raise bad_request(f"'{name}' is not supported: {field.note}", name, "unsupported_parameter")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int: True is no priority 1, and 0 is no `false`
    return any(type(value) is type(n) and value == n for n in neutral) or (
        isinstance(value, float) and any(type(n) is int and value == n for n in neutral))


def markdown_table() -> str:
    """The README's table: one row per field, both endpoints' columns."""
    rows = ["| field | from | completions | chat | notes |", "|---|---|---|---|---|"]
    seen: dict[str, list[Field]] = {}
    for field in FIELDS:
        seen.setdefault(field.name, []).append(field)
    for name, entries in seen.items():
        cells = {e: "—" for e in Endpoint}
        notes = []
        for entry in entries:
            for endpoint in entry.endpoints:
                cells[endpoint] = entry.support.value
            if entry.note:
                notes.append(entry.note)
        rows.append(f"| `{name}` | {entries[0].origin} | {cells[Endpoint.COMPLETIONS]} | {cells[Endpoint.CHAT]} | "
                    f"{'; '.join(notes)} |")
    return "\n".join(rows)
