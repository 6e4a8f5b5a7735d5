"""The measuring part of `tandem profile` (cluster/profile_cli.py): what to measure (`PointPlan`), the requests
through a cluster's proxy that measure the prefill, decode and handoff points (`Measurer`), and the node's capacity
as it publishes it in the registry.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import sys
from dataclasses import dataclass

import httpx

from benchmark.client import RequestOutput, RequestSettings
from benchmark.datasets import PromptSynthesizer, SampleRequest
from benchmark.profile import DecodePoint, Points, PrefillPoint
from benchmark.runner import LoadSettings, run_requests
from wire.nodes import NodeCapacity


class ProfileRunError(Exception):
    """A measurement that cannot be made; printed without a traceback."""


@dataclass(frozen=True)
class PointPlan:
    """What to measure."""

    prompt_lens: tuple[int, ...]  # prefill points: prompt lengths
    prefill_batches: tuple[int, ...]  # ... x prompts sent at once
    decode_batches: tuple[int, ...]  # decode points: requests decoding together
    decode_prompt: int  # ... their prompt
    decode_output: int  # ... and output tokens
    handoff_lens: tuple[int, ...]  # handoff points: prompt lengths
    repeats: int  # prefill and handoff points: runs per point (the median counts) ...
    point_tokens: int  # ... while they send at most this many prompt tokens; a prefill batch of more is left out

    def runs(self, prompt_tokens: int) -> int:
        return max(1, min(self.repeats, self.point_tokens // prompt_tokens))


# SmolLM2 float32, one thread per node, 2 cores: 2 min 50 s, a minute of it the nodes' start
# (bench/results/profile-cpu-smollm2-1thread.json)
DEFAULT_PLAN = PointPlan((32, 128, 512, 1024), (1, 4), (1, 4, 16), 64, 32, (32, 512), 3, 2048)
QUICK_PLAN = PointPlan((16, 64), (1, 2), (1, 4), 16, 8, (16, 64), 1, 2048)



@dataclass
class Measurer:
    """Requests through the proxy with the bench client; every prompt fresh random tokens (no prefix hit)."""

    url: str
    model: str
    synth: PromptSynthesizer
    api_key: str | None = None

    def run(self, prompt_len: int, batch: int, output_len: int, mode: str | None = None) -> list[RequestOutput]:
        """`batch` requests of `prompt_len`-token prompts sent at once; `mode` (colocated, disaggregated): the
        routing every one of them must have had (the proxy's decision counters tell)."""
        samples = [SampleRequest(self.synth.text(prompt_len), prompt_len, output_len) for _ in range(batch)]
        settings = RequestSettings(api_url=f"{self.url}/v1/completions", model=self.model, ignore_eos=True,
                                   api_key=self.api_key)
        before = self.decisions() if mode else {}
        run = asyncio.run(run_requests(samples, settings, LoadSettings(disable_tqdm=True, request_timeout_s=600)))
        if failed := [o.error for o in run.outputs if not o.success]:
            raise ProfileRunError(f"{len(failed)} of {batch} requests failed, e.g. {failed[0]}")
        if mode is not None:
            after = self.decisions()
            if after.get(mode, 0) - before.get(mode, 0) != batch:
                raise ProfileRunError(f"requests meant to run {mode} did not (routing decisions {before} -> {after})")
        return run.outputs

    def decisions(self) -> dict[str, float]:
        """The proxy's routing decisions so far, by mode (tandem:pd_decisions_total)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^tandem:pd_decisions_total\{[^}]*mode="(\w+)"[^}]*\} (\S+)$', text, re.M)}

    def warm_up(self, longest: int, mode: str | None) -> None:
        """First requests pay for lazy setup (allocations, connections): a few, uncounted."""
        for prompt_len, batch in ((16, 1), (16, 2), (min(longest, 256), 1)):
            self.run(prompt_len, batch, 4, mode)

    def second_token_s(self, prompt_len: int, repeats: int, mode: str) -> float:
        """One request alone: its second token's time (TTFT + the first ITL), median of `repeats`."""
        times = []
        for _ in range(repeats):
            (out,) = self.run(prompt_len, 1, 4, mode)
            times.append(out.ttft + (out.itl[0] if out.itl else 0.0))
        print(f"  {mode} L={prompt_len}: second token {statistics.median(times) * 1e3:.1f} ms", file=sys.stderr)
        return statistics.median(times)

    def prefill_point(self, prompt_len: int, batch: int, plan: PointPlan) -> PrefillPoint:
        medians, lens = [], []
        for _ in range(plan.runs(prompt_len * batch)):
            outputs = self.run(prompt_len, batch, 1, None)
            medians.append(statistics.median(o.ttft for o in outputs))
            lens += [o.prompt_len for o in outputs]
        point = PrefillPoint(int(statistics.median(lens)), batch, statistics.median(medians))
        print(f"  prefill L={point.prompt_tokens} batch={batch}: TTFT {point.ttft_s * 1e3:.1f} ms", file=sys.stderr)
        return point

    def decode_point(self, batch: int, prompt_len: int, output_len: int) -> DecodePoint:
        outputs = self.run(prompt_len, batch, output_len, None)
        itls = [t for o in outputs for t in o.itl]
        if not itls:
            raise ProfileRunError(f"decode batch={batch}: no inter-token latencies (the answers came in one chunk)")
        prompt = int(statistics.median(o.prompt_len for o in outputs))
        point = DecodePoint(batch, prompt + output_len // 2, statistics.median(itls))
        print(f"  decode batch={batch} context={point.context}: ITL {point.itl_s * 1e3:.2f} ms", file=sys.stderr)
        return point

    def node_points(self, plan: PointPlan) -> Points:
        prefill = tuple(self.prefill_point(n, b, plan) for n in plan.prompt_lens for b in plan.prefill_batches
                        if n * b <= plan.point_tokens or b == 1)
        decode = tuple(self.decode_point(b, plan.decode_prompt, plan.decode_output) for b in plan.decode_batches)
        return Points(prefill=prefill, decode=decode)


def registry_capacity(registry_url: str) -> NodeCapacity | None:
    """What a decode node publishes in the registry (wire/registry.py); None when none is there."""
    import redis

    from wire.nodes import Role
    from wire.registry import NODE_KEY_PATTERN, NodeRecord

    client = redis.Redis.from_url(registry_url)
    try:
        for key in client.scan_iter(NODE_KEY_PATTERN):
            raw = client.get(key)
            if raw is not None and (record := NodeRecord.from_json(raw)).role is Role.DECODE:
                return record.capacity
    except redis.RedisError as e:
        raise ProfileRunError(f"cannot read the registry at {registry_url}: {e}") from None
    finally:
        client.close()
    return None

