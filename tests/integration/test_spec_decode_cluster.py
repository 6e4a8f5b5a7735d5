"""N-gram speculation on the decode node of a P/D cluster: greedy completions through the proxy, disaggregated
(P samples the first token, D drafts and verifies the rest), equal transformers' text, and the proxy's /metrics
counts the drafts and the accepted tokens as vLLM names them."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.fixtures.spec_models import echo_prone_model
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.openai_cluster import Cluster, all_resources_free, running_cluster, wait_until

pytestmark = pytest.mark.integration

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 24
ACCEPTED = "tandem:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "tandem:spec_decode_num_draft_tokens_total"
DRAFTS = "tandem:spec_decode_num_drafts_total"


@pytest.fixture(scope="module")
def model(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return echo_prone_model(tiny_model("llama"), tmp_path_factory.mktemp("spec-cluster") / "echo")


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(model, tmp_path_factory.mktemp("spec-cluster-logs"), with_guarded_proxy=False,
                         decode_args=["--speculative-config", json.dumps(SPEC)]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def prompt(model: Path) -> list[int]:
    """A head, the oracle's greedy continuation and the head again: the model follows the earlier run."""
    rng = random.Random(2)
    head = [rng.randrange(3, 900) for _ in range(8)]
    return head + hf_greedy(model, [head], 24)[0] + head


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_equals_transformers_and_the_acceptance_counters_move(
        cluster: Cluster, model: Path, prompt: list[int], stream: bool) -> None:
    expected = AutoTokenizer.from_pretrained(str(model)).decode(hf_greedy(model, [prompt], MAX_TOKENS)[0],
                                                                skip_special_tokens=True)
    before = {name: cluster.metric(name, role="decode") for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    body = {"model": model.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    if stream:
        text = "".join(chunk.choices[0].text for chunk in cluster.client().completions.create(**body, stream=True))
    else:
        text = cluster.client().completions.create(**body).choices[0].text
    assert text == expected
    after = {name: cluster.metric(name, role="decode") for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
    assert after[DRAFTS] > before[DRAFTS]
    assert 0 < after[ACCEPTED] - before[ACCEPTED] <= after[DRAFT_TOKENS] - before[DRAFT_TOKENS]
    stats = cluster.stats("decode")  # the node's own Stats, which the proxy's counters come from
    assert stats.spec_decode_num_accepted_tokens == after[ACCEPTED]
    wait_until(lambda: all_resources_free(cluster))  # rolled-back drafts leave no block behind
