"""A request's structured-output constraint, read from the names its users send, into StructuredOutputsParams.

Accepted, at most one constraint in all (two are a 400 naming both):
- OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name", "description"?, "schema", "strict"?}}; `strict: true` admits no property the schema
  does not name (as OpenAI's strict mode requires of a schema);
- vLLM's `structured_outputs` {json | regex | choice | grammar | json_object | structural_tag (xgrammar's: text
  that is free until a trigger, then one of the structures; what tool_choice auto uses), disable_any_whitespace,
  disable_additional_properties}, which also carries those two options for a `response_format` constraint;
- vLLM's older names, still sent by older clients: guided_json, guided_regex, guided_choice, guided_grammar
  (guided_decoding_backend is accepted when it names xgrammar or auto).

Checked here, torch-free: shapes, and a JSON schema against its metaschema (jsonschema), with the reason in the
400. Whether xgrammar compiles a schema, regex or grammar is known where it compiles, on the nodes (the proxy
does not load xgrammar, which imports torch): one that does not compile comes back as a 400 with xgrammar's
reason (the node's INVALID_ARGUMENT), and each node compiles a constraint once (engine/structured_output.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.types import StructuredOutputsParams
from proxy.api.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTION_KEYS = ("disable_any_whitespace", "disable_additional_properties")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = ("auto", "xgrammar")


def parse_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's constraint, None when it has none. APIError 400 naming the field for anything malformed."""
    found: list[tuple[str, str, Any]] = []  # (field, constraint key, value)
    options: dict[str, bool] = {}
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        key, value, strict = response_format
        found.append(("response_format", key, value))
        if strict:
            options["disable_additional_properties"] = True
    found += _vllm_constraints(body.get("structured_outputs"), options)
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, key, body[name]))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise bad_request(f"'guided_decoding_backend' must be one of {', '.join(_BACKENDS)} (xgrammar is the only "
                          f"backend), got {str(backend)[:100]!r}", "guided_decoding_backend", "unsupported_parameter")
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("'guided_whitespace_pattern' is not supported; structured_outputs.disable_any_whitespace is",
                          "guided_whitespace_pattern", "unsupported_parameter")
    if not found:
        if body.get("structured_outputs") is not None:
            raise bad_request("'structured_outputs' needs a constraint: one of json, regex, choice, grammar or "
                              "json_object", "structured_outputs")
        return None
    if len(found) > 1:
        names = sorted({field if field != "structured_outputs" else f"structured_outputs.{key}"
                        for field, key, _ in found})
        raise bad_request(f"only one structured output constraint may be given, got {' and '.join(names)}", found[1][0])
    field, key, value = found[0]
    value = _checked(field, key, value)
    arguments: dict[str, Any] = {key: value, **options}
    try:
        return StructuredOutputsParams(**arguments)
    except ValueError as e:
        raise bad_request(str(e), field) from None


def _response_format(value: Any) -> tuple[str, Any, bool] | None:
    """(constraint key, value, strict) of a response_format, None for none or text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True, False
    if kind != "json_schema":
        raise bad_request("'response_format' must be an object with type 'text', 'json_object' or 'json_schema'",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format type 'json_schema' needs a 'json_schema' object", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                          "response_format")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_request("response_format.json_schema.description must be a string", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
    if "schema" not in spec:
        raise bad_request("response_format.json_schema.schema (the JSON schema to follow) is required",
                          "response_format")
    return "json", spec["schema"], bool(strict)


def _vllm_constraints(value: Any, options: dict[str, bool]) -> list[tuple[str, str, Any]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object", "structured_outputs")
    unknown = sorted(set(value) - {*_CONSTRAINT_KEYS, *_OPTION_KEYS})
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0][:64]} is not supported; the fields are "
                          f"{', '.join((*_CONSTRAINT_KEYS, *_OPTION_KEYS))}", "structured_outputs",
                          "unsupported_parameter")
    for key in _OPTION_KEYS:
        flag = value.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise bad_request(f"structured_outputs.{key} must be a boolean", "structured_outputs")
        if flag:
            options[key] = True
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise bad_request("structured_outputs.json_object must be a boolean", "structured_outputs")
    # json_object: false means "not this one"; any other constraint given as false is a wrong type (_checked)
    return [("structured_outputs", key, value[key]) for key in _CONSTRAINT_KEYS
            if value.get(key) is not None and not (key == "json_object" and value[key] is False)]


def _checked(field: str, key: str, value: Any) -> Any:
    """The constraint's value in StructuredOutputsParams' shape, or a 400 saying what is wrong with it."""
    where = field if field != "structured_outputs" else f"structured_outputs.{key}"
    if key == "json":
        return checked_json_schema(where, field, value)
    if key in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise bad_request(f"'{where}' must be a non-empty string", field)
    if key == "choice" and (not isinstance(value, list) or not value
                            or not all(isinstance(c, str) and c for c in value)):
        raise bad_request(f"'{where}' must be a non-empty list of non-empty strings", field)
    if key == "json_object" and value is not True:
        raise bad_request(f"'{where}' must be true", field)
    if key == "structural_tag":  # xgrammar's, as JSON text or the object itself; its shape is checked on the way
        if isinstance(value, dict):
            return json.dumps(value)
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{where}' must be a structural tag (an object or its JSON text)", field)
    return value


def checked_json_schema(where: str, field: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM takes a schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"'{where}' is not valid JSON: {e}"[:300], field) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be a JSON schema object", field)
    import jsonschema  # on the tokenizer thread, once: it loads its metaschemas

    validator = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(value)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise bad_request(f"'{where}' is not a valid JSON schema: {e.message} (at schema{path})"[:400], field) from None
    except (RecursionError, ValueError) as e:  # a $schema of an unknown dialect, or nesting past Python's limit
        raise bad_request(f"'{where}' is not a valid JSON schema: {type(e).__name__}"[:300], field) from None
    return value


def openapi_properties() -> dict[str, Any]:
    """The request fields above as proxy/api/openapi.py describes them (JSON Schema): at least as strict as nothing
    the parser accepts is forbidden, and nothing forbidden is accepted. What it cannot say is in the descriptions:
    one constraint in all, a schema valid against its metaschema and compiled by xgrammar."""
    def nullable(kinds: str | list[str], **schema: Any) -> dict[str, Any]:
        return {"type": [*([kinds] if isinstance(kinds, str) else kinds), "null"], **schema}

    text = {"type": "string", "minLength": 1}
    choices = nullable("array", items=text, minItems=1)
    json_schema = nullable(["object", "string"], description="A JSON schema (or its JSON text).")
    flag = nullable("boolean")
    named_schema = {"type": "object", "required": ["name", "schema"],
                    "properties": {"name": {"type": "string", "pattern": _NAME.pattern},
                                   "description": nullable("string"), "schema": {"type": "object"}, "strict": flag}}
    response_format = nullable(
        "object", required=["type"],
        description="Structured output: json_object (any JSON object) or json_schema (strict: no property the "
                    "schema does not name). At most one constraint per request, with structured_outputs and "
                    "guided_*; a schema must be valid against its metaschema and compile with xgrammar (400).",
        properties={"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}})
    # json_schema is read (and must be well formed) only with type json_schema
    response_format["if"] = {"properties": {"type": {"const": "json_schema"}}}
    response_format["then"] = {"required": ["json_schema"], "properties": {"json_schema": named_schema}}
    return {
        "response_format": response_format,
        "structured_outputs": nullable(
            "object", additionalProperties=False,
            description="vLLM's structured output: exactly one of json, regex, choice, grammar (xgrammar's EBNF), "
                        "json_object or structural_tag (xgrammar's), with its options.",
            properties={"json": json_schema, "regex": nullable("string"), "choice": choices,
                        "grammar": nullable("string"), "json_object": flag,
                        "structural_tag": nullable(["object", "string"]), "disable_any_whitespace": flag,
                        "disable_additional_properties": flag}),
        "guided_json": json_schema, "guided_regex": nullable("string"), "guided_choice": choices,
        "guided_grammar": nullable("string"),
        "guided_decoding_backend": nullable("string", enum=[*_BACKENDS, None]),
        "guided_whitespace_pattern": {"type": "null", "description": "Not supported: absent or null only."},
    }
