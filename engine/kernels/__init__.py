"""Triton kernels for the GPU path: paged KV store, decode and prefill attention, RMSNorm, RoPE, SiLU-and-mul.

Modules (each imports triton; this package's __init__ does not):
- kv_store: store_kv            - decode: paged_decode_attention (flash-decoding)
- prefill: paged_prefill_attention  - layers: rms_norm, rotary_embedding, silu_and_mul
- backend: TritonAttention (an engine.layers.attention.AttentionBackend)
- reference: plain-torch twins of every kernel, the tests' oracle
On CPU they run under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is imported.
- hopper_mlp: the MLP's gate_up GEMM with SiLU-and-mul in its epilogue, CUDA C++ for Hopper (hopper_mlp.cu), built
  with nvcc at first use and called through ctypes; imports no triton
"""
