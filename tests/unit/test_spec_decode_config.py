"""speculative_config as vLLM's users write it (offline dict, node and `tandem serve` JSON flag), validated with a clear
error before anything starts; the n-gram proposer's lookups; the scheduler's drafts, their limits and the rollback of
rejected ones."""

from __future__ import annotations

import argparse
import random

import pytest

from cluster.pools import NodeLaunch, node_command
from engine.cache.kv_cache_manager import KVCacheManager
from engine.config import EngineConfig
from engine.request import Request
from engine.sampler import SampledToken
from engine.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.types import FinishReason, SamplingParams
from node_common.options import add_node_args, engine_config, parse_node_args
from settings import TREE_KEYS, ConfigError, ServeConfig, add_arguments, resolve

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.mark.parametrize(("given", "expected"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
     SpeculativeConfig(3, prompt_lookup_max=4, prompt_lookup_min=2)),
    (NGRAM, SpeculativeConfig(3, prompt_lookup_max=4, prompt_lookup_min=2)),
    # vLLM's defaults: one bound sets the other, none gives 5 and 5
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, SpeculativeConfig(2, 4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3}, SpeculativeConfig(2, 3, 3)),
    ({"method": "ngram", "num_speculative_tokens": 2}, SpeculativeConfig(2, 5, 5)),
    (None, None),
])
def test_speculative_config_is_read_as_vllm_reads_it(given: object, expected: SpeculativeConfig | None) -> None:
    assert SpeculativeConfig.parse(given) == expected  # type: ignore[arg-type]
    assert EngineConfig(model="/m", speculative_config=given).speculative_config == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "message"), [
    ("{not json", "not valid JSON"),
    ("[4]", "expected a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, got 'eagle'"),
    ({"num_speculative_tokens": 2}, "'method' is required"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer >= 1, got '4'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key"),
])
def test_a_bad_speculative_config_is_refused_with_the_reason(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", speculative_config=given)  # type: ignore[arg-type]


def node(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parse_node_args(parser, ["--model", "/m", "--port", "1", *argv])


def serve_config(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServeConfig)
    return resolve(ServeConfig, vars(parser.parse_args(list(argv))), {}, TREE_KEYS)


def test_tandem_serve_hands_its_speculative_config_to_the_nodes() -> None:
    config = serve_config("--speculative-config", NGRAM, "--node-args", "--num-kv-blocks 64")
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.cluster,
                        extra_args=config.node_extra_args())
    command = node_command(launch, "decode", "decode-0", "127.0.0.1", 1)
    parsed = node(*command[5:])  # past `--model /m`
    assert engine_config(parsed).speculative_config == SpeculativeConfig(3, 4, 2)
    assert parsed.num_kv_blocks == 64
    assert engine_config(node()).speculative_config is None


def test_bad_speculative_configs_stop_a_node_and_tandem_serve_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        node("--speculative-config", '{"method": "ngram"}')
    assert "num_speculative_tokens' is required" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--speculative-config: speculative_config: not valid JSON"):
        serve_config("--speculative-config", "{4")


@pytest.mark.parametrize(("token_ids", "max_drafts", "expected"), [
    ([1, 2, 3, 9, 1, 2, 3], None, [9, 1, 2]),  # the 3-gram [1, 2, 3] recurs: what followed it
    ([1, 2, 3, 9, 7, 2, 3], None, [9, 7, 2]),  # no 3-gram: the 2-gram [2, 3]
    ([5, 1, 8, 5, 2, 8, 5], None, [2, 8, 5]),  # the latest occurrence of [8, 5] wins
    ([1, 2, 3, 9, 1, 2, 3], 1, [9]),  # capped by the step's room
    ([4, 5, 6, 7], None, []),  # the tail never occurred before
    ([3, 3], None, []),  # shorter than prompt_lookup_min + 1
])
def test_the_proposer_drafts_what_followed_the_tail_earlier(token_ids: list[int], max_drafts: int | None,
                                                             expected: list[int]) -> None:
    assert NgramProposer(3, prompt_lookup_min=2, prompt_lookup_max=3).propose(token_ids, max_drafts) == expected


def scheduler_with(request: Request, block_size: int = 4) -> Scheduler:
    scheduler = Scheduler(KVCacheManager(64, block_size, True, "seed"), 64, 4, NgramProposer(3, 1, 2))
    scheduler.add(request)
    return scheduler


def test_rejected_drafts_are_rolled_back_and_accepted_ones_appended() -> None:
    prompt = [7, 8, 9, 10, 11, 7, 8]  # the tail [7, 8] recurs: drafts 9, 10, 11
    request = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20), max_num_tokens=100)
    scheduler = scheduler_with(request)
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, {"r": [SampledToken(9)]})  # the prompt's step: no drafts
    assert request.token_ids[-1] == 9 and request.num_computed_tokens == len(prompt)
    step = scheduler.schedule()
    (item,) = step.scheduled
    assert item.draft_token_ids == (10, 11, 7) and item.num_new_tokens == 4
    assert len(request.block_ids) * 4 >= len(prompt) + 1 + 3  # room for the drafts' K/V
    # samples at the four positions: 10 confirms draft 1, 12 rejects draft 2 and replaces it
    outputs = scheduler.update_from_output(step, {"r": [SampledToken(10), SampledToken(12), SampledToken(5),
                                                        SampledToken(6)]})
    assert [o.token_id for o in outputs] == [10, 12]
    assert request.token_ids == [*prompt, 9, 10, 12]
    assert request.num_computed_tokens == len(prompt) + 2  # the 9 and the accepted 10; 12 is the next input
    assert (scheduler.spec_stats.num_drafts, scheduler.spec_stats.num_draft_tokens,
            scheduler.spec_stats.num_accepted_tokens) == (1, 3, 1)


def test_drafts_never_run_past_max_tokens_and_a_stop_among_accepted_ones_ends_the_request() -> None:
    prompt = [7, 8, 9, 10, 11, 7, 8]
    request = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[10]),
                      max_num_tokens=100)
    scheduler = scheduler_with(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": [SampledToken(9)]})
    step = scheduler.schedule()
    assert step.scheduled[0].draft_token_ids == (10,)  # two tokens left: one draft and the token after it
    outputs = scheduler.update_from_output(step, {"r": [SampledToken(10), SampledToken(11)]})
    assert [(o.token_id, o.finish_reason) for o in outputs] == [(10, FinishReason.STOP)]
    assert request.status.is_finished and scheduler.kv.num_free_blocks == 64


def test_the_proposer_agrees_with_a_brute_force_search_on_random_tokens() -> None:
    def brute_force(token_ids: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
        for n in range(min(lookup_max, len(token_ids) - 1), lookup_min - 1, -1):
            for start in range(len(token_ids) - n - 1, -1, -1):  # latest first, each followed by a token
                if token_ids[start:start + n] == token_ids[-n:]:
                    return token_ids[start + n:start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(500):
        token_ids = [rng.randrange(rng.choice([2, 3, 20])) for _ in range(rng.randrange(1, 50))]
        lookup_min = rng.randrange(1, 4)
        lookup_max, k = lookup_min + rng.randrange(3), rng.randrange(1, 6)
        assert (NgramProposer(k, lookup_min, lookup_max).propose(token_ids)
                == brute_force(token_ids, lookup_min, lookup_max, k)), (token_ids, lookup_min, lookup_max, k)
