"""multi-turn-session runs against a tiny fake OpenAI chat server (starlette, served by uvicorn in the test's
event loop): each turn carries the reply the server actually sent to the turn before, after the one system
prompt every session shares; a session's turns never overlap and wait the think time; the limits on turns in
flight, open sessions and the send rate hold; the server's usage adds up in the results."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmark.cli import main as bench_main
from benchmark.client import RequestSettings
from benchmark.datasets import DatasetConfig, Session, get_sessions, load_tokenizer
from benchmark.metrics import calculate_metrics
from benchmark.results import RunInfo, build_result
from benchmark.runner import LoadSettings, RunOutput, arrival_offsets
from benchmark.sessions import run_sessions


@dataclass
class Exchange:
    """One chat the fake server answered, as it saw it (times are `time.perf_counter`, the client's clock)."""

    messages: list[dict[str, str]]
    reply: str
    arrived: float
    prompt_tokens: int
    cached_tokens: int
    finished: float = math.inf


@dataclass
class FakeChatServer:
    """Answers every chat with "reply <n>" (n counts the chats it got, so each reply is unique), streamed in three
    chunks a few milliseconds apart, then a usage chunk: prompt_tokens is the messages' characters, cached_tokens
    all but the last message's (as if the history were cached). A last user message in `fail_on` gets HTTP 500."""

    fail_on: set[str] = field(default_factory=set)
    exchanges: list[Exchange] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        messages = body["messages"]
        if messages[-1]["content"] in self.fail_on:
            return PlainTextResponse("boom", status_code=500)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}, body
        prompt_tokens = sum(len(m["content"]) for m in messages)
        exchange = Exchange(messages, f"reply {len(self.exchanges)}", time.perf_counter(), prompt_tokens,
                            prompt_tokens - len(messages[-1]["content"]))
        self.exchanges.append(exchange)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(exchange), media_type="text/event-stream")

    async def _stream(self, exchange: Exchange) -> AsyncIterator[str]:
        try:
            for piece in ("reply", " ", exchange.reply.split()[1]):
                await asyncio.sleep(0.005)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
            usage = {"prompt_tokens": exchange.prompt_tokens, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": exchange.cached_tokens}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            exchange.finished = time.perf_counter()
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _run(server: FakeChatServer, sessions: list[Session], load: LoadSettings,
         endpoint: str = "/v1/chat/completions") -> RunOutput:
    async def go() -> RunOutput:
        app = Starlette(routes=[Route("/v1/chat/completions", server.chat, methods=["POST"])])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        serving = asyncio.create_task(http.serve(sockets=[sock]))
        while not http.started:
            await asyncio.sleep(0.01)
        try:
            settings = RequestSettings(f"http://127.0.0.1:{sock.getsockname()[1]}{endpoint}", "m", ignore_eos=True)
            return await run_sessions(sessions, settings, load)
        finally:
            http.should_exit = True
            await serving
            sock.close()
    return asyncio.run(go())


def _sessions(tokenizer_dir: Path, num_prompts: int = 9, num_turns: int = 3, system_prompt_len: int = 12,
              think_time_s: float = 0.0) -> list[Session]:
    config = DatasetConfig(name="multi-turn-session", num_prompts=num_prompts, input_len=6, output_len=3,
                           num_turns=num_turns, system_prompt_len=system_prompt_len, think_time_s=think_time_s)
    return get_sessions(config, load_tokenizer(tokenizer_dir))


def _by_session(server: FakeChatServer) -> dict[str, list[Exchange]]:
    """The fake's exchanges grouped by session (its first user message), in the order they arrived."""
    sessions: dict[str, list[Exchange]] = {}
    for exchange in server.exchanges:
        first_user = next(m["content"] for m in exchange.messages if m["role"] == "user")
        sessions.setdefault(first_user, []).append(exchange)
    return sessions


def test_each_turn_carries_the_actual_previous_reply_after_the_shared_system_prompt(tokenizer_dir: Path) -> None:
    server = FakeChatServer()
    sessions = _sessions(tokenizer_dir)
    run = _run(server, sessions, LoadSettings(max_concurrency=2, disable_tqdm=True))
    assert all(o.success for o in run.outputs) and len(run.outputs) == 9
    system_prompts = {e.messages[0]["content"] for e in server.exchanges}
    assert [e.messages[0]["role"] for e in server.exchanges] == ["system"] * 9
    assert system_prompts == {sessions[0].system_prompt} and sessions[0].system_prompt
    by_session = _by_session(server)
    assert len(by_session) == 3
    for session, exchanges in zip(sessions, by_session.values(), strict=True):
        assert len(exchanges) == 3
        for number, exchange in enumerate(exchanges):
            # [system, user 1, reply 1, ..., user k]: the replies are the ones this server sent this session
            expected = [{"role": "system", "content": session.system_prompt}]
            for earlier, turn in zip(exchanges[:number], session.turns, strict=False):
                expected += [{"role": "user", "content": turn.user_message},
                             {"role": "assistant", "content": earlier.reply}]
            expected.append({"role": "user", "content": session.turns[number].user_message})
            assert exchange.messages == expected
    # outputs come session by session, turn by turn, with what each turn streamed back
    assert [o.session_turn for o in run.outputs] == [1, 2, 3] * 3
    replies = [e.reply for exchanges in by_session.values() for e in exchanges]
    assert [o.generated_text for o in run.outputs] == replies


def test_turns_of_a_session_never_overlap_and_wait_the_think_time(tokenizer_dir: Path) -> None:
    server = FakeChatServer()
    think_time_s = 0.05
    run = _run(server, _sessions(tokenizer_dir, think_time_s=think_time_s), LoadSettings(disable_tqdm=True))
    assert all(o.success for o in run.outputs)
    for exchanges in _by_session(server).values():
        for before, after in zip(exchanges, exchanges[1:], strict=False):
            # the next turn arrives only after this one's stream ended, and a think time later (asyncio's sleep
            # may wake up to a clock tick early, hence the millisecond)
            assert before.finished < after.arrived
            assert after.arrived - before.finished >= think_time_s - 1e-3
    # without a concurrency limit every session's first turn is in flight together
    assert server.max_in_flight >= 3


def test_max_concurrency_bounds_turns_in_flight_and_open_sessions_bound_sessions(tokenizer_dir: Path) -> None:
    server = FakeChatServer()
    run = _run(server, _sessions(tokenizer_dir, num_prompts=12), LoadSettings(max_concurrency=2, disable_tqdm=True))
    assert all(o.success for o in run.outputs) and server.max_in_flight == 2

    server = FakeChatServer()
    run = _run(server, _sessions(tokenizer_dir), LoadSettings(max_active_sessions=1, disable_tqdm=True))
    assert all(o.success for o in run.outputs) and server.max_in_flight == 1
    ordered = list(_by_session(server).values())
    for earlier, later in zip(ordered, ordered[1:], strict=False):
        assert earlier[-1].finished < later[0].arrived  # one session at a time, each to its end


def test_the_request_rate_paces_turn_sends(tokenizer_dir: Path) -> None:
    server = FakeChatServer()
    load = LoadSettings(request_rate=40.0, seed=5, disable_tqdm=True)
    run = _run(server, _sessions(tokenizer_dir, num_prompts=6, num_turns=2), load)
    assert all(o.success for o in run.outputs)
    # send i goes no earlier than send i - 1 plus gap i, so the last goes no earlier than the schedule's last
    # arrival from the start
    assert max(o.start_time for o in run.outputs) - min(o.start_time for o in run.outputs) >= (
        arrival_offsets(6, 40.0, seed=5)[-1] - arrival_offsets(6, 40.0, seed=5)[0] - 1e-3)


def test_prompt_and_cached_tokens_add_up_from_the_servers_usage(tokenizer_dir: Path) -> None:
    server = FakeChatServer()
    run = _run(server, _sessions(tokenizer_dir), LoadSettings(max_concurrency=3, disable_tqdm=True))
    metrics = calculate_metrics(run.outputs, run.duration, [50, 99])
    prompt_tokens = sum(e.prompt_tokens for e in server.exchanges)
    cached_tokens = sum(e.cached_tokens for e in server.exchanges)
    assert (metrics.total_prompt_tokens, metrics.total_cached_tokens) == (prompt_tokens, cached_tokens)
    info = RunInfo("openai-chat", None, "m", None, 9, math.inf, 3, "multi-turn-session", "/v1/chat/completions")
    result = build_result(info, metrics, run.outputs, ["ttft"], detailed=True)
    assert result["total_prompt_tokens"] == prompt_tokens
    assert result["total_cached_tokens"] == cached_tokens
    assert result["total_computed_prompt_tokens"] == sum(len(e.messages[-1]["content"]) for e in server.exchanges)
    assert len(result["median_ttft_ms_by_turn"]) == 3
    assert result["median_ttft_first_turn_ms"] == result["median_ttft_ms_by_turn"][0] > 0
    assert result["session_turns"] == [1, 2, 3] * 3


def test_a_failed_turn_ends_its_session_and_its_unsent_turns_count_as_failed(tokenizer_dir: Path) -> None:
    sessions = _sessions(tokenizer_dir)
    server = FakeChatServer(fail_on={sessions[1].turns[1].user_message})
    run = _run(server, sessions, LoadSettings(disable_tqdm=True))
    assert len(run.outputs) == 9 and len(server.exchanges) == 7  # session 2 sent turns 1 and 2 only
    failed = [(i, o.error) for i, o in enumerate(run.outputs) if not o.success]
    assert [i for i, _ in failed] == [4, 5]
    assert failed[0][1] == "HTTP 500: boom" and failed[1][1].startswith("not sent: turn 2 of its session failed")


def test_the_completions_endpoint_is_refused(tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="chat endpoint"):
        _run(FakeChatServer(), _sessions(tokenizer_dir), LoadSettings(disable_tqdm=True), endpoint="/v1/completions")
    code = bench_main(["serve", "--model", "m", "--tokenizer", str(tokenizer_dir), "--dataset-name",
                       "multi-turn-session", "--endpoint", "/v1/completions", "--port", "9"])
    assert code == 2 and "--endpoint /v1/chat/completions" in capsys.readouterr().err


def test_sessions_share_the_system_prompt_and_lose_turns_turn_major(tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    config = DatasetConfig(name="multi-turn-session", num_prompts=10, num_turns=4, input_len=8, output_len=5,
                           system_prompt_len=20, think_time_s=2.0, range_ratio=0.5, seed=1)
    sessions = get_sessions(config, tokenizer)
    # 3 sessions; turn-major numbering (turn t of session i is t * 3 + i) keeps requests 0..9: 4, 3, 3 turns
    assert [len(s.turns) for s in sessions] == [4, 3, 3]
    assert len({s.system_prompt for s in sessions}) == 1
    assert len(tokenizer.encode(sessions[0].system_prompt, add_special_tokens=False).ids) == 20
    for session in sessions:
        assert session.turns[0].think_time_s == 0.0
        assert all(1.0 <= t.think_time_s <= 3.0 for t in session.turns[1:])
        assert all(4 <= t.user_len <= 12 for t in session.turns)
    assert get_sessions(config, tokenizer) == sessions  # reproducible from the seed
    no_system = get_sessions(DatasetConfig(name="multi-turn-session", num_prompts=2, num_turns=2, input_len=4),
                             tokenizer)
    assert no_system[0].system_prompt == "" and no_system[0].turns[1].think_time_s == 0.0


def test_bad_session_settings_are_refused(tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    for bad in (DatasetConfig(name="multi-turn-session", num_turns=0),
                DatasetConfig(name="multi-turn-session", system_prompt_len=-1),
                DatasetConfig(name="multi-turn-session", think_time_s=-1.0),
                DatasetConfig(name="random")):
        with pytest.raises(ValueError):
            get_sessions(bad, tokenizer)
    with pytest.raises(ValueError, match="max-active-sessions"):
        _run(FakeChatServer(), _sessions(tokenizer_dir), LoadSettings(max_active_sessions=0, disable_tqdm=True))
