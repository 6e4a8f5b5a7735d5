"""The decode node: pulls a prompt's KV blocks from a prefill node and generates the rest of the tokens."""
