"""The host KV tier: its index (LRU, pins, token checks), the KV manager's spills and loads, and the engine's
tokens with the tier on equal transformers' (float32, greedy) where its prefix hits came from host memory."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache.host_tier import HostTier
from engine.cache.kv_cache_manager import KVCacheManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampler import SampledToken
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.unit.test_engine_parity import mixed_prompts

H = [bytes([i]) * 16 for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# ---- the index ----
def test_the_host_tier_evicts_the_least_recently_used_block() -> None:
    tier = HostTier(2)
    a, b = tier.reserve(H[0], [0]), tier.reserve(H[1], [1])
    assert {a, b} == {0, 1}
    assert tier.lookup(H[0], [0]) == a  # H[0] is now the most recently used
    c = tier.reserve(H[2], [2])
    assert c == b and H[1] not in tier and tier.lookup(H[0], [0]) == a
    assert tier.stats.num_evicted == 1 and tier.num_used == 2


def test_a_pinned_slot_is_never_evicted_and_a_full_pinned_tier_takes_nothing() -> None:
    tier = HostTier(2)
    a, b = tier.reserve(H[0], [0]), tier.reserve(H[1], [1])
    assert a is not None and b is not None
    tier.pin(a)
    assert tier.reserve(H[2], [2]) == b  # H[0] is older, but pinned
    tier.pin(b)
    assert tier.reserve(H[3], [3]) is None and H[3] not in tier
    tier.unpin(a)
    assert tier.reserve(H[3], [3]) == a


def test_a_hit_is_checked_against_the_token_ids_and_a_discarded_block_frees_its_slot() -> None:
    tier = HostTier(1)
    slot = tier.reserve(H[0], [1, 2])
    assert tier.lookup(H[0], [1, 3]) is None and tier.lookup(H[0], [1, 2]) == slot
    assert tier.reserve(H[0], [1, 2]) is None  # already held
    tier.discard(H[0])
    assert H[0] not in tier and tier.reserve(H[1], [5]) == slot


# ---- the KV manager's plan ----
def _computed(kv: KVCacheManager, token_ids: list[int], request_id: str) -> Request:
    request = Request(request_id, token_ids, SamplingParams())
    assert kv.allocate(request, len(token_ids))
    request.num_computed_tokens = len(token_ids)
    kv.cache_computed_blocks(request)
    return request


def test_blocks_the_pool_hands_out_again_spill_and_a_later_prefix_loads_them_back() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True, hash_seed="s")
    kv.attach_host_tier(HostTier(4))
    first = _computed(kv, [1, 2, 3, 4, 5], "a")  # 2 full blocks and a partial one
    first_blocks = list(first.block_ids)
    kv.free(first)
    assert not kv.take_copies()
    _computed(kv, [7, 8, 9, 10, 11], "b")  # takes every block: the two cached ones spill
    copies = kv.take_copies()
    assert sorted(b for b, _ in copies.spills) == sorted(first_blocks[:2]) and not copies.loads
    assert kv.host is not None and kv.host.num_used == 2

    again = Request("c", [1, 2, 3, 4, 6], SamplingParams())
    hit = kv.find_cached_prefix(again)
    assert hit.blocks == [] and len(hit.host_slots) == 2
    spilled_slots = {b: s for b, s in copies.spills}
    assert hit.host_slots == [spilled_slots[first_blocks[0]], spilled_slots[first_blocks[1]]]


def test_a_load_targets_the_new_blocks_in_order_and_pins_until_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, hash_seed="s")
    host = HostTier(4)
    kv.attach_host_tier(host)
    first = _computed(kv, [1, 2, 3, 4, 5], "a")
    kv.free(first)
    _computed(kv, [7, 8, 9, 10, 11, 12, 13], "b")  # 4 blocks: all of a's spill
    kv.take_copies()
    again = Request("c", [1, 2, 3, 4, 6], SamplingParams())
    hit = kv.find_cached_prefix(again)
    assert not kv.allocate(again, 1, hit)  # b holds the whole pool: nothing changes, nothing pinned
    assert not kv.take_copies() and again.block_ids == []


def test_a_full_prefix_from_the_host_tier_counts_as_computed_tokens() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, hash_seed="s")
    host = HostTier(4)
    kv.attach_host_tier(host)
    kv.free(_computed(kv, [1, 2, 3, 4, 5], "a"))
    kv.free(_computed(kv, [7, 8, 9, 10, 11, 12, 13], "b"))
    spills = kv.take_copies().spills
    again = Request("c", [1, 2, 3, 4, 6], SamplingParams())
    hit = kv.find_cached_prefix(again)
    assert len(hit.host_slots) == 2
    assert kv.allocate(again, 1, hit)
    kv.record_lookup(again.num_tokens, hit)
    assert again.num_computed_tokens == 4 and len(again.block_ids) == 3
    copies = kv.take_copies()
    # the loads' targets held two of b's cached blocks (its partial block went first): they spill, in the same plan
    assert [b for _, b in copies.loads] == again.block_ids[:2] and [s for s, _ in copies.loads] == hit.host_slots
    assert len(copies.spills) == 2 and not set(s for _, s in copies.spills) & set(hit.host_slots)
    assert kv.num_host_hit_tokens == 4 and kv.num_hit_tokens == 0 and spills


# ---- the engine: tokens with the tier equal transformers' ----
def test_prefix_hits_from_host_memory_give_transformers_tokens(tiny_model: TinyModelFactory,
                                                               async_scheduling: bool) -> None:
    check_host_tier_hits(tiny_model, async_scheduling, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefix_hits_from_pinned_host_memory_on_a_gpu(tiny_model: TinyModelFactory) -> None:
    """Spills and loads as asynchronous copies on the step's stream, with asynchronous scheduling on."""
    check_host_tier_hits(tiny_model, True, "cuda")


def check_host_tier_hits(tiny_model: TinyModelFactory, async_scheduling: bool, device: str) -> None:
    model = tiny_model("qwen2")
    # 8 blocks of 4 tokens: one 17-token prompt and its output fill 6, so each prompt evicts the one before
    kwargs = dict(model=str(model), dtype="float32", block_size=4, num_kv_blocks=8, async_scheduling=async_scheduling,
                  device=device)
    with_tier = LLM(**kwargs, kv_offloading_bytes=64 * with_block_bytes(model))
    without = LLM(**kwargs)
    prompts = mixed_prompts(1000, lengths=(17, 17, 17), seed=5)
    expected = hf_greedy(model, prompts, GREEDY.max_tokens)
    for llm in (with_tier, without):
        for prompt, tokens in zip(prompts, expected, strict=True):
            assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == tokens
    again = [with_tier.generate([p], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [16, 16, 16]  # 4 of 4 full blocks, from the host tier
    stats = with_tier.engine.stats().host_tier
    assert stats is not None and stats.hit_tokens >= 32 and stats.num_loaded >= 8 and stats.num_spilled >= 8
    assert with_tier.engine.kv.num_free_blocks == 8
    assert without.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0  # evicted, recomputed


def with_block_bytes(model: object) -> int:
    config = EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=2, device="cpu")
    return LLMEngine(config).runner.kv_cache[0].numel() * 4


def test_a_decode_node_takes_a_prompt_prefix_from_its_host_tier(tiny_model: TinyModelFactory,
                                                                 async_scheduling: bool) -> None:
    """What a decode node does when a follow-up's prefix sits in its host tier: only the rest is pulled."""
    model = tiny_model("llama")
    config = EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=8,
                          async_scheduling=async_scheduling, kv_offloading_bytes=1 << 20)
    decode = LLMEngine(config)
    prefill = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, async_scheduling=False))
    prompt, other = mixed_prompts(1000, lengths=(13, 25), seed=6)
    for engine in (decode, prefill):
        engine.add_request("warm", prompt, GREEDY)
        while engine.has_unfinished():
            engine.step()
    decode.add_request("evict", other, GREEDY)  # 25 + 6 tokens: every block, so the prompt's spill
    while decode.has_unfinished():
        decode.step()
    request = prefill.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                  pin_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    pinned = prefill.pinned_blocks("p")
    assert pinned is not None
    incoming = decode.make_request("d", prompt, GREEDY)
    reserved = decode.reserve_remote_kv(incoming)
    assert reserved is not None and reserved.num_cached_blocks == 3  # 12 of 13 tokens: from host memory
    rest = reserved.block_ids[3:]
    decode.kv_cache[rest] = prefill.kv_cache[list(pinned.block_ids)[3:]]
    assert not decode.admit_remote_kv("d", SampledToken(request.token_ids[-1])).finished
    while decode.has_unfinished():
        decode.step()
    assert incoming.output_token_ids == hf_greedy(model, [prompt], GREEDY.max_tokens)[0]
    assert decode.kv.num_free_blocks == 8


def test_a_host_tier_size_is_checked_and_refused_with_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="kv_offloading_bytes must be a non-negative int"):
        EngineConfig(model="m", kv_offloading_bytes=-1)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model="m", kv_offloading_bytes=1 << 30, tensor_parallel_size=2)
