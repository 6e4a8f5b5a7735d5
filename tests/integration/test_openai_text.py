"""Stop strings and EOS text through the proxy, against oracles only: transformers' greedy tokens (float32) of a
tiny model made to reach EOS on its own, and the tokenizer's decode. Offline (LLM) and online (the proxy, which
detokenizes what the nodes send) must give the same text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine import LLM, FinishReason, SamplingParams
from tests.fixtures.text_cases import model_that_ends_early, stop_string_spanning_tokens
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.openai_cluster import Cluster, all_resources_free, running_cluster, wait_until

pytestmark = pytest.mark.integration

PROMPT = [235, 382, 988, 387, 132, 200]
EOS_TOKEN_ID = 0  # <|endoftext|>, a special token of the tiny tokenizer
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_that_ends_early(tiny_model("llama"), tmp_path_factory.mktemp("early-eos") / "model", PROMPT,
                                 position=4, eos_token_id=EOS_TOKEN_ID)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(model, tmp_path_factory.mktemp("openai-text-logs"), with_guarded_proxy=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def greedy(model: Path) -> list[int]:
    """The oracle's greedy tokens, EOS being just another token (as with ignore_eos)."""
    token_ids = hf_greedy(model, [PROMPT], MAX_TOKENS)[0]
    assert 2 <= token_ids.index(EOS_TOKEN_ID) < MAX_TOKENS - 1, f"the model should reach EOS early: {token_ids}"
    return token_ids


def completion_text(cluster: Cluster, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    """The text and finish_reason of one greedy completion of PROMPT, whole or streamed."""
    body: dict[str, Any] = {"model": cluster.model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                            "temperature": 0, **kwargs}
    client = cluster.client()
    if not stream:
        choice = client.completions.create(**body).choices[0]
        return choice.text, choice.finish_reason
    chunks = list(client.completions.create(**body, stream=True))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_spanning_tokens_ends_the_text_where_the_tokenizer_puts_it(
        cluster: Cluster, tokenizer: Any, greedy: list[int], stream: bool, include_stop_str_in_output: bool) -> None:
    case = stop_string_spanning_tokens(tokenizer, greedy)
    text, finish_reason = completion_text(
        cluster, stream, stop=[case.stop, "never there"],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": include_stop_str_in_output})
    assert text == case.text + (case.stop if include_stop_str_in_output else "")
    assert finish_reason == "stop"
    wait_until(lambda: all_resources_free(cluster))  # the nodes were told to stop


def test_a_stop_string_counts_the_tokens_up_to_the_one_that_completes_it(
        cluster: Cluster, tokenizer: Any, greedy: list[int]) -> None:
    case = stop_string_spanning_tokens(tokenizer, greedy)
    r = cluster.client().completions.create(model=cluster.model.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stop=case.stop, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == case.num_tokens


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_online_and_offline_show_the_same_text_when_eos_ends_the_request(
        cluster: Cluster, llm: LLM, tokenizer: Any, greedy: list[int], skip_special_tokens: bool,
        include_stop_str_in_output: bool) -> None:
    up_to_eos = greedy[: greedy.index(EOS_TOKEN_ID) + 1]
    shown = up_to_eos if include_stop_str_in_output else up_to_eos[:-1]
    expected = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
    options = {"skip_special_tokens": skip_special_tokens, "include_stop_str_in_output": include_stop_str_in_output}
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **options))[0].outputs[0]
    assert offline.token_ids == up_to_eos and offline.text == expected
    assert offline.finish_reason == FinishReason.STOP and offline.stop_reason is None
    for stream in (False, True):
        assert completion_text(cluster, stream, extra_body=options) == (expected, "stop")
