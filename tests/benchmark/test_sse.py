"""Server-sent event parsing as OpenAI-compatible servers stream it."""

from __future__ import annotations

from benchmark.sse import DONE, SSEDecoder, decode_events


def test_events_end_at_blank_lines_and_skip_comments_and_other_fields() -> None:
    lines = [": keep-alive", "", "event: message", "id: 7", 'data: {"a": 1}', "", "data:{\"b\": 2}\r", "\r",
             f"data: {DONE}", ""]
    assert decode_events(lines) == ['{"a": 1}', '{"b": 2}', DONE]


def test_multi_line_data_joins_with_newlines_and_a_missing_final_blank_line_still_yields() -> None:
    assert decode_events(["data: first", "data:  second", "", "data: tail"]) == ["first\n second", "tail"]


def test_decoder_returns_nothing_until_the_event_ends() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("data: x") is None
    assert decoder.feed("") == "x"
    assert decoder.feed("") is None  # a blank line with no data is no event
