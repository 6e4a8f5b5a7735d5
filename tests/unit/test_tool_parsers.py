"""The tool-call parsers (proxy/api/parsers): each format's published shape (Qwen2.5's and Hermes' <tool_call>
template, Llama 3.1's JSON and Llama 3.2's pythonic templates, Mistral's [TOOL_CALLS] in both tokenizer
generations), checked against values written from the format, whole and split at every character."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.api.parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_reasoning_parser,
    new_tool_parser,
)


def args(obj: dict[str, Any]) -> str:
    """The arguments' text a client gets: json.dumps' spacing, non-ASCII as is."""
    return json.dumps(obj, ensure_ascii=False)


@dataclass
class Case:
    parser: str
    id: str
    text: str
    content: str
    calls: list[ToolCall]
    # (name, concatenated arguments) per streamed index where it differs from `calls`: a call whose name went out
    # before the output broke off
    streamed: list[tuple[str, str]] | None = None


@dataclass
class Run:
    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def streamed(self) -> list[tuple[str, str]]:
        """The calls as a client puts them together from the deltas, checking the deltas' order on the way."""
        names: list[str] = []
        arguments: list[str] = []
        for delta in self.deltas:
            if delta.index == len(names):  # a new call: its first delta carries its name
                assert delta.name, delta
                names.append(delta.name)
                arguments.append(delta.arguments)
            else:
                assert delta.index == len(names) - 1 and delta.name is None, (delta, names)
                arguments[-1] += delta.arguments
        return list(zip(names, arguments, strict=True))


def run(parser: ToolParser, pieces: list[str]) -> Run:
    result = Run()
    for out in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        assert not out.reasoning
        result.content += out.content
        result.deltas += out.tool_calls
    result.calls = parser.calls()
    return result


def splits(text: str) -> list[list[str]]:
    """The text in two pieces at every point, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


HERMES = [
    Case("hermes", "qwen_one_call",
         '<tool_call>\n{"name": "get_current_temperature", "arguments": '
         '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
         "", [ToolCall("get_current_temperature", '{"location": "San Francisco, CA, USA", "unit": "celsius"}')]),
    Case("hermes", "content_then_two_calls",
         "I'll check both cities.\n"
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>',
         "I'll check both cities.\n",
         [ToolCall("get_weather", args({"city": "Paris"})), ToolCall("get_weather", args({"city": "Tokyo"}))]),
    Case("hermes", "unicode_nested_compact",
         '<tool_call>{"name":"search","arguments":{ "city" : "Zürich","note":"東京 ☀ \\"quoted\\" </tool_call",'
         '"filters":{"days":[1, 2],"metric":true,"extra":null}}}</tool_call>',
         "", [ToolCall("search", args({"city": "Zürich", "note": '東京 ☀ "quoted" </tool_call',
                                       "filters": {"days": [1, 2], "metric": True, "extra": None}}))]),
    Case("hermes", "arguments_as_json_string",
         '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"vLLM\\"}"}\n</tool_call>',
         "", [ToolCall("lookup", '{"q": "vLLM"}')]),
    Case("hermes", "no_arguments",
         '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [ToolCall("get_time", "{}")]),
    Case("hermes", "text_between_and_after_calls",
         '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nAnd also:\n'
         '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>\n\n',
         "\nAnd also:\n", [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]),
    Case("hermes", "whitespace_before_call_dropped",
         '\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "", [ToolCall("a", "{}")]),
    Case("hermes", "stopped_before_end_tag",
         'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_',
         "Checking.\n", [ToolCall("get_weather", '{"city": "Paris"}')]),
    Case("hermes", "truncated_call",
         'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [],
         streamed=[("get_weather", "")]),
    Case("hermes", "truncated_before_name",
         '<tool_call>\n{"na', '<tool_call>\n{"na', []),
    Case("hermes", "invalid_json_is_content",
         'Hm.\n<tool_call>\n{name: get_weather}\n</tool_call>\n'
         '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>',
         "Hm.\n<tool_call>\n{name: get_weather}\n</tool_call>\n", [ToolCall("ok", "{}")]),
    Case("hermes", "arguments_not_an_object",
         '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', [], streamed=[("f", "")]),
    Case("hermes", "plain_content", "The capital of France is Paris.", "The capital of France is Paris.", []),
    Case("hermes", "looks_like_a_trigger",
         "Wrap it in <tool> or <tool_calls> tags, then </tool_call> <tool_cal",
         "Wrap it in <tool> or <tool_calls> tags, then </tool_call> <tool_cal", []),
    Case("hermes", "only_whitespace", "\n", "\n", []),
]

LLAMA3_JSON = [
    Case("llama3_json", "llama31_one_call",
         '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
         "", [ToolCall("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    Case("llama3_json", "python_tag",
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
         "", [ToolCall("get_weather", '{"city": "Paris"}')]),
    Case("llama3_json", "two_calls_arguments_key",
         '{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
         "", [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]),
    Case("llama3_json", "unicode_nested_compact",
         ' \n{"name":"search","parameters":{"q":"Zürich {weather}","opts":{"days":[1,2],"exact":false}}};'
         '{"name":"t","parameters":{"tz":"日本"}}; ',
         "", [ToolCall("search", args({"q": "Zürich {weather}", "opts": {"days": [1, 2], "exact": False}})),
              ToolCall("t", args({"tz": "日本"}))]),
    Case("llama3_json", "plain_content", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    Case("llama3_json", "json_later_in_text_is_content",
         'Here it is: {"name": "x", "parameters": {}}', 'Here it is: {"name": "x", "parameters": {}}', []),
    Case("llama3_json", "json_answer_is_content", '{"answer": 42}', '{"answer": 42}', []),
    Case("llama3_json", "name_without_parameters_is_content", '{"name": "Bob"}', '{"name": "Bob"}', []),
    Case("llama3_json", "truncated_call",
         '{"name": "get_weather", "parameters": {"city": "Pa',
         '{"name": "get_weather", "parameters": {"city": "Pa', [], streamed=[("get_weather", "")]),
    Case("llama3_json", "truncated_before_name", '{"name": "get_w', '{"name": "get_w', []),
    Case("llama3_json", "builtin_python_call_is_content",
         '<|python_tag|>brave_search.call(query="Paris weather")',
         '<|python_tag|>brave_search.call(query="Paris weather")', []),
    Case("llama3_json", "text_after_calls",
         '{"name": "a", "parameters": {}} Done.', " Done.", [ToolCall("a", "{}")]),
    Case("llama3_json", "second_object_not_a_call",
         '{"name": "a", "parameters": {}}; {"oops": 1}', '; {"oops": 1}', [ToolCall("a", "{}")]),
    Case("llama3_json", "looks_like_python_tag", "<|python", "<|python", []),
]

MISTRAL = [
    Case("mistral", "pre_v11_one_call",
         '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
         '"format": "celsius"}}]',
         "", [ToolCall("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    Case("mistral", "pre_v11_content_two_calls",
         'Let me check.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}},{"name":"b","arguments":{"y":"ü"}}]',
         "Let me check.", [ToolCall("a", '{"x": 1}'), ToolCall("b", '{"y": "ü"}')]),
    Case("mistral", "v11_one_call",
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [ToolCall("get_weather", '{"city": "Paris"}')]),
    Case("mistral", "v11_repeated_unicode_nested",
         'Voilà :[TOOL_CALLS]search[ARGS]{"q":"東京 [ARGS] {x}","opts":{"n":[1,2]}}'
         '[TOOL_CALLS]get_time[ARGS]{}',
         "Voilà :", [ToolCall("search", args({"q": "東京 [ARGS] {x}", "opts": {"n": [1, 2]}})),
                     ToolCall("get_time", "{}")]),
    Case("mistral", "v11_call_id",
         '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
         "", [ToolCall("get_weather", '{"city": "Paris"}')]),
    Case("mistral", "v11_without_args_token",
         '[TOOL_CALLS]get_weather{"city": "Paris"}', "", [ToolCall("get_weather", '{"city": "Paris"}')]),
    Case("mistral", "text_after_call", '[TOOL_CALLS]a[ARGS]{}\n\nDone.', "\n\nDone.", [ToolCall("a", "{}")]),
    Case("mistral", "plain_content", "Bonjour ! Comment puis-je vous aider ?",
         "Bonjour ! Comment puis-je vous aider ?", []),
    Case("mistral", "looks_like_a_trigger", "Use [TOOL] or [TOOL_CALL] markers [TOOL_CA",
         "Use [TOOL] or [TOOL_CALL] markers [TOOL_CA", []),
    Case("mistral", "not_a_name", "[TOOL_CALLS] I can't do that.", "[TOOL_CALLS] I can't do that.", []),
    Case("mistral", "v11_truncated",
         'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
         'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Par', [], streamed=[("get_weather", "")]),
    Case("mistral", "pre_v11_truncated_second",
         '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu',
         ', {"name": "b", "argu', [ToolCall("a", '{"x": 1}')]),
    Case("mistral", "failed_name_then_call",
         '[TOOL_CALLS]oops[TOOL_CALLS]get_time[ARGS]{}', "[TOOL_CALLS]oops", [ToolCall("get_time", "{}")]),
]

PYTHONIC = [
    Case("pythonic", "llama32_one_call", "[get_weather(city='San Francisco', metric='celsius')]",
         "", [ToolCall("get_weather", '{"city": "San Francisco", "metric": "celsius"}')]),
    Case("pythonic", "literal_types_two_calls",
         "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
         "passed_test=True, aliases=('John', 'Johnny'), score=-1.5, big=2e3), get_time()]",
         "", [ToolCall("register_user", '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", '
                                        '"state": "CA"}, "role": null, "passed_test": true, '
                                        '"aliases": ["John", "Johnny"], "score": -1.5, "big": 2000.0}'),
              ToolCall("get_time", "{}")]),
    Case("pythonic", "unicode_escapes_brackets_in_strings",
         "[send(text='It\\'s 20°C in Zürich — 東京', path=\"C:\\\\tmp\", brackets='([{', empty='')]",
         "", [ToolCall("send", args({"text": "It's 20°C in Zürich — 東京", "path": "C:\\tmp", "brackets": "([{",
                                     "empty": ""}))]),
    Case("pythonic", "triple_quoted", "[note(body='''a 'quoted'\nline)''')]",
         "", [ToolCall("note", args({"body": "a 'quoted'\nline)"}))]),
    Case("pythonic", "llama4_wrapper", "<|python_start|>[get_time(zone='UTC')]<|python_end|>",
         "", [ToolCall("get_time", '{"zone": "UTC"}')]),
    Case("pythonic", "plain_content", "I don't know.", "I don't know.", []),
    Case("pythonic", "bracketed_text", "[Note] This is text.", "[Note] This is text.", []),
    Case("pythonic", "list_of_numbers", "[1, 2, 3]", "[1, 2, 3]", []),
    Case("pythonic", "dotted_name", "[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),
    Case("pythonic", "positional_argument", "[f(1)]", "[f(1)]", [], streamed=[("f", "")]),
    Case("pythonic", "not_a_literal", "[f(x=y)]", "[f(x=y)]", [], streamed=[("f", "")]),
    Case("pythonic", "truncated", "[get_weather(city='Par", "[get_weather(city='Par", [],
         streamed=[("get_weather", "")]),
    Case("pythonic", "truncated_second", "[a(x=1), b(y=", ", b(y=", [ToolCall("a", '{"x": 1}')],
         streamed=[("a", '{"x": 1}'), ("b", "")]),
    Case("pythonic", "text_after_list", "[a()]\nDone.", "\nDone.", [ToolCall("a", "{}")]),
]

CASES = HERMES + LLAMA3_JSON + MISTRAL + PYTHONIC


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}-{c.id}" for c in CASES])
def test_whole_and_split_at_every_character(case: Case) -> None:
    whole = run(new_tool_parser(case.parser), [case.text])
    assert whole.content == case.content
    assert whole.calls == case.calls
    streamed = case.streamed if case.streamed is not None else [(c.name, c.arguments) for c in case.calls]
    assert whole.streamed() == streamed
    for pieces in splits(case.text):
        split = run(new_tool_parser(case.parser), pieces)
        assert (split.content, split.calls, split.streamed()) == (whole.content, whole.calls, streamed), pieces


def test_name_goes_out_before_the_arguments() -> None:
    """Streamed, a call's name is sent as soon as its name and the arguments' key are written."""
    parser = new_tool_parser("hermes")
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu').tool_calls == []
    assert parser.feed('ments": {"city": ').tool_calls == [ToolCallDelta(0, "get_weather", "")]
    assert parser.feed('"Paris"}}\n</tool_call>').tool_calls == [ToolCallDelta(0, None, '{"city": "Paris"}')]


def test_content_is_held_only_while_it_may_open_a_call() -> None:
    parser = new_tool_parser("hermes")
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("box").content == "<toolbox"
    assert parser.finish().content == ""


TOOLS = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    ("search_web", {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}),
]
TOOL_ARGS: dict[str, dict[str, Any]] = {
    "get_weather": {"city": "São Paulo"},
    "search_web": {"q": "vLLM \"structural\" tags", "n": 3},
}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_structures_parse_back(name: str) -> None:
    found = TOOL_PARSERS[name].structures(TOOLS)
    assert found is not None
    structures, triggers = found
    assert [s.schema for s in structures] == [schema for _, schema in TOOLS]
    texts = []
    for structure, (tool, _) in zip(structures, TOOLS, strict=True):
        assert any(structure.begin.startswith(trigger) for trigger in triggers)
        texts.append(structure.begin + json.dumps(TOOL_ARGS[tool]) + structure.end)
        parser = new_tool_parser(name)
        assert run(parser, [texts[-1]]).calls == [ToolCall(tool, args(TOOL_ARGS[tool]))]
    # parallel calls: one structure after the other, as the triggered tags let the model write them
    both = run(new_tool_parser(name), ["".join(texts)])
    assert both.calls == [ToolCall(tool, args(TOOL_ARGS[tool])) for tool, _ in TOOLS]
    assert both.content == ""


def test_structures_are_the_formats_own() -> None:
    hermes = TOOL_PARSERS["hermes"].structures(TOOLS[:1])
    assert hermes is not None
    assert hermes[0][0].begin == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert hermes[0][0].end == "}\n</tool_call>"
    assert hermes[1] == ["<tool_call>"]
    llama = TOOL_PARSERS["llama3_json"].structures(TOOLS[:1])
    assert llama is not None
    assert (llama[0][0].begin, llama[0][0].end, llama[1]) == ('{"name": "get_weather", "parameters": ', "}",
                                                             ['{"name": '])
    mistral = TOOL_PARSERS["mistral"].structures(TOOLS[:1])
    assert mistral is not None
    assert (mistral[0][0].begin, mistral[0][0].end, mistral[1]) == ("[TOOL_CALLS]get_weather[ARGS]", "",
                                                                   ["[TOOL_CALLS]"])
    assert TOOL_PARSERS["pythonic"].structures(TOOLS) is None


def test_registry() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert all(cls.name == name for name, cls in TOOL_PARSERS.items())
    assert new_tool_parser("hermes") is not new_tool_parser("hermes")
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        new_tool_parser("qwen3_xml")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        new_reasoning_parser("granite", "")
