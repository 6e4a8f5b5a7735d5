"""The reasoning parsers (proxy/api/parsers/reasoning.py): DeepSeek-R1's and Qwen3's `<think>` blocks, with the
prompt endings their chat templates write, checked against values written from the format, whole and split at
every character."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from proxy.api.parsers import REASONING_PARSERS, new_reasoning_parser
from proxy.api.parsers.reasoning import prompt_thinking

R1_PROMPT = "<｜User｜>What is the capital of France?<｜Assistant｜><think>\n"  # its updated template
R1_OLD_PROMPT = "<｜User｜>What is the capital of France?<｜Assistant｜>"
QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking: false
QWEN3_THINKING_ONLY = QWEN3_PROMPT + "<think>\n"  # Qwen3-*-Thinking-2507, Qwen3.5
QWEN3_LATER_TURN = ("<|im_start|>assistant\n<think>\nEarlier.\n</think>\n\nHello!<|im_end|>\n"
                    "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")


@dataclass
class Case:
    parser: str
    id: str
    prompt: str
    text: str
    reasoning: str
    content: str


CASES = [
    Case("deepseek_r1", "prompt_opened", R1_PROMPT,
         "Okay, the user asks about France.\n</think>\n\nThe capital of France is Paris.",
         "Okay, the user asks about France.\n", "\n\nThe capital of France is Paris."),
    Case("deepseek_r1", "output_opens", R1_OLD_PROMPT, "<think>\nHmm.\n</think>\n\nParis.", "\nHmm.\n", "\n\nParis."),
    Case("deepseek_r1", "newline_before_think", R1_OLD_PROMPT,
         "\n<think>This is a reasoning section</think>\nThis is the rest",
         "This is a reasoning section", "\nThis is the rest"),
    Case("deepseek_r1", "think_also_in_output", R1_PROMPT, "<think>\nA.</think>B", "\nA.", "B"),
    Case("deepseek_r1", "unopened_is_reasoning", R1_OLD_PROMPT, "This is reasoning</think>This is the rest",
         "This is reasoning", "This is the rest"),
    Case("deepseek_r1", "truncated_all_reasoning", R1_PROMPT, "This is a reasoning section",
         "This is a reasoning section", ""),
    Case("deepseek_r1", "empty_reasoning", R1_PROMPT, "</think>This is the rest", "", "This is the rest"),
    Case("deepseek_r1", "unicode", R1_PROMPT, "Zürich → 東京 🤔</think>答え: 東京", "Zürich → 東京 🤔", "答え: 東京"),
    Case("deepseek_r1", "first_end_tag_only", R1_PROMPT, "a</thinking></think>b</think>c <think>d",
         "a</thinking>", "b</think>c <think>d"),
    Case("deepseek_r1", "not_an_open_tag", R1_OLD_PROMPT, "<thinking>x</think>y", "<thinking>x", "y"),
    Case("deepseek_r1", "closed_in_prompt", R1_PROMPT + "\n</think>\n\n", "Paris. </think> stays", "",
         "Paris. </think> stays"),
    Case("deepseek_r1", "empty_output", R1_PROMPT, "", "", ""),
    Case("qwen3", "hybrid_thinking", QWEN3_PROMPT, "<think>\nLet me think.\n</think>\n\nHello!",
         "\nLet me think.\n", "\n\nHello!"),
    Case("qwen3", "thinking_disabled", QWEN3_NO_THINKING, "Hello! <think>x</think> is a tag.", "",
         "Hello! <think>x</think> is a tag."),
    Case("qwen3", "thinking_only_model", QWEN3_THINKING_ONLY, "Reasoning…\n</think>\n\nAnswer",
         "Reasoning…\n", "\n\nAnswer"),
    Case("qwen3", "no_think_is_content", QWEN3_PROMPT, "\nHello there.", "", "\nHello there."),
    Case("qwen3", "end_tag_without_open_is_content", QWEN3_PROMPT, "a</think>b", "", "a</think>b"),
    Case("qwen3", "truncated", QWEN3_PROMPT, "<think>\nStill thinking", "\nStill thinking", ""),
    Case("qwen3", "later_turn", QWEN3_LATER_TURN, "It opens a block.", "", "It opens a block."),
    Case("qwen3", "later_turn_thinking", QWEN3_LATER_TURN, "<think>ok</think>It opens a block.", "ok",
         "It opens a block."),
    Case("qwen3", "tool_call_after_thinking", QWEN3_PROMPT,
         '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
         "\nCall it.\n", '\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    Case("qwen3", "whitespace_only", QWEN3_PROMPT, "\n\n", "", "\n\n"),
]


def run(parser_name: str, prompt: str, pieces: list[str]) -> tuple[str, str]:
    parser = new_reasoning_parser(parser_name, prompt)
    reasoning = content = ""
    for out in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        assert not out.tool_calls
        reasoning += out.reasoning
        content += out.content
    return reasoning, content


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}-{c.id}" for c in CASES])
def test_whole_and_split_at_every_character(case: Case) -> None:
    assert run(case.parser, case.prompt, [case.text]) == (case.reasoning, case.content)
    text = case.text
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        assert run(case.parser, case.prompt, pieces) == (case.reasoning, case.content), pieces


def test_end_tag_is_held_back_until_decided() -> None:
    parser = new_reasoning_parser("deepseek_r1", R1_PROMPT)
    out = parser.feed("Thinking</thi")
    assert (out.reasoning, out.content) == ("Thinking", "")
    out = parser.feed("nk>\n\nAnswer")
    assert (out.reasoning, out.content) == ("", "\n\nAnswer")


@pytest.mark.parametrize(("tail", "state"), [
    (R1_PROMPT, "open"),
    (R1_OLD_PROMPT, ""),
    (QWEN3_NO_THINKING, "closed"),
    (QWEN3_THINKING_ONLY, "open"),
    (QWEN3_LATER_TURN, ""),
    ("", ""),
])
def test_prompt_thinking(tail: str, state: str) -> None:
    assert prompt_thinking(tail) == state


def test_registry() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert all(cls.name == name for name, cls in REASONING_PARSERS.items())
    assert new_reasoning_parser("qwen3", "").prompt_tail == ""
