"""The OpenAI-compatible front door: tokenizes, routes prefill then decode, streams tokens back."""
