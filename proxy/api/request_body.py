"""Reading and decoding an HTTP request's JSON body at the edge, so that no body can stall or crash the proxy.

- Size: a body over the limit gets 413 before it is read: a Content-Length beyond it at once, a chunked body as
  soon as the bytes received pass it. Nothing is parsed until the whole body is in and within the limit.
- Shape: anything json.loads refuses (bad syntax or encoding, an integer of more digits than Python converts,
  arrays nested past the recursion limit) is a 400.
- Text: a lone UTF-16 surrogate ("\\ud800" escaped in JSON) decodes to a Python str that UTF-8 cannot encode:
  the tokenizer raises TypeError on it and any message quoting it cannot be sent. A body holding one anywhere
  (in a key or a value) is a 400 that names where, so nothing past the edge ever sees one.

`decode_json` costs time in proportion to the body: call it off the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from proxy.api.errors import APIError, bad_request

# 32 MiB. A 128K-token context is about 0.5 MiB of English text; a 1M-token one, or 128 batched prompts of
# token ids, a few MiB more; non-ASCII text escaped in JSON (\uXXXX) takes up to 6 bytes a character. Larger
# bodies are not requests a context can hold, and each one held costs the proxy its size several times over
# (bytes, str, token ids) while it is tokenized. Like vLLM's front end, the limit is a flag: raise it for
# longer contexts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024

# JSON makes a surrogate only from a \u escape (raw UTF-8 cannot hold one): a body without such an escape
# needs no search (a big list of token ids is not walked item by item)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; APIError 413 as soon as it is known to exceed `max_bytes` (the rest is not read)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("the Content-Length header is not a number")
        if int(declared) > max_bytes:
            raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:  # a chunked body, or one longer than it declared
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """The body as JSON; APIError 400 when it is not JSON, nests too deeply or holds a lone surrogate."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body nests JSON too deeply") from None
    except ValueError as e:  # also UnicodeDecodeError, and integers beyond Python's digit limit
        raise bad_request(f"the request body is not valid JSON: {_describe(e)}") from None
    found = lone_surrogate_at(value) if _SURROGATE_ESCAPE.search(raw) else None
    if found is not None:
        where, param = found
        raise bad_request(f"{where[:200]} holds a lone UTF-16 surrogate, which is not valid Unicode text", param)
    return value


def lone_surrogate_at(value: Any) -> tuple[str, str | None] | None:
    """Where in a decoded JSON value the first string (key or value) holding a lone surrogate is: a path like
    `messages[0].content`, and the top-level field it is in (None: the body itself). None when there is none.
    Iterative: whatever depth json.loads accepted costs no recursion here."""
    stack: list[tuple[str, str | None, Any]] = [("the request body", None, value)]
    while stack:
        path, field, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path, field
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _encodable(key):
                    return f"a key in {path}", field
                top = field is None
                stack.append((key if top else f"{path}.{key}", key if top else field, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", field, child) for i, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(e: ValueError) -> str:
    # JSONDecodeError says where; the others (bad UTF-8, huge integers) say what. Never quote the body itself.
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno} column {e.colno}"
    if isinstance(e, UnicodeDecodeError):
        return "it is not UTF-8 text"
    return str(e).split(";", 1)[0][:200]
