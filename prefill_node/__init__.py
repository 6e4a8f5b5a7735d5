"""The prefill node: computes prompts' KV cache and first token, holds the blocks under a lease."""
