"""The OpenAI API's answers through the official `openai` SDK against a live cluster: models, chat and
completions, streaming with usage, n and seeds, logprobs, the prefix hit in usage, and structured output in both
routing modes. Stop strings and EOS text: test_openai_text.py; errors, disconnects and /metrics:
test_openai_errors.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from transformers import AutoTokenizer

from tests.fixtures.json_schemas import bounded_schemas
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.openai_cluster import API_KEY, CHAT, Cluster, running_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model("llama"), tmp_path_factory.mktemp("openai-logs")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Any:
    return AutoTokenizer.from_pretrained(str(cluster.model))


def test_models_lists_the_served_model(cluster: Cluster) -> None:
    client = cluster.client()
    assert [m.id for m in client.models.list().data] == [cluster.model.name]
    assert client.models.retrieve(cluster.model.name).id == cluster.model.name


def test_chat_answers_with_an_assistant_message_and_counts_the_templated_prompt(cluster: Cluster, tokenizer: Any
                                                                                ) -> None:
    r = cluster.client().chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == cluster.model.name
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert r.usage is not None and r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    # the same prompt through /v1/completions gives the same greedy text
    same = cluster.client().completions.create(model=cluster.model.name, prompt=prompt, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert same.choices[0].text == choice.message.content


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(cluster: Cluster) -> None:
    client = cluster.client()
    kwargs: dict[str, Any] = {"model": cluster.model.name, "prompt": "The license", "max_tokens": 10,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text_chunks, last = chunks[:-1], chunks[-1]
    assert len(text_chunks) >= 2 and all(c.usage is None for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert whole.usage is not None and last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_sends_the_role_first_and_usage_last(cluster: Cluster) -> None:
    client = cluster.client()
    whole = client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_samples_are_seeded_seed_plus_index_and_reproducible(cluster: Cluster) -> None:
    client = cluster.client()
    kwargs: dict[str, Any] = {"model": cluster.model.name, "prompt": "Python", "max_tokens": 12, "temperature": 1.0,
                              "extra_body": {"ignore_eos": True}}
    both = client.completions.create(**kwargs, n=2, seed=7)
    assert sorted(c.index for c in both.choices) == [0, 1]
    assert both.usage is not None and both.usage.completion_tokens == 24
    texts = {c.index: c.text for c in both.choices}
    assert texts[0] != texts[1]
    assert client.completions.create(**kwargs, seed=7).choices[0].text == texts[0]
    assert client.completions.create(**kwargs, seed=8).choices[0].text == texts[1]
    again = client.completions.create(**kwargs, n=2, seed=7)
    assert {c.index: c.text for c in again.choices} == texts
    # chat streams n choices too, each with its role chunk first
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=5, n=2,
                                                 seed=3, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finishes) == {0, 1}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_logprobs_have_one_entry_per_token_with_the_top_alternatives(cluster: Cluster) -> None:
    client = cluster.client()
    r = client.completions.create(model=cluster.model.name, prompt="The license", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == 5 and "".join(logprobs.tokens) == r.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs,
                                   strict=True):
        assert len(top) == 3 and logprob <= 0 and top[token] == logprob == max(top.values())  # greedy: the best
    chat = client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 4
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(bytes(e.bytes or []) == e.token.encode() for e in content)
    # streamed, each chunk's logprobs are those of its tokens
    chunks = list(client.chat.completions.create(model=cluster.model.name, messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_usage_reports_the_prefix_hit_of_a_repeated_prompt(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks of 4
    first = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens == 30 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 28  # the prefill node's hit: 7 blocks of 4


def test_a_colocated_request_reports_the_decode_nodes_prefix_hit(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompt = list(range(100, 122))  # 22 tokens, short enough to run on D alone
    first = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=1)
    second = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=1)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 20  # D's own hit: 5 blocks of 4
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].logprobs is not None and len(second.choices[0].logprobs.tokens or []) == 3


def oracle_prompt_logprobs(model: Any, prompt: list[int]) -> list[dict[int, float]]:
    """transformers' log-softmax at each prompt position after the first: position i's row is what token i's
    logprob is read from (the logits of position i - 1)."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return [dict(enumerate(rows[i - 1].tolist())) for i in range(1, len(prompt))]


def test_echo_and_prompt_logprobs_are_the_prompts_under_transformers_in_both_routing_modes(cluster: Cluster) -> None:
    from tests.fixtures.tiny_models import _load_oracle

    oracle = _load_oracle(str(cluster.model.resolve()))
    prompt = list(range(200, 212))
    expected = oracle_prompt_logprobs(oracle, prompt)
    for mode, client in clients(cluster).items():
        r = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=2, temperature=0,
                                      echo=True, logprobs=2, extra_body={"ignore_eos": True})
        choice = r.choices[0]
        prompt_text = AutoTokenizer.from_pretrained(str(cluster.model)).decode(prompt)
        assert choice.text.startswith(prompt_text), mode
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.tokens is not None
        assert len(logprobs.tokens) == len(prompt) + 2 and "".join(logprobs.tokens) == choice.text
        assert logprobs.token_logprobs[0] is None  # the first prompt token has nothing before it
        for i, token_id in enumerate(prompt[1:], start=1):
            assert abs(logprobs.token_logprobs[i] - expected[i - 1][token_id]) < 1e-3, (mode, i)
        # vLLM's prompt_logprobs: None, then token id -> logprob, rank, decoded token
        raw = httpx.post(f"{client.base_url}completions", headers={"Authorization": f"Bearer {client.api_key}"},
                         timeout=60, json={"model": cluster.model.name, "prompt": prompt, "max_tokens": 1,
                                           "prompt_logprobs": 1}).json()
        positions = raw["choices"][0]["prompt_logprobs"]
        assert positions[0] is None and len(positions) == len(prompt)
        for i, position in enumerate(positions[1:], start=1):
            best = max(expected[i - 1], key=expected[i - 1].__getitem__)
            assert str(prompt[i]) in position and str(best) in position, (mode, i)
            assert abs(position[str(prompt[i])]["logprob"] - expected[i - 1][prompt[i]]) < 1e-3
            assert position[str(best)]["rank"] == 1


def test_logit_bias_makes_a_token_win_or_lose_in_both_routing_modes(cluster: Cluster) -> None:
    from tests.fixtures.tiny_models import hf_greedy

    prompt = list(range(300, 310))
    (plain,) = hf_greedy(cluster.model, [prompt], 1)
    for mode, client in clients(cluster).items():
        forced = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=3, temperature=0,
                                           logit_bias={"7": 100}, logprobs=0, extra_body={"ignore_eos": True})
        tokenizer = AutoTokenizer.from_pretrained(str(cluster.model))
        assert forced.choices[0].text == tokenizer.decode([7, 7, 7]), mode
        banned = client.completions.create(model=cluster.model.name, prompt=prompt, max_tokens=1, temperature=0,
                                           logit_bias={str(plain[0]): -100}, extra_body={"ignore_eos": True})
        assert banned.choices[0].text != tokenizer.decode(plain), mode
    with pytest.raises(openai.BadRequestError):  # beyond the vocabulary: the node's 400, named
        cluster.client().completions.create(model=cluster.model.name, prompt=prompt, max_tokens=1,
                                            logit_bias={"999999": 5})


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(cluster: Cluster) -> None:
    chunks = list(cluster.client().completions.create(
        model=cluster.model.name, prompt="The license", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks) and counts == sorted(counts) and counts[-1] == 4


# ---- structured output, in both routing modes: the open proxy disaggregates every request (P samples the first
# token within the grammar, D's grammar is first advanced by it); the guarded one runs short prompts on D alone ----

MODES = ("disaggregated", "colocated")
PET = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 30}, "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}}
# a random tiny model fills free whitespace forever: compact JSON (vLLM's option, sent next to response_format)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def clients(cluster: Cluster) -> dict[str, openai.OpenAI]:
    assert cluster.guarded_url is not None
    return {"disaggregated": cluster.client(),
            "colocated": openai.OpenAI(base_url=f"{cluster.guarded_url}/v1", api_key=API_KEY, max_retries=0,
                                       timeout=60)}


def decisions(cluster: Cluster, mode: str) -> float:
    url = cluster.url if mode == "disaggregated" else cluster.guarded_url
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tandem:pd_decisions_total{") and f'mode="{mode}"' in line)


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_and_agree_in_both_routing_modes(cluster: Cluster) -> None:
    texts: dict[str, list[str]] = {}
    for mode in MODES:
        before = decisions(cluster, mode)
        client = clients(cluster)[mode]
        chat = client.chat.completions.create(model=cluster.model.name, messages=PET, max_tokens=80, temperature=0,
                                              response_format=json_schema_format(SCHEMA), extra_body=COMPACT)
        completion = client.completions.create(model=cluster.model.name, prompt="A pet:", max_tokens=80,
                                               temperature=0, extra_body={"guided_json": SCHEMA, **COMPACT})
        stream = client.chat.completions.create(model=cluster.model.name, messages=PET, max_tokens=80, temperature=0,
                                                response_format=json_schema_format(SCHEMA), extra_body=COMPACT,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        texts[mode] = [chat.choices[0].message.content or "", completion.choices[0].text, streamed]
        assert chat.choices[0].finish_reason == completion.choices[0].finish_reason == "stop"
        for text in texts[mode]:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert decisions(cluster, mode) == before + 3  # each request went the way this proxy routes all
    assert texts["disaggregated"] == texts["colocated"]
    assert texts["disaggregated"][0] == texts["disaggregated"][2]


def test_choices_regexes_grammars_and_json_objects_match_in_both_routing_modes(cluster: Cluster) -> None:
    choices = ["red", "green", "blue sky"]
    regex = r"[a-z]{3,5}-[0-9]{2}"
    answers: dict[str, list[str]] = {}
    for mode in MODES:
        client = clients(cluster)[mode]
        answers[mode] = []
        for seed in range(3):  # seeded sampling: P's first token and D's rest are what one node samples
            sampled: dict[str, Any] = {"model": cluster.model.name, "prompt": "Colour:", "max_tokens": 24,
                                       "temperature": 1.0, "seed": seed}
            choice = client.completions.create(**sampled, extra_body={"structured_outputs": {"choice": choices}})
            old_choice = client.completions.create(**sampled, extra_body={"guided_choice": choices})
            pattern = client.completions.create(**sampled, extra_body={"guided_regex": regex})
            grammar = client.completions.create(**sampled, extra_body={
                "structured_outputs": {"grammar": 'root ::= "#" [0-9a-f]{6} | "none"'}})
            answers[mode] += [r.choices[0].text for r in (choice, old_choice, pattern, grammar)]
        obj = client.chat.completions.create(model=cluster.model.name, messages=PET, max_tokens=40, temperature=1.0,
                                             seed=11, response_format={"type": "json_object"}, extra_body=COMPACT)
        answers[mode].append(obj.choices[0].message.content or "")
    for mode in MODES:
        texts = answers[mode]
        assert all(text in choices for text in texts[0:-1:4] + texts[1:-1:4])
        assert texts[0:-1:4] == texts[1:-1:4]  # the old name is the same constraint
        assert all(re.fullmatch(regex, text) for text in texts[2:-1:4])
        assert all(re.fullmatch(r"#[0-9a-f]{6}|none", text) for text in texts[3:-1:4])
    assert answers["disaggregated"] == answers["colocated"]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example costs real generations
@given(schema=bounded_schemas())
def test_answers_to_hypothesis_schemas_validate_in_both_routing_modes(cluster: Cluster, schema: dict[str, Any]
                                                                     ) -> None:
    for mode in MODES:
        r = clients(cluster)[mode].completions.create(model=cluster.model.name, prompt="JSON:", max_tokens=200,
                                                    temperature=0, extra_body={
                                                        "response_format": json_schema_format(schema), **COMPACT})
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_a_constraint_that_does_not_compile_is_a_400_with_the_reason(cluster: Cluster) -> None:
    for mode in MODES:
        client = clients(cluster)[mode]
        # refused at the proxy: not a JSON schema at all
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=cluster.model.name, messages=PET, max_tokens=8,
                                           response_format=json_schema_format({"type": "nonsense"}))
        assert e.value.param == "response_format" and "not a valid JSON schema" in e.value.message
        # refused by the node that compiles it: xgrammar's own limits
        for extra, reason in (({"guided_regex": "a(?=b)"}, "Lookahead"),
                              ({"structured_outputs": {"grammar": "root ::= missing"}}, 'Rule "missing"'),
                              ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}},
                               "none")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=cluster.model.name, prompt="x", max_tokens=8, extra_body=extra)
            assert reason in e.value.message and e.value.code == "invalid_argument", e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=cluster.model.name, prompt="x", max_tokens=8,
                                      extra_body={"guided_regex": "a", "guided_choice": ["b"]})
        assert "only one structured output constraint" in e.value.message
        # the nodes are fine
        ok = client.completions.create(model=cluster.model.name, prompt="x", max_tokens=8,
                                       extra_body={"guided_choice": ["fine"]})
        assert ok.choices[0].text == "fine"
