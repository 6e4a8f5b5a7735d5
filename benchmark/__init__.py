"""`tandem bench serve`: a serving benchmark over the OpenAI API with vLLM's metric and result-file names.

Torch-free on purpose (httpx, numpy, tokenizers), so it runs from a laptop against any OpenAI-compatible server.

- `datasets`: the workloads (random, shared-prefix, multi-turn, long-prompt, a JSONL file) as `SampleRequest`s;
  multi-turn-session's as `Session`s.
- `sse`, `client`: one streamed request, timed (TTFT, inter-token latencies, end-to-end latency).
- `runner`: arrivals (Poisson or all at once), the concurrency limit, warm-up, the progress bar.
- `sessions`: multi-turn-session runs: conversations sent turn by turn with the server's replies in their history.
- `metrics`: completed/failed, throughputs, TTFT/TPOT/ITL/E2EL statistics, goodput, prompt-cache hits (usage),
  TTFT by session turn.
- `results`: the result file (vLLM's keys), the printed report, `compare`; `plots`: PNGs (matplotlib, optional).
- `cli`: `tandem bench serve | compare | plot`.
"""
