"""Structural tags (vLLM's `structured_outputs.structural_tag`): free text until a trigger, then a structure's begin,
JSON valid against its schema and its end, then free text again. Checked for shape in engine/types.py, compiled in
engine/structured_output.py; the matcher is driven with strings here, and the engine's outputs (a trigger forced by
logit_bias, greedy and sampled, colocated and handed from a prefill engine) are parsed and validated with
jsonschema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.structured_output import StructuredOutputCompiler
from tests.fixtures.handoff import handed_off_tokens
from tests.fixtures.tiny_models import TinyModelFactory

EOS = 0  # the tiny tokenizer's <|endoftext|>
SCHEMA = {"type": "object", "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
# "<" is one token of the tiny tokenizer: biased by +100 it is what the model writes whenever it may
TRIGGER = "<"
TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
       "triggers": [TRIGGER]}
CALL = re.compile(r"<f>(.*?)</f>")


def structural_tag(tag: dict[str, Any] = TAG, **options: bool) -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag=json.dumps(tag), **options)


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def compiler(model: Path) -> StructuredOutputCompiler:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return StructuredOutputCompiler(model, len(tokenizer), [EOS], tokenizer)


def accepts(compiler: StructuredOutputCompiler, spec: StructuredOutputsParams, text: str, end: bool = True) -> bool:
    """Whether the grammar takes `text` and, with `end`, then EOS, after which it is terminated."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    if not matcher.accept_string(text):
        return False
    return not end or (matcher.accept_token(EOS) and matcher.is_terminated())


# ---- shape ----
@pytest.mark.parametrize("tag, match", [
    ("not json", "is not valid JSON"),
    ({"type": "json_schema"}, '"type": "structural_tag"'),
    ({**TAG, "structures": []}, "structures must be a non-empty list"),
    ({**TAG, "structures": ["x"]}, r"structures\[0\] must be an object"),
    ({**TAG, "structures": [{"begin": "<f>", "schema": SCHEMA}]}, r"structures\[0\].end must be a string"),
    ({**TAG, "structures": [{"begin": "", "schema": SCHEMA, "end": ""}]}, r"structures\[0\].begin must be non-empty"),
    ({**TAG, "structures": [{"begin": "<f>", "schema": "{}", "end": "</f>"}]}, r"schema must be a JSON schema object"),
    ({**TAG, "triggers": []}, "triggers must be a non-empty list"),
    ({**TAG, "triggers": [""]}, "triggers must be a non-empty list of non-empty strings"),
    ({**TAG, "triggers": ["<g"]}, "'<g' begins no structure"),
])
def test_a_malformed_structural_tag_is_a_value_error_naming_what(tag: Any, match: str) -> None:
    text = tag if isinstance(tag, str) else json.dumps(tag)
    with pytest.raises(ValueError, match=f"structured_outputs.structural_tag.*{match}"):
        StructuredOutputsParams(structural_tag=text)


def test_a_structural_tag_is_one_constraint_among_the_others() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(structural_tag=json.dumps(TAG), regex="a")
    assert structural_tag().kind == "structural_tag"
    assert structural_tag().key() != structural_tag(disable_any_whitespace=True).key()


# ---- the compiled grammar ----
def test_the_grammar_takes_free_text_then_tagged_json_then_free_text_and_eos(
        compiler: StructuredOutputCompiler) -> None:
    spec = structural_tag()
    assert accepts(compiler, spec, "")
    assert accepts(compiler, spec, "no trigger here")
    assert accepts(compiler, spec, 'Calling: <f>{"id": 7, "ok": true}</f> and again <f>{"id": 0, "ok": false}</f>.')
    assert accepts(compiler, spec, '<f>{"id": 7, "ok": true}', end=False)  # unfinished: a valid prefix
    assert not accepts(compiler, spec, '<f>{"id": 7, "ok": true}')  # but no EOS before the structure's end


@pytest.mark.parametrize("text", ['x <f>{"id": "7"', "x <f>[", 'x <f>{"id": 100', "x <g", 'x <f>{"id": 1, "ok": 1}'])
def test_the_grammar_refuses_what_is_not_the_schemas_json_after_a_trigger(compiler: StructuredOutputCompiler,
                                                                          text: str) -> None:
    assert not accepts(compiler, structural_tag(), text, end=False)


def test_whitespace_and_additional_properties_options_apply_to_each_structure(
        compiler: StructuredOutputCompiler) -> None:
    loose, strict = structural_tag(), structural_tag(disable_any_whitespace=True, disable_additional_properties=True)
    extra = '<f>{"id": 1, "ok": true, "more": 2}</f>'
    spaced = '<f>{\n  "id":  1, "ok": true}</f>'
    assert accepts(compiler, loose, extra) and accepts(compiler, loose, spaced)
    assert not accepts(compiler, strict, extra) and not accepts(compiler, strict, spaced)
    assert accepts(compiler, strict, '<f>{"id": 1, "ok": true}</f>')


def test_a_schema_xgrammar_refuses_is_a_value_error_with_its_reason(compiler: StructuredOutputCompiler) -> None:
    tag = {**TAG, "structures": [{"begin": "<f>", "schema": {"type": "nonsense"}, "end": "</f>"}]}
    with pytest.raises(ValueError, match="structured_outputs.structural_tag does not compile: .*nonsense"):
        compiler.compile(structural_tag(tag))


# ---- the engine ----
@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=False)


def forced_trigger_params(tokenizer: Any, **kwargs: Any) -> SamplingParams:
    """Params that make the model write the trigger wherever the grammar lets it (free text), so that its output
    is tagged JSON, one call after another: a tiny random model would seldom write a trigger on its own."""
    (trigger_id,) = tokenizer.encode(TRIGGER)
    spec = structural_tag(disable_any_whitespace=True, disable_additional_properties=True)
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 120, **kwargs}, logit_bias={trigger_id: 100},
                          structured_outputs=spec)


def assert_calls_are_valid(text: str) -> None:
    """Every completed call parses and validates, and every trigger in the free text between them began one: a
    trigger is only left in the text after the last call, where max_tokens cut a call short."""
    parts = CALL.split(text)  # free text, a call's JSON, free text, ...
    free, calls = parts[::2], parts[1::2]
    assert calls, text
    for call in calls:
        jsonschema.validate(json.loads(call), SCHEMA)
    assert not any(TRIGGER in part for part in free[:-1]), text
    cut = free[-1][free[-1].find(TRIGGER):] if TRIGGER in free[-1] else ""
    assert cut.startswith("<f>") or "<f>".startswith(cut), text


def test_what_the_model_writes_after_a_trigger_is_json_valid_against_the_schema(llm: LLM, model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    params = [forced_trigger_params(tokenizer)] + [forced_trigger_params(tokenizer, temperature=1.0, seed=seed)
                                                   for seed in range(4)]
    outputs = llm.generate(["Hello", "The license", "JSON:", "x", "y"], params)
    for out in outputs:
        assert_calls_are_valid(out.outputs[0].text)
    # the control: the same bias without the structural tag writes no call at all
    unconstrained = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=params[0].logit_bias)
    assert not CALL.search(llm.generate(["Hello"], unconstrained)[0].outputs[0].text)


def test_a_request_handed_from_a_prefill_engine_follows_the_structural_tag_as_a_colocated_one(
        llm: LLM, model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt = tokenizer.encode("Call f: ")
    params = forced_trigger_params(tokenizer, max_tokens=60)
    colocated = llm.generate([prompt], params)[0].outputs[0].token_ids
    prefill = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, async_scheduling=False))
    tokens = handed_off_tokens(prefill, llm.engine, "handed", prompt, params)
    assert tokens == colocated and tokens[0] == tokenizer.encode(TRIGGER)[0]  # P's first token is the trigger
    assert_calls_are_valid(tokenizer.decode(tokens))


def test_a_length_bounded_string_holds_no_raw_quote_or_backslash(compiler: StructuredOutputCompiler) -> None:
    """A bounded string's characters go into the JSON text as they are: a raw '"' would end the string early and let
    the model write properties the schema forbids (SmolLM2 did: `{"city": "Paris"}, "description": ...}`)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 40}}}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert accepts(compiler, spec, '{"city": "Paris, France"}')
    for smuggled in ('{"city": "Paris"}, "x": "y"}', '{"city": "a\\\\b"}'):
        assert not accepts(compiler, spec, smuggled), smuggled
