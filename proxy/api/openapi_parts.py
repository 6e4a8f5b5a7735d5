"""The building blocks of the proxy's OpenAPI document (proxy/api/openapi.py and the modules it composes)."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    """The proxy reads null as "not given" for every optional field."""
    if "type" not in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    widened = {**schema, "type": [*kinds, "null"]}
    if "const" in widened:
        widened["enum"] = [widened.pop("const")]
    if "enum" in widened:
        widened["enum"] = [*widened["enum"], None]
    return widened


def integer(minimum: int, maximum: int, description: str, default: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": minimum, "maximum": maximum, "description": description}
    if default is not None:
        schema["default"] = default
    return nullable(schema)


def flag(description: str, default: bool) -> Schema:
    return nullable({"type": "boolean", "default": default, "description": description})
