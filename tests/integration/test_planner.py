"""`tandem serve --planner` live: a tiny model's cluster of one prefill and one decode node, the planner every
second; a burst of concurrent streams makes it grow the decode pool (seen through the admin API's /status), and
once the burst is over it gives the node back; no request fails.

The planner's profile is measured here, not made up: the same tiny model in the engine alone (its offline API), a
few prompts timed for their first token and a few batches for their decode steps, fitted by
`benchmark.profile.fit` as `tandem profile` fits its points, with the node spec the cluster's nodes are started
with. The SLOs are multiples of what that measured; the decode pool's size then comes from the capacity model's
batch per node (the nodes' four seats, under the ITL SLO) against the requests in flight, and from the observed
ITL against its SLO.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from benchmark.profile import DecodePoint, NodeSpec, Points, PrefillPoint, Profile, fit
from cluster.planner.capacity import decode_batch
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.test_cluster import Load, LocalCluster, local_cluster

pytestmark = pytest.mark.integration
MAX_SEQS, KV_BLOCKS, OUTPUT = 4, 256, 24
NODE_ARGS = f"--num-kv-blocks {KV_BLOCKS} --max-num-seqs {MAX_SEQS} --log-level INFO"
BURST = 2 * MAX_SEQS  # streams at once: two decode nodes' seats


def measure_profile(model: Path) -> Profile:
    """The tiny model's step costs, measured in the engine alone on this machine."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.types import SamplingParams

    defaults = EngineConfig(model=str(model))
    llm = LLM(str(model), dtype="float32", device="cpu", max_num_seqs=MAX_SEQS, num_kv_blocks=KV_BLOCKS)
    try:
        def timed(prompt_len: int, batch: int, max_tokens: int) -> float:
            prompts = [[(7 * i + j) % 900 + 10 for j in range(prompt_len)] for i in range(batch)]
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
            return time.perf_counter() - started

        def best(prompt_len: int, batch: int, max_tokens: int) -> float:
            return min(timed(prompt_len, batch, max_tokens) for _ in range(2))

        timed(16, 1, 4)  # warm up
        prefill = tuple(PrefillPoint(n, b, best(n, b, 1)) for n in (16, 64) for b in (1, 2))
        decode = tuple(DecodePoint(b, 16 + OUTPUT // 2, max(best(16, b, OUTPUT + 1) - best(16, b, 1), 1e-6) / OUTPUT)
                       for b in (1, MAX_SEQS))
    finally:
        llm.close()
    node = NodeSpec(model=model.name, dtype="float32", device="cpu", threads=0,
                    max_num_batched_tokens=defaults.max_num_batched_tokens, max_num_seqs=MAX_SEQS,
                    block_size=defaults.block_size, num_kv_blocks=KV_BLOCKS)
    points = Points(prefill=prefill, decode=decode)
    step, request_s, handoff_base_s, handoff_per_token_s = fit(node, points)
    return Profile(node, step, request_s, handoff_base_s, handoff_per_token_s, points, hardware="this machine",
                   command="tests/integration/test_planner.py")


def pools(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    return dict(cluster.status()["pools"])


def wait_until(what: str, check: object, cluster: LocalCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s: {pools(cluster)}\n{cluster.log()[-4000:]}")
        time.sleep(0.3)


def test_the_planner_grows_the_decode_pool_for_a_burst_and_shrinks_it_after(
        tiny_model: TinyModelFactory, tmp_path: Path) -> None:
    model = tiny_model("llama", max_position_embeddings=1024)
    profile = measure_profile(model)
    context = 16 + OUTPUT // 2
    # generous objectives, from the measurement: the ITL SLO lets a node run its four seats
    itl_slo_s = 10 * profile.decode_step_s(MAX_SEQS, context)
    ttft_slo_s = 20 * profile.prefill_s(64)
    assert decode_batch(profile, context, 16 + OUTPUT, itl_slo_s) == MAX_SEQS
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    (tmp_path / "cache").mkdir()

    with local_cluster(model, tmp_path / "cache", "--node-args", NODE_ARGS, "--planner", "--planner-profile",
                       str(profile_path), "--slo-ttft-ms", f"{ttft_slo_s * 1000:.3f}", "--slo-itl-ms",
                       f"{itl_slo_s * 1000:.3f}", "--planner-interval-s", "1", "--planner-cooldown-s", "3",
                       "--planner-max-prefill", "1", "--planner-max-decode", "2") as cluster:
        assert pools(cluster)["decode"]["desired"] == 1
        with Load(cluster.url, num_threads=BURST, max_tokens=OUTPUT) as burst:
            wait_until("the decode pool grown to 2 and serving", lambda: pools(cluster)["decode"]["ready"] == 2,
                       cluster, timeout=90)
        assert not burst.failures, burst.failures[:3]
        assert burst.num_ok >= BURST
        # idle: after a few low intervals (and the cooldown) the planner gives the node back; it drains
        wait_until("the decode pool back to 1", lambda: (p := pools(cluster)["decode"])["desired"] == 1
                   and p["ready"] == 1 and p["draining"] == 0, cluster, timeout=60)
        log = cluster.log()
        assert "planner: " in log and "decode 1->2" in log and "decode 2->1" in log, log[-3000:]
        metrics = httpx.get(_admin_url(cluster) + "/metrics", timeout=10).text
        assert 'tandem:planner_desired_nodes{role="decode"} 1.0' in metrics
        assert re.search(r'tandem:planner_decisions_total\{direction="up",reason="\w+",role="decode"\} 1\.0', metrics)
        assert 'tandem:planner_decisions_total{direction="down",reason="idle",role="decode"} 1.0' in metrics
        with Load(cluster.url, num_threads=1, max_tokens=4, once=True) as after:
            pass
        assert after.num_ok == 1 and not after.failures


def _admin_url(cluster: LocalCluster) -> str:
    import json

    return str(json.loads((cluster.cache_dir / "cluster.json").read_text())["admin_url"])
