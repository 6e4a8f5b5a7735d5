"""The KV tiers through the proxy (docs/architecture.md#kv-tiers): a prefill node, a decode node and a proxy that
disaggregates every request, with a host tier and a real Mooncake Store (a mooncake_master of the test's own).

- a second turn whose prompt is the first turn's prompt + answer + a new message finds the answer's blocks, which
  only the decode node computed, in the store: counted in cached_tokens and the prefill node's store hits, and
  its output is transformers' greedy output, token for token;
- a corrupted block in the store is caught by its checksum and computed instead (the output stays exact);
- the store's master killed mid-load: no request fails, and once it is back puts and hits resume.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvtransfer.kv_store import MooncakeKVStore, pack_block, store_key
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import MooncakeMaster, Process, launch_node, start_proxy

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4  # tests/integration/processes.py node_args
NODE_FLAGS = ["--kv-offloading-size", "0.002", "--kv-store-segment-size", "0.03125"]


class TierCluster:
    def __init__(self, model: Path, master: MooncakeMaster, log_dir: Path) -> None:
        self.model, self.master = model, master
        flags = [*NODE_FLAGS, "--kv-store", master.url]
        self.prefill, self.prefill_address = launch_node("prefill", model, "nixl", log_dir, flags)
        self.decode, self.decode_address = launch_node("decode", model, "nixl", log_dir, flags)
        self.proxy: Process | None = None
        self.colocating_proxy: Process | None = None
        try:
            for node in (self.prefill, self.decode):
                node.wait_for_line("READY")
            self.proxy, self.url = start_proxy(model, self.prefill_address, self.decode_address, log_dir,
                                               ["--colocate-max-tokens", "0", "--block-size", str(BLOCK_SIZE)])
            # the same nodes behind a proxy that prefills every prompt on the decode node
            self.colocating_proxy, self.colocating_url = start_proxy(
                model, self.prefill_address, self.decode_address, log_dir,
                ["--colocate-max-tokens", "100000", "--block-size", str(BLOCK_SIZE)])
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in (self.colocating_proxy, self.proxy, self.decode, self.prefill):
            if process is not None:
                process.stop()

    def namespace(self) -> str:
        """The nodes' KV layout hash: the store's namespace for their blocks."""
        async def health() -> str:
            async with grpc.aio.insecure_channel(self.prefill_address) as channel:
                response = await tandem_pb2_grpc.PrefillServiceStub(channel).Health(pb.HealthRequest(), timeout=5)
                return str(response.layout_hash)

        return asyncio.run(health())

    def complete(self, prompt: list[int], max_tokens: int, url: str | None = None, **sampling: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **sampling}
        r = httpx.post(f"{url or self.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metric(self, name: str, role: str, tier: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and f'role="{role}"' in line and f'tier="{tier}"' in line)

    def wait_for_metric(self, name: str, role: str, tier: str, above: float, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, role, tier)
            if value > above:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{{role={role}, tier={tier}}} stayed at {value} (wanted > {above})")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def tiers(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TierCluster]:
    log_dir = tmp_path_factory.mktemp("kv-tiers")
    master = MooncakeMaster(log_dir)
    try:
        cluster = TierCluster(tiny_model("llama"), master, log_dir)
        yield cluster
        cluster.stop()
    finally:
        master.kill()


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def _text(model: Path, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(str(model)).decode(tokens, skip_special_tokens=True))


def test_turn_two_finds_turn_ones_answer_in_the_store(tiers: TierCluster) -> None:
    first = _prompt(22, seed=1)
    answer = hf_greedy(tiers.model, [first], 14)[0]
    body = tiers.complete(first, 14)
    assert body["usage"]["completion_tokens"] == 14
    # the decode node puts prompt + answer once the request is done (in the background)
    written = tiers.wait_for_metric("tandem:kv_tier_write_bytes_total", "decode", "store", 0)
    hits_before = tiers.metric("tandem:kv_tier_hits_total", "prefill", "store")

    second = [*first, *answer, *_prompt(9, seed=2)]
    expected = hf_greedy(tiers.model, [second], 8)[0]
    body = tiers.complete(second, 8)
    assert body["choices"][0]["text"] == _text(tiers.model, expected)
    # computed: turn 1's prompt (22 tokens) and answer (14, the last one's K/V never computed) = 35 tokens, of
    # which the prefill node held the prompt's 5 full blocks; the answer's blocks came from the store
    store_hits = tiers.metric("tandem:kv_tier_hits_total", "prefill", "store") - hits_before
    assert store_hits >= (35 // BLOCK_SIZE - 22 // BLOCK_SIZE) * BLOCK_SIZE, (store_hits, written)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 35 // BLOCK_SIZE * BLOCK_SIZE, body["usage"]


def test_a_colocated_request_gets_its_prefix_from_the_store(tiers: TierCluster) -> None:
    """The decode node prefilling a prompt itself takes the blocks a prefill node put, greedy and seeded alike."""
    prompt = _prompt(26, seed=30)
    written = tiers.metric("tandem:kv_tier_write_bytes_total", "prefill", "store")
    tiers.complete(prompt, 1)  # ends at the prefill node's first token: the decode node never sees the prompt
    tiers.wait_for_metric("tandem:kv_tier_write_bytes_total", "prefill", "store", written)
    hits = tiers.metric("tandem:kv_tier_hits_total", "decode", "store")
    longer = [*prompt, *_prompt(5, seed=31)]
    expected = hf_greedy(tiers.model, [longer], 6)[0]
    body = tiers.complete(longer, 6, url=tiers.colocating_url)
    assert body["choices"][0]["text"] == _text(tiers.model, expected)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 24, body["usage"]  # 6 of the 26's blocks
    assert tiers.metric("tandem:kv_tier_hits_total", "decode", "store") - hits == 24

    # seeded sampling: a prompt's blocks computed (a miss everywhere) and got from the store sample alike
    seeded = {"temperature": 1.0, "seed": 11}
    third = _prompt(23, seed=32)
    written = tiers.metric("tandem:kv_tier_write_bytes_total", "decode", "store")
    computed = tiers.complete(third, 8, url=tiers.colocating_url, **seeded)  # the decode node computes, puts
    assert computed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    tiers.wait_for_metric("tandem:kv_tier_write_bytes_total", "decode", "store", written)
    from_store = tiers.complete(third, 8, url=tiers.url, **seeded)  # P/D: the prefill node gets them
    assert from_store["usage"]["prompt_tokens_details"]["cached_tokens"] == 20, from_store["usage"]
    assert from_store["choices"][0]["text"] == computed["choices"][0]["text"]


def test_a_corrupted_store_block_is_computed_instead(tiers: TierCluster) -> None:
    from engine.hashing import block_hashes
    from settings.cluster import ENGINE_DEFAULTS

    namespace, seed = tiers.namespace(), ENGINE_DEFAULTS["hash_seed"]
    computed = _prompt(17, seed=3)
    tiers.complete(computed, 2)  # the prefill node puts its blocks: one to copy the size of a block's value from
    key = store_key(namespace, block_hashes(computed, BLOCK_SIZE, seed)[0])
    client = MooncakeKVStore(f"127.0.0.1:{tiers.master.port}", segment_bytes=16 << 20, buffer_bytes=16 << 20)
    try:
        deadline = time.monotonic() + 30
        while not (genuine := client.get_prefix([key])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert genuine, "the prefill node's block never reached the store"
        block_bytes = len(genuine[0]) - len(pack_block(computed[:BLOCK_SIZE], b""))

        fresh = _prompt(21, seed=4)
        first_key = store_key(namespace, block_hashes(fresh, BLOCK_SIZE, seed)[0])
        value = bytearray(pack_block(fresh[:BLOCK_SIZE], bytes(range(256)) * (block_bytes // 256)
                                     + bytes(block_bytes % 256)))
        value[-1] ^= 0x5A  # one flipped byte of the block's data: only the checksum can tell
        assert client.put_many([(first_key, bytes(value))]) == 1
        errors = tiers.metric("tandem:kv_tier_errors_total", "prefill", "store")
        expected = hf_greedy(tiers.model, [fresh], 6)[0]
        body = tiers.complete(fresh, 6)
        assert body["choices"][0]["text"] == _text(tiers.model, expected)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, body["usage"]
        assert tiers.metric("tandem:kv_tier_errors_total", "prefill", "store") == errors + 1
    finally:
        client.close()


def test_the_store_killed_mid_load_fails_no_request_and_recovers(tiers: TierCluster) -> None:
    references = [_prompt(18 + i, seed=10 + i) for i in range(6)]
    expected = {tuple(p): _text(tiers.model, t) for p, t in zip(references, hf_greedy(tiers.model, references, 6),
                                                                strict=True)}
    failures: list[str] = []
    answers: list[float] = []
    stop = threading.Event()

    def client(index: int) -> None:
        rng = random.Random(index)
        while not stop.is_set():
            prompt = rng.choice(references)
            try:
                r = httpx.post(f"{tiers.url}/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                                    "temperature": 0, "ignore_eos": True}, timeout=60)
            except httpx.HTTPError as e:
                failures.append(repr(e))
                continue
            if r.status_code != 200 or r.json()["choices"][0]["text"] != expected[tuple(prompt)]:
                failures.append(f"{r.status_code} {r.text[:300]}")
            answers.append(time.monotonic())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(answers) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tiers.master.kill()
        killed_at = time.monotonic()
        time.sleep(4.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    assert not failures, failures[:3]
    assert sum(1 for t in answers if t > killed_at) >= 3, "the load did not go on while the store was down"
    assert tiers.metric("tandem:kv_tier_errors_total", "decode", "store") > 0, "no call met the dead store"

    tiers.master.start()  # an empty store on the same address
    written = tiers.metric("tandem:kv_tier_write_bytes_total", "decode", "store")
    deadline = time.monotonic() + 60
    turn = 0
    while tiers.metric("tandem:kv_tier_write_bytes_total", "decode", "store") <= written:
        assert time.monotonic() < deadline, "the nodes never put a block in the restarted store"
        tiers.complete(_prompt(14, seed=100 + turn), 6)  # fresh prompts: blocks nobody put yet
        turn += 1
        time.sleep(0.5)
    # and a prefix put after the restart is found again by the prefill node, once its breaker lets it ask again
    # (kvtransfer/kv_store.py: 5 s after a failed call); each try's prefix is new, so only the store can hold it
    deadline = time.monotonic() + 45
    for attempt in range(100):
        first = _prompt(22, seed=200 + attempt)
        answer = hf_greedy(tiers.model, [first], 14)[0]
        written = tiers.metric("tandem:kv_tier_write_bytes_total", "decode", "store")
        tiers.complete(first, 14)
        tiers.wait_for_metric("tandem:kv_tier_write_bytes_total", "decode", "store", written)
        hits = tiers.metric("tandem:kv_tier_hits_total", "prefill", "store")
        body = tiers.complete([*first, *answer, *_prompt(7, seed=201)], 4)
        if tiers.metric("tandem:kv_tier_hits_total", "prefill", "store") > hits:
            break
        assert time.monotonic() < deadline, "no store hit after the restart"
        time.sleep(1.0)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, body["usage"]
