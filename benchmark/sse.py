"""Server-sent events, as OpenAI-compatible servers stream them: `data: {...}` lines, a blank line after each
event, `data: [DONE]` at the end. Comments (`: ...`) and other fields (`event:`, `id:`, `retry:`) are skipped."""

from __future__ import annotations

DONE = "[DONE]"


class SSEDecoder:
    """Feeds on lines (without their line ending) and hands back each complete event's data.

    An event's data is its `data:` lines joined with newlines (the SSE rule); one space after the colon is
    dropped. `feed` returns the data when a blank line ends an event, else None; `flush` returns an event the
    stream ended without a blank line after.
    """

    def __init__(self) -> None:
        self._data_lines: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_lines.append(value)
        return None

    def flush(self) -> str | None:
        if not self._data_lines:
            return None
        data = "\n".join(self._data_lines)
        self._data_lines = []
        return data


def decode_events(lines: list[str]) -> list[str]:
    """Every event's data in a whole stream's lines (for tests and small responses)."""
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed(line)) is not None]
    if (tail := decoder.flush()) is not None:
        events.append(tail)
    return events
