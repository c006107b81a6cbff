"""An OpenAI `response_format` checked and kept as its canonical JSON text: the hashable
value `SamplingParams.response_format` carries (None for `{"type": "text"}`).

`canonical` accepts `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}, "strict": ...}}`. A schema the grammar library cannot enforce
in full (an unimplemented keyword, an unknown format, a remote `$ref`) is refused, never
loosened: the library validates the schema alone, with no tokenizer; compiling it into a
matcher over a model's tokenizer is `prepos.decode.structured`'s.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from prepos.errors import InvalidResponseFormat

TYPES = ("text", "json_object", "json_schema")
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object
# compact JSON; a schema's own "x-guidance" may not make the library lenient
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
STRICT = {"lenient": False}


def canonical(spec: Any) -> str | None:
    """The canonical JSON text of an OpenAI response_format (a dict, or its JSON text);
    None for plain text. Raises InvalidResponseFormat naming the problem."""
    if isinstance(spec, str):
        return _normalize_text(spec)
    if not isinstance(spec, dict):
        _not_an_object(spec)
    try:
        text = dumps(spec)
    except (TypeError, ValueError) as exc:
        raise InvalidResponseFormat(f"response_format is not JSON: {exc}") from None
    return _normalize_text(text)


def _not_an_object(spec: Any) -> None:
    raise InvalidResponseFormat(f"response_format must be an object, got "
                                f"{type(spec).__name__}")


@lru_cache(maxsize=256)
def _normalize_text(text: str) -> str | None:
    try:
        spec = json.loads(text)
    except ValueError:
        raise InvalidResponseFormat("response_format is not valid JSON") from None
    if not isinstance(spec, dict):
        _not_an_object(spec)
    kind = spec.get("type")
    if kind not in TYPES:
        raise InvalidResponseFormat(f"response_format.type must be one of {TYPES}, got "
                                    f"{kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return dumps({"type": "json_object"})
    return dumps({"type": "json_schema", "json_schema": _check_json_schema(
        spec.get("json_schema"))})


def _check_json_schema(js: Any) -> dict:
    if not isinstance(js, dict):
        raise InvalidResponseFormat("response_format.json_schema must be an object with a "
                                    "'schema'")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise InvalidResponseFormat(f"response_format.json_schema.schema must be a JSON "
                                    f"Schema object, got {type(schema).__name__}")
    name, strict = js.get("name"), js.get("strict")
    if name is not None and not isinstance(name, str):
        raise InvalidResponseFormat("response_format.json_schema.name must be a string")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidResponseFormat("response_format.json_schema.strict must be a boolean")
    error = _validate(dumps(schema))
    if error:
        raise InvalidResponseFormat(f"response_format.json_schema.schema is not supported: "
                                    f"{error}")
    out = {"schema": schema}
    if name is not None:
        out["name"] = name
    if strict is not None:
        out["strict"] = strict
    return out


def _validate(schema_text: str) -> str:
    """The library's objection to a schema ('' when it can enforce it), without a tokenizer."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, JSON_OPTIONS,
                                                                STRICT)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return "; ".join(messages) if is_error else ""


def schema_of(canonical: str) -> dict:
    """The JSON Schema a canonical response_format asks the answer to satisfy."""
    spec = json.loads(canonical)
    return ANY_OBJECT if spec["type"] == "json_object" else spec["json_schema"]["schema"]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)  # keys in order


def schema_error(schema: dict, strict: bool = True) -> str:
    """The library's objection to a JSON Schema, enforced strictly (an unsupported keyword
    refused) or leniently (ignored); '' when it can enforce it. A forced tool call's
    arguments are checked so, before its grammar is written."""
    if strict:
        return _validate(dumps(schema))
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            dumps(schema), JSON_OPTIONS, {"lenient": True})
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return "; ".join(messages) if is_error else ""
