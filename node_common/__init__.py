"""What the prefill and decode nodes share: command-line options, the engine thread, the KV connector setup."""
