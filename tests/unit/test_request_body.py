"""Decoding a request body at the proxy's edge: JSON that json.loads refuses or that holds text UTF-8 cannot
carry is a 400 naming where, never an exception deeper in."""

from __future__ import annotations

import pytest

from proxy.api.errors import APIError
from proxy.api.request_body import decode_json, lone_surrogate_at


def test_escaped_surrogate_pairs_are_text_and_lone_surrogates_are_refused_by_field() -> None:
    assert decode_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a pair: one emoji
    for raw, param, where in [
        (b'{"prompt": "a\\ud800"}', "prompt", "prompt"),
        (b'{"prompt": "\\ude00 after a low half"}', "prompt", "prompt"),
        (b'{"messages": [{"role": "user", "content": "ok"}, {"role": "\\udbff", "content": "x"}]}', "messages",
         "messages[1].role"),
        (b'{"stop": ["a", "b\\ud800"]}', "stop", "stop[1]"),
        (b'{"x": {"\\ud800": 1}}', "x", "a key in x"),
        (b'["\\ud800"]', None, "the request body[0]"),
    ]:
        with pytest.raises(APIError) as e:
            decode_json(raw)
        assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(where), e.value.message


def test_malformed_json_is_a_400_that_does_not_quote_the_body() -> None:
    for raw in [b"[" * 50_000, b'{"n": ' + b"1" * 5000 + b"}", b"\xff\xfe{}", b'{"a": 1', b""]:
        with pytest.raises(APIError) as e:
            decode_json(raw)
        assert e.value.status == 400 and len(e.value.message) < 200


def test_the_surrogate_search_takes_any_depth_without_recursion() -> None:
    deep: object = "fine"
    for _ in range(100_000):
        deep = [deep]
    assert lone_surrogate_at(deep) is None
    assert lone_surrogate_at({"a": [{"b": "x\udfff"}]}) == ("a[0].b", "a")
