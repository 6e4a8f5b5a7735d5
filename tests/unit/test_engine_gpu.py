"""The engine's GPU path (Triton kernels, fused layers, CUDA graphs) against transformers. Needs CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def prompts_of(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_gpu_greedy_matches_transformers_in_float32(tiny_model: TinyModelFactory, arch: str,
                                                    enforce_eager: bool, async_scheduling: bool) -> None:
    model = tiny_model(arch, **({"sliding_window": 8} if arch == "mistral" else {}))
    llm = LLM(model=str(model), dtype="float32", block_size=16, max_num_batched_tokens=32,
              enforce_eager=enforce_eager, max_num_seqs=8, async_scheduling=async_scheduling)
    assert llm.engine.async_scheduling == async_scheduling
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and type(runner.backend).__name__ == "TritonAttention"
    assert (runner.graphs is None) == enforce_eager
    prompts = prompts_of((1, 5, 17, 40, 70))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == hf_greedy(model, prompts, 12)


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_batch_one_decode_matches_transformers_in_float32(tiny_model: TinyModelFactory, arch: str,
                                                              enforce_eager: bool) -> None:
    # one request alone: every decode step is one token, where the norms, the projections and SiLU-and-mul
    # run as the fused GEMV kernels (engine/kernels/gemv.py); qwen2 adds the qkv bias
    model = tiny_model(arch)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=enforce_eager, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt in prompts_of((1, 23)):
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(model, [prompt], 16)[0]


def test_gpu_first_requests_compile_no_kernel(tiny_model: TinyModelFactory) -> None:
    """The start-up warm-up (ModelRunner._warm_up) and kernels that do not specialise on a step's shape: the
    first requests - decodes beside prompts, a chunk after its cached prefix, a prompt long enough for the dense
    path - compile no Triton kernel (each compilation is over a second inside a step)."""
    import triton

    model = tiny_model("llama", max_position_embeddings=2048)
    llm = LLM(model=str(model), dtype="bfloat16", max_num_batched_tokens=1536, max_num_seqs=8)
    compiled: list[str] = []
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, fn, **_) -> None:
        compiled.append(fn.name)

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        outputs = llm.generate(prompts_of((3, 40, 1100, 1300, 700, 17)),
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6] * 6
    assert compiled == []


def test_gpu_bfloat16_agrees_on_the_first_tokens(tiny_model: TinyModelFactory) -> None:
    model = tiny_model("llama")
    prompts = prompts_of((9, 33))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM(model=str(model), dtype="bfloat16").generate(prompts, params)]
    assert [t[:1] for t in got] == [t[:1] for t in hf_greedy(model, prompts, 3)]


def test_gpu_seeded_sampling_is_batch_invariant(tiny_model: TinyModelFactory) -> None:
    llm = LLM(model=str(tiny_model("llama")), dtype="bfloat16", max_num_seqs=8)
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=10, seed=3, ignore_eos=True)
    target = prompts_of((12,))[0]
    alone = llm.generate([target], seeded)[0].outputs[0].token_ids
    crowd = llm.generate(prompts_of((4, 20, 7)) + [target],
                         [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3 + [seeded])
    assert crowd[3].outputs[0].token_ids == alone


def test_gpu_graph_padding_rows_touch_no_block_of_the_pool(tiny_model: TinyModelFactory) -> None:
    # 3 decoding requests replay the graph of bucket 4: one padding row, whose K/V must land outside the pool
    # (a slot of -1 would wrap around to the last block with the torch backend).
    llm = LLM(model=str(tiny_model("llama")), dtype="float32", block_size=16, num_kv_blocks=32, max_num_seqs=8,
              attention_backend="torch")
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.bucket(3) == 4
    runner.kv_cache[-1].fill_(7.0)  # the last block: short prompts never get it from the pool
    prompts = prompts_of((5, 9, 3))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                ignore_eos=True))]
    assert bool((runner.kv_cache[-1] == 7.0).all()), "a padding row wrote into the pool's last block"
    assert got == hf_greedy(tiny_model("llama"), prompts, 6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=3, max_tokens=10, min_tokens=4,
                   logprobs=2, ignore_eos=True),
], ids=["greedy", "seeded-logprobs-min-tokens"])
def test_gpu_async_decode_launch_never_waits_for_the_device(tiny_model: TinyModelFactory,
                                                           params: SamplingParams) -> None:
    """Launching a decode step (inputs, graph replay, sampling, the copies back) must not synchronise: any
    .item(), .tolist() or pageable copy would make torch's sync debug mode raise. Outputs equal the
    synchronous engine's."""
    model = str(tiny_model("llama"))
    prompts = prompts_of((5, 9, 13))
    expected = LLM(model=model, dtype="float32", max_num_seqs=8, async_scheduling=False).generate(prompts, params)
    llm = LLM(model=model, dtype="float32", max_num_seqs=8, async_scheduling=True)
    runner = llm.engine.runner
    execute = runner.execute
    num_checked = [0]

    def execute_without_sync(batch):  # type: ignore[no-untyped-def]
        decode_only = all(item.num_new_tokens == 1 for item in batch.scheduled)
        torch.cuda.set_sync_debug_mode("error" if decode_only else "default")
        try:
            return execute(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            num_checked[0] += decode_only

    runner.execute = execute_without_sync  # type: ignore[method-assign]
    got = llm.generate(prompts, params)
    assert num_checked[0] >= 8
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in expected]


def test_gpu_async_mixed_launch_never_waits_for_the_device(tiny_model: TinyModelFactory) -> None:
    """Steps with prompt tokens too (fresh prompts, a chunk after its cached prefix, a prompt for the dense path,
    decodes beside them): a launch that synchronised would leave the device idle while the host launches the
    rest of an eager step (torch's sync debug mode raises on any). In bfloat16, so the dense path runs."""
    model = str(tiny_model("llama", max_position_embeddings=2048))
    prompts = prompts_of((5, 300, 1100, 40, 9))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=model, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=1280, async_scheduling=True)
    execute = llm.engine.runner.execute
    num_mixed = [0]

    def execute_without_sync(batch):  # type: ignore[no-untyped-def]
        num_mixed[0] += any(item.num_new_tokens > 1 for item in batch.scheduled)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    llm.engine.runner.execute = execute_without_sync  # type: ignore[method-assign]
    got = llm.generate(prompts, params)
    assert num_mixed[0] >= 2
    assert [len(o.outputs[0].token_ids) for o in got] == [8] * len(prompts)
