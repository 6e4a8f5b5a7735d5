"""The proxy's security edge (issue 13, item 5): several API keys compared in constant time and never shown,
/health and /metrics open as vLLM's (metrics guarded on request), and the limits on n, logprobs and max_tokens
as flags, with the OpenAI envelope naming the limit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import proxy.api.auth
from proxy.__main__ import parse_args
from proxy.api.app import create_app
from proxy.api.auth import APIKeys, load_api_keys, read_key_file
from proxy.api.errors import APIError
from proxy.api.limits import RequestLimits
from proxy.api.openai_api import parse_chat, parse_completion
from proxy.api.serving import ProxyState
from tests.unit.test_openai_api import ScriptedPipeline

KEYS = ["sk-first-0123456789", "sk-second-abcdefghij"]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def state(tokenizer_dir: Path) -> Iterator[ProxyState]:
    from transformers import AutoTokenizer

    state = ProxyState(ScriptedPipeline([5, 6]), AutoTokenizer.from_pretrained(str(tokenizer_dir)), "m",
                       api_keys=APIKeys(KEYS))
    yield state
    state.close()


def served(state: ProxyState, requests: list[tuple[str, str, dict[str, str]]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            return [await http.request(method, path, headers=headers) for method, path, headers in requests]

    return asyncio.run(run())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- API keys ----

def test_every_key_is_accepted_and_anything_else_refused_with_the_envelope(state: ProxyState) -> None:
    wrong = [{}, bearer("sk-wrong"), bearer(KEYS[0][:-1]), bearer(KEYS[0] + "x"), {"Authorization": KEYS[0]},
             {"Authorization": f"Basic {KEYS[0]}"}, bearer("")]
    responses = served(state, [("GET", "/v1/models", h) for h in [bearer(KEYS[0]), bearer(KEYS[1]), *wrong]])
    assert [r.status_code for r in responses] == [200, 200] + [401] * len(wrong)
    for refused in responses[2:]:
        assert refused.json() == {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                            "param": None, "code": "invalid_api_key"}}
        assert refused.headers["www-authenticate"] == "Bearer"


def test_a_key_is_compared_with_every_key_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the time taken must not say which key matched (nor whether one did before the last)."""
    compared = []
    real = proxy.api.auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(proxy.api.auth.hmac, "compare_digest", counting)
    keys = APIKeys([f"sk-{i}" for i in range(5)])
    for given in ("sk-0", "sk-4", "nope"):
        compared.clear()
        keys.matches(given)
        assert len(compared) == 5, given
        assert {len(b) for b in compared} == {32}  # digests: the keys' lengths are not compared either


def test_keys_are_never_shown_in_reprs_logs_or_metrics(state: ProxyState, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    responses = served(state, [("GET", "/v1/models", bearer(KEYS[0])), ("GET", "/v1/models", bearer("sk-guess")),
                               ("GET", "/metrics", {}), ("GET", "/health", {})])
    assert [r.status_code for r in responses][:3] == [200, 401, 200]
    shown = repr(state) + repr(vars(state.api_keys)) + caplog.text + "".join(r.text for r in responses)
    for secret in (*KEYS, "sk-guess"):
        assert secret not in shown
    assert "2 keys" in repr(state)


def test_health_and_metrics_are_open_unless_metrics_are_asked_to_need_a_key(state: ProxyState) -> None:
    health, metrics = served(state, [("GET", "/health", {}), ("GET", "/metrics", {})])
    assert health.status_code == 503 and metrics.status_code == 200  # 503: no node, but no 401
    state.metrics_need_key = True
    metrics, keyed, health = served(state, [("GET", "/metrics", {}), ("GET", "/metrics", bearer(KEYS[1])),
                                            ("GET", "/health", {})])
    assert metrics.status_code == 401 and keyed.status_code == 200 and health.status_code == 503


def test_key_files_skip_comments_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# production\n  sk-a  \n\n# sk-commented\nsk-b\n")
    assert read_key_file(path) == ["sk-a", "sk-b"]
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(path)
    path.write_text("sk-a sk-b\n")
    with pytest.raises(ValueError, match="blanks") as e:
        read_key_file(path)
    assert "sk-a" not in str(e.value)


def test_the_flag_beats_the_env_key_and_the_file_adds_to_either(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-file\n")
    flagged = load_api_keys(["sk-1", "sk-2"], str(path), "sk-env")
    assert [flagged.matches(k) for k in ("sk-1", "sk-2", "sk-file", "sk-env")] == [True, True, True, False]
    from_env = load_api_keys(None, str(path), "sk-env")
    assert from_env.matches("sk-env") and from_env.matches("sk-file")
    assert not load_api_keys(None, None, None)  # open


def test_the_proxy_takes_api_key_repeated_and_a_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    path = tmp_path / "keys"
    path.write_text("sk-file\n")
    _, args = parse_args(["--model", "m", "--decode", "127.0.0.1:1", "--api-key", "sk-1", "--api-key", "sk-2",
                          "--api-key-file", str(path)])
    assert len(args.api_keys) == 3 and all(args.api_keys.matches(k) for k in ("sk-1", "sk-2", "sk-file"))
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--decode", "127.0.0.1:1", "--api-key-file", str(tmp_path / "missing")])


# ---- limits ----

LIMITS = RequestLimits(max_n=4, max_logprobs=3, max_tokens=50)


@pytest.mark.parametrize("parse, body, param, limit", [
    (parse_completion, {"prompt": "x", "n": 5}, "n", "4"),
    (parse_completion, {"prompt": ["a", "b", "c"], "n": 2}, "n", "4"),  # prompts x n
    (parse_completion, {"prompt": "x", "logprobs": 4}, "logprobs", "3"),
    (parse_completion, {"prompt": "x", "max_tokens": 51}, "max_tokens", "50"),
    (parse_chat, {"messages": MESSAGES, "n": 5}, "n", "4"),
    (parse_chat, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}, "top_logprobs", "3"),
    (parse_chat, {"messages": MESSAGES, "max_tokens": 51}, "max_tokens", "50"),
    (parse_chat, {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 51}, "max_completion_tokens", "50"),
])
def test_requests_beyond_a_limit_get_400_naming_the_parameter_and_the_limit(parse: Any, body: dict[str, Any],
                                                                              param: str, limit: str) -> None:
    with pytest.raises(APIError) as e:
        parse(body, LIMITS)
    assert e.value.status == 400 and e.value.param == param
    assert f"at most {limit}" in e.value.message or f", {limit}]" in e.value.message
    assert "this server's limit" in e.value.message


def test_requests_at_the_limits_pass_and_an_unasked_max_tokens_is_capped() -> None:
    at = parse_completion({"prompt": "x", "n": 4, "logprobs": 3, "max_tokens": 50}, LIMITS).generation.params
    assert (at.n, at.logprobs, at.max_tokens) == (4, 3, 50)
    assert parse_chat({"messages": MESSAGES}, LIMITS).generation.params.max_tokens == 50  # not "up to the context"
    assert parse_completion({"prompt": "x"}, RequestLimits(max_tokens=8)).generation.params.max_tokens == 8  # not 16
    assert parse_completion({"prompt": "x"}, LIMITS).generation.params.max_tokens == 16  # OpenAI's default


def test_the_limit_flags_reach_the_validators_and_bad_values_are_usage_errors() -> None:
    _, args = parse_args(["--model", "m", "--decode", "127.0.0.1:1", "--max-n", "2", "--max-logprobs", "1",
                          "--max-tokens-limit", "7"])
    assert args.limits == RequestLimits(max_n=2, max_logprobs=1, max_tokens=7)
    _, default = parse_args(["--model", "m", "--decode", "127.0.0.1:1"])
    assert default.limits == RequestLimits(max_n=128, max_logprobs=20, max_tokens=None)  # vLLM's max_logprobs
    for flags in (["--max-n", "0"], ["--max-n", "129"], ["--max-logprobs", "-1"], ["--max-tokens-limit", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--decode", "127.0.0.1:1", *flags])


def test_the_openapi_document_states_the_configured_limits(state: ProxyState) -> None:
    state.limits = LIMITS
    (response,) = served(state, [("GET", "/openapi.json", bearer(KEYS[0]))])
    schemas = response.json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 4 and completion["logprobs"]["maximum"] == 3
    assert completion["max_tokens"]["maximum"] == 50 and chat["top_logprobs"]["maximum"] == 3
    assert chat["max_tokens"]["default"] == 50
