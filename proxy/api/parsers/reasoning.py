"""vLLM's `deepseek_r1` and `qwen3` reasoning parsers: `<think>...</think>` is reasoning, the rest content.

Where the output starts depends on the chat template, which the parser reads from the prompt's tail:

- The prompt ends with `<think>` (and whitespace): DeepSeek-R1's updated template and Qwen3's thinking-only
  models (Qwen3-*-Thinking-2507, Qwen3.5) open the block, so the output starts inside it and only `</think>`
  follows.
- The prompt ends with `</think>` (and whitespace): Qwen3's template with `enable_thinking: false` writes an empty
  `<think>\\n\\n</think>\\n\\n`; the output is all content (vLLM's serving layer sees this in the prompt's tokens
  and skips the parser).
- Otherwise the model may write `<think>` itself (Qwen3's hybrid models do when thinking).

As vLLM: a `<think>` the output starts with (after whitespace, which is dropped with it) is not shown; reasoning
runs to the first `</think>`, everything after it is content as written (vLLM does not strip the "\\n\\n" after
`</think>`); an output that ends inside the block is all reasoning. The parsers differ where neither the prompt nor
the output opens the block: deepseek_r1 counts the output as reasoning up to `</think>` (vLLM's parser assumes R1
is always thinking); qwen3 counts it as content (Qwen3 writes `<think>` whenever it thinks; vLLM's parser, which
cannot see the prompt's text, assumes the template opened the block).
"""

from __future__ import annotations

from proxy.api.parsers.base import ParsedText, ReasoningParser, SteppedParser, held_prefix, starts_token

START = "<think>"
END = "</think>"

# states
_OPENING = "opening"  # the output's start: a <think> there is dropped
_REASONING = "reasoning"
_CONTENT = "content"


def prompt_thinking(prompt_tail: str) -> str:
    """"open" where the prompt ends inside a reasoning block, "closed" where it ends just after one, else ""."""
    opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
    if opened > closed and not prompt_tail[opened + len(START):].strip():
        return "open"
    if closed > opened and not prompt_tail[closed + len(END):].strip():
        return "closed"
    return ""


class _ThinkParser(SteppedParser, ReasoningParser):
    """Reasoning in `<think>...</think>`; `unopened`: what an output is where neither the prompt nor the output
    opens the block."""

    unopened: str

    def __init__(self, prompt_tail: str = "") -> None:
        super().__init__(prompt_tail)
        self._buf = ""
        thinking = prompt_thinking(prompt_tail)
        self._state = _CONTENT if thinking == "closed" else _OPENING
        self._after_opening = _REASONING if thinking == "open" else self.unopened


    def _step(self, out: ParsedText, final: bool) -> bool:
        """One move; False when it needs more text."""
        if self._state == _CONTENT:
            out.content += self._buf
            self._buf = ""
            return False
        if self._state == _REASONING:
            return self._reasoning_step(out, final)
        stripped = self._buf.lstrip()
        opens = starts_token(stripped, START) if stripped else None
        if opens is None and not final:
            return False
        if opens:
            self._buf = stripped[len(START):]
            self._state = _REASONING
        else:
            self._state = self._after_opening
        return True

    def _reasoning_step(self, out: ParsedText, final: bool) -> bool:
        at = self._buf.find(END)
        if at < 0:
            release = len(self._buf) - (0 if final else held_prefix(self._buf, END))
            out.reasoning += self._buf[:release]
            self._buf = self._buf[release:]
            return False
        out.reasoning += self._buf[:at]
        self._buf = self._buf[at + len(END):]
        self._state = _CONTENT
        return True


class DeepSeekR1ReasoningParser(_ThinkParser):
    name = "deepseek_r1"
    unopened = _REASONING


class Qwen3ReasoningParser(_ThinkParser):
    name = "qwen3"
    unopened = _CONTENT
