"""What the proxy does with a chat's output beyond text (vLLM's flag names): find tool calls for `tool_choice:
"auto"`, and split a reasoning model's thinking from its answer. Declared once, so `tandem serve` and `python -m
proxy` take the same flags, env vars and YAML keys. The parsers' names are those of proxy/api/parsers' registries
(a test holds the two lists equal; settings imports no proxy code)."""

from __future__ import annotations

from dataclasses import dataclass

from settings.spec import ConfigError, setting

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ChatSettings:
    enable_auto_tool_choice: bool = setting(
        False, "serve tool_choice \"auto\" (the model decides whether to call a tool); needs --tool-call-parser")
    tool_call_parser: str | None = setting(
        None, "the format the model writes tool calls in: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.1/3.2 "
              "JSON), mistral, pythonic (Llama 3.2/4)", choices=TOOL_CALL_PARSERS, metavar="NAME")
    unconstrained_auto_tool_calls: bool = setting(
        False, "leave the calls of tool_choice \"auto\" unconstrained, as vLLM does (default: once the model opens a "
               "call, the nodes hold it to one of the request's tools' schemas, so its arguments always validate)")
    reasoning_parser: str | None = setting(
        None, "split <think>...</think> into reasoning_content: deepseek_r1 or qwen3", choices=REASONING_PARSERS,
        metavar="NAME")

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
