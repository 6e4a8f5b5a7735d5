from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kernels.backend import DENSE_LENGTH_BUCKET, TritonAttention, dense_causal_attention
from engine.layers.attention import AttentionMetadata, TorchAttention
from tests.kernels.paged import TOLERANCE, int32, make_block_tables, make_cache, relative_error

gpu = pytest.mark.gpu


def _step(query_lens: list[int], seq_lens: list[int], num_decodes: int, block_size: int, num_blocks: int,
          sliding_window: int | None, device: str) -> AttentionMetadata:
    """Metadata of one engine step: decodes first (one query each), then prefill chunks."""
    assert all(n == 1 for n in query_lens[:num_decodes])
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, device)
    starts = [sum(query_lens[:b]) for b in range(len(query_lens) + 1)]
    slots = []
    for b, (num_queries, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(seq_len - num_queries, seq_len):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=int32(starts, device), seq_lens=int32(seq_lens, device), block_tables=block_tables,
        num_decodes=num_decodes, query_start_loc_host=starts, seq_lens_host=seq_lens,
        sliding_window=sliding_window,
    )


def _check_backend(query_lens: list[int], seq_lens: list[int], num_decodes: int, num_heads: int,
                   num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   sliding_window: int | None, device: str, backend: TritonAttention | None = None) -> None:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    torch_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    triton_cache = torch_cache.clone()
    meta = _step(query_lens, seq_lens, num_decodes, block_size, num_blocks, sliding_window, device)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    expected = TorchAttention().forward(q, k, v, torch_cache.k, torch_cache.v, meta, scale)
    out = (backend or TritonAttention()).forward(q, k, v, triton_cache.k, triton_cache.v, meta, scale)
    assert torch.equal(triton_cache.kv, torch_cache.kv)
    assert relative_error(out.float(), expected.float()) < TOLERANCE[dtype]


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_triton_backend_matches_torch_backend_on_a_mixed_step(sliding_window: int | None) -> None:
    # two decodes, a fresh prompt, a prefix-cache hit and a later chunk of a chunked prefill
    _check_backend([1, 1, 13, 5, 8], [21, 4, 13, 30, 24], 2, 4, 2, 32, 4, torch.float32, sliding_window, "cpu")


def test_triton_backend_decode_only_and_prefill_only_steps() -> None:
    _check_backend([1, 1, 1], [3, 17, 40], 3, 4, 1, 32, 16, torch.float32, None, "cpu")
    _check_backend([6, 10], [6, 19], 0, 2, 2, 32, 16, torch.float32, None, "cpu")


def test_triton_backend_bf16() -> None:
    _check_backend([1, 9], [33, 20], 1, 4, 2, 32, 16, torch.bfloat16, None, "cpu")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("sliding_window", [None, 512])
def test_triton_backend_on_gpu_matches_torch_backend(dtype: torch.dtype, sliding_window: int | None) -> None:
    query_lens = [1] * 16 + [2000, 700, 512]
    seq_lens = [100 * i + 1 for i in range(1, 17)] + [2000, 3100, 4096]
    _check_backend(query_lens, seq_lens, 16, 32, 8, 128, 16, dtype, sliding_window, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_backend_on_gpu_one_long_fresh_prompt(dtype: torch.dtype) -> None:
    """A step that is one fresh prompt long enough for the dense path returns its result directly."""
    _check_backend([1500], [1500], 0, 32, 8, 128, 16, dtype, None, "cuda")
    _check_backend([1500, 1200], [1500, 1200], 0, 32, 8, 128, 16, dtype, None, "cuda")


@gpu
def test_triton_backend_on_gpu_batches_fresh_prompts_of_one_length() -> None:
    # decodes, then four and three fresh prompts of two lengths (batches of 4, 2 and 1), one of a padded length
    query_lens = [1] * 3 + [1024] * 4 + [1280] * 3 + [1100]
    _check_backend(query_lens, [700, 90, 2000] + query_lens[3:], 3, 32, 8, 128, 16, torch.bfloat16, None, "cuda")
    _check_backend([1024] * 8, [1024] * 8, 0, 32, 8, 128, 16, torch.bfloat16, None, "cuda")


class _DenseOnAnyDevice(TritonAttention):
    """The dense path's choices on the CPU (in a real engine it runs on a GPU only)."""

    def _dense_from(self, q: torch.Tensor, meta: AttentionMetadata) -> int:
        return self.dense_prefill_min_tokens


@pytest.mark.parametrize(("query_lens", "seq_lens", "num_decodes", "calls"), [
    # two decodes; prompts of 256 (no padding): a batch of 2, then one left over; a padded length alone; a
    # prefix hit for the paged kernel
    ([1, 1, 256, 256, 256, 300, 256, 5], [40, 9, 256, 256, 256, 300, 256, 30], 2,
     [(512, 2), (256, 1), (300, 1), (256, 1)]),
    # the step is four fresh prompts of one length: one call, its result returned as the output
    ([256] * 4, [256] * 4, 0, [(1024, 4)]),
])
def test_fresh_prompts_of_one_length_are_attended_in_batches_of_powers_of_two(
        monkeypatch: pytest.MonkeyPatch, query_lens: list[int], seq_lens: list[int], num_decodes: int,
        calls: list[tuple[int, int]]) -> None:
    from engine.kernels import backend as backend_module

    made: list[tuple[int, int]] = []
    dense = backend_module.dense_causal_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_seqs: int = 1):
        made.append((q.shape[0], num_seqs))
        return dense(q, k, v, scale, num_seqs)

    monkeypatch.setattr(backend_module, "dense_causal_attention", recording)
    _check_backend(query_lens, seq_lens, num_decodes, 4, 2, 32, 16, torch.float32, None, "cpu",
                   backend=_DenseOnAnyDevice(dense_prefill_min_tokens=256))
    assert made == calls


def test_a_step_is_planned_once_for_all_its_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import backend as backend_module

    plans: list[AttentionMetadata] = []
    plan = backend_module.plan_dense_batches

    def recording(meta: AttentionMetadata, dense_from: int):
        plans.append(meta)
        return plan(meta, dense_from)

    monkeypatch.setattr(backend_module, "plan_dense_batches", recording)
    backend = _DenseOnAnyDevice(dense_prefill_min_tokens=256)
    query_lens, seq_lens = [1, 256, 256], [20, 256, 256]
    cache = make_cache(64, 16, 2, 32, torch.float32, "cpu")
    q, k, v = torch.randn(513, 4, 32), torch.randn(513, 2, 32), torch.randn(513, 2, 32)
    first = _step(query_lens, seq_lens, 1, 16, 64, None, "cpu")
    steps = [first, dataclasses.replace(first)]  # the next step: equal contents, a new object
    outs = [backend.forward(q, k, v, cache.k, cache.v, meta, 32 ** -0.5) for meta in (steps[0], steps[0], steps[1])]
    assert plans == [steps[0], steps[1]] and plans[0] is steps[0] and plans[1] is steps[1]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_dense_attention_of_several_sequences_is_each_alone() -> None:
    qkv = torch.randn(3 * 256, 4 + 2 + 2, 32, dtype=torch.float64)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = dense_causal_attention(q, k, v, 32 ** -0.5, num_seqs=3)
    for b in range(3):
        rows = slice(256 * b, 256 * (b + 1))
        assert torch.equal(out[rows], dense_causal_attention(q[rows], k[rows], v[rows], 32 ** -0.5))


def test_dense_attention_padding_leaves_the_real_rows_exact() -> None:
    # 300 tokens run as 512 (padding at the end): under the causal mask no real row sees a padding key
    num_tokens = 300
    assert num_tokens % DENSE_LENGTH_BUCKET
    qkv = torch.randn(num_tokens, 4 + 2 + 2, 32, dtype=torch.float64)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]  # views of a fused projection, as the model passes them
    out = dense_causal_attention(q, k, v, 32 ** -0.5)
    assert out.shape == (num_tokens, 4, 32)
    keys = k.repeat_interleave(2, dim=1)  # query head h reads KV head h // 2
    values = v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 32 ** -0.5
    scores.masked_fill_(torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    assert relative_error(out, expected) < 1e-12


def _compiled_kernels() -> tuple[list[str], object]:
    import triton

    compiled: list[str] = []
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, fn, **_) -> None:
        compiled.append(fn.name)

    triton.knobs.runtime.jit_cache_hook = hook
    return compiled, previous


@gpu
def test_attention_kernels_compile_once_for_every_step_shape() -> None:
    """A step's metadata is sliced past its decodes and its block table is as wide as its longest context: none of
    that may make Triton compile another variant of a kernel (over a second inside a serving step)."""
    import triton

    def step(num_decodes: int, prompt_context: int) -> None:
        decode_lens = [300 + 37 * i for i in range(num_decodes)]
        _check_backend([1] * num_decodes + [20, 9], decode_lens + [20, prompt_context], num_decodes, 8, 2, 64, 16,
                       torch.bfloat16, None, "cuda")

    step(2, 40)  # the first step compiles
    compiled, previous = _compiled_kernels()
    try:
        for num_decodes, prompt_context in [(1, 41), (3, 200), (4, 257), (5, 512), (7, 513)]:
            step(num_decodes, prompt_context)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert compiled == []
