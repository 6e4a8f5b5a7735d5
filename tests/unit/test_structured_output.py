"""Structured output in the engine (engine/structured_output.py, the sampler's mask, the request's grammar): the
offline LLM's constrained outputs parse and validate against their schemas (hypothesis-generated ones too), equal
transformers' greedy tokens under the same xgrammar mask, and match their regex, choices and grammar; bad
constraints are ValueErrors with xgrammar's reason; a continuation's tokens must follow the grammar."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine import LLM, FinishReason, SamplingParams, StructuredOutputsParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import SampledToken, TokenBitmask, apply_token_bitmask
from engine.structured_output import bitmask_width
from tests.fixtures.json_schemas import bounded_schemas
from tests.fixtures.tiny_models import TinyModelFactory, _load_oracle

PROMPTS = ["Hello", "The license", "JSON:"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"enum": ["cat", "dog", "eel"]}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=False)


def constrained(spec: StructuredOutputsParams, max_tokens: int = 64, **kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kwargs}, max_tokens=max_tokens, structured_outputs=spec)


def xgrammar_greedy(model: Path, prompt: list[int], compiled: Any, max_tokens: int) -> list[int]:
    """The oracle: transformers' float32 logits, masked by xgrammar's own matcher and bitmask kernel, argmax."""
    hf = _load_oracle(str(model.resolve()))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)  # transformers' own KV cache, not ours
        while True:
            logits = out.logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            tokens.append(int(logits.argmax()))
            assert matcher.accept_token(tokens[-1])
            if len(tokens) == max_tokens or matcher.is_terminated():
                return tokens
            out = hf(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)


def test_the_sampler_masks_exactly_what_xgrammar_masks() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_width(vocab)), dtype=torch.int32, generator=generator)
    masked = apply_token_bitmask(logits, TokenBitmask([1, 3], bitmask))
    expected = logits.clone()
    for row, source in ((1, 0), (3, 1)):
        one = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(one, bitmask[source:source + 1])
        expected[row] = one[0]
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched


@pytest.fixture(scope="module")
def compiler(model: Path) -> Any:
    """The oracle's own xgrammar compiler for the tiny model's tokenizer (EOS 0)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                                                  stop_token_ids=[0]))


def test_greedy_json_and_regex_outputs_equal_transformers_under_the_same_grammar(llm: LLM, model: Path,
                                                                                compiler: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    specs = [(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
              compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=False)),
             (StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}"), compiler.compile_regex(r"[a-z]{2,4}-[0-9]{2}"))]
    prompts = [tokenizer.encode(PROMPTS[0])]
    for spec, compiled in specs:
        outputs = llm.generate(prompts, constrained(spec))
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == xgrammar_greedy(model, prompt, compiled, 64)
            assert out.outputs[0].finish_reason is FinishReason.STOP
    for out in llm.generate(prompts, constrained(specs[0][0])):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_sampled_choice_regex_and_grammar_outputs_match_their_constraint(llm: LLM) -> None:
    choices = ["yes", "no", "maybe so", "naïve 🙂"]
    regex = r"(ab|cd)[0-9]{1,3}x?"
    grammar = 'root ::= "(" [0-9]{1,4} ")" | "none"'
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32, structured_outputs=spec)
              for seed in range(6)
              for spec in (StructuredOutputsParams(choice=choices), StructuredOutputsParams(regex=regex),
                           StructuredOutputsParams(grammar=grammar))]
    outputs = llm.generate(["x"] * len(params), params)
    texts = [out.outputs[0].text for out in outputs]
    assert all(out.outputs[0].finish_reason is FinishReason.STOP for out in outputs)
    assert all(text in choices for text in texts[0::3])
    assert all(re.fullmatch(regex, text) for text in texts[1::3])
    assert all(re.fullmatch(r"\([0-9]{1,4}\)|none", text) for text in texts[2::3])


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example costs generations
@given(schema=bounded_schemas(), seed=st.integers(0, 2**31))
def test_outputs_of_hypothesis_schemas_parse_and_validate(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)
    greedy, sampled = llm.generate(["JSON:"] * 2, [constrained(spec, 200),
                                                    constrained(spec, 200, temperature=0.9, seed=seed)])
    for out in (greedy, sampled):
        assert out.outputs[0].finish_reason is FinishReason.STOP, out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_an_eos_ends_a_constrained_request_only_where_its_grammar_may_end(llm: LLM) -> None:
    # ignore_eos or not, the request ends at the grammar's end, with EOS (its end token) as its last token
    spec = StructuredOutputsParams(choice=["yes", "no"])
    for ignore_eos in (False, True):
        out = llm.generate(["Hello"], constrained(spec, ignore_eos=ignore_eos))[0].outputs[0]
        assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == 0 and out.text in ("yes", "no")


def test_asynchronous_scheduling_samples_the_same_constrained_tokens(llm: LLM, model: Path) -> None:
    overlapped = LLM(model=str(model), dtype="float32", block_size=4, async_scheduling=True)
    params = [constrained(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              constrained(StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}"), temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)]  # unconstrained, same batch
    expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert [out.outputs[0].token_ids for out in overlapped.generate(PROMPTS, params)] == expected


def test_bad_constraints_are_value_errors_with_xgrammars_reason_and_compile_once(llm: LLM) -> None:
    engine = llm.engine
    for spec, reason in ((StructuredOutputsParams(regex="a(?=b)"), "Lookahead"),
                         (StructuredOutputsParams(grammar="root ::= rule"), 'Rule "rule" is not defined'),
                         (StructuredOutputsParams(json={"type": "nonsense"}), "Unsupported type")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            llm.generate(["x"], constrained(spec))
        assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    compiled = engine.structured_outputs.num_compiled
    llm.generate(["x", "y"], constrained(StructuredOutputsParams(choice=["a", "b"])))
    llm.generate(["z"], constrained(StructuredOutputsParams(choice=["a", "b"])))
    assert engine.structured_outputs.num_compiled == compiled + 1  # cached by key


def test_a_continuation_and_a_handed_off_first_token_must_follow_the_grammar(llm: LLM, model: Path) -> None:
    engine = llm.engine
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    params = constrained(StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="does not follow"):
        engine.make_request("c1", [5, 6], params, output_token_ids=tokenizer.encode("x"))
    engine.make_request("c2", [5, 6], params, output_token_ids=tokenizer.encode("ye"))  # a prefix: fine
    request = engine.make_request("c3", [5, 6], params)
    with pytest.raises(ValueError, match="does not follow"):
        engine.validate_first_token(request, tokenizer.encode("x")[0])
    engine.validate_first_token(request, tokenizer.encode("no")[0])


def test_a_request_handed_from_a_prefill_engine_follows_the_grammar_of_a_colocated_one(llm: LLM, model: Path,
                                                                                      compiler: Any) -> None:
    """The decode node's path in the engine (decode_node/loop.py does the same around a transfer): P samples the
    first token under the grammar, D's grammar is first advanced by it, then D decodes the rest."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt = tokenizer.encode("A pet: ")
    params = constrained(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    expected = xgrammar_greedy(model, prompt, compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                           strict_mode=False), 64)
    colocated = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert colocated == expected
    prefill = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, async_scheduling=False))
    prefill.add_request("p", prompt, dataclasses.replace(params, max_tokens=1), pin_blocks=True)
    (first,) = [out for _ in range(4) for out in prefill.step()]
    pinned = prefill.pinned_blocks("p")
    assert pinned is not None
    decode = llm.engine
    request = decode.make_request("d", prompt, params)
    decode.validate_first_token(request, first.token_id)
    blocks = decode.reserve_remote_kv(request)
    assert blocks is not None
    skip = blocks.num_cached_blocks  # D's own prefix hits (the colocated run left them)
    decode.kv_cache[blocks.block_ids[skip:]] = prefill.kv_cache[list(pinned.block_ids[skip:])]  # the "transfer"
    tokens = [first.token_id]
    if not decode.admit_remote_kv("d", SampledToken(first.token_id)).finished:
        while decode.has_unfinished():
            tokens += [out.token_id for out in decode.step()]
    assert tokens == expected
