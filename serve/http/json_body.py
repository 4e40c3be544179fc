"""Request bodies as JSON objects, refused before they can cost far more memory than their bytes."""
from __future__ import annotations

import json

from serve.core.client_json import Json
from serve.http import wellformed
from serve.core.errors import ApiError

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 50_000  # objects and arrays in one body ('{' and '[' bytes)
MAX_JSON_ITEMS = 1_000_000     # members and elements in one body (',' bytes)


def parse_body(raw: bytearray) -> dict:
    """A request body, read whole, as the JSON object it must be. The bytes are emptied once
    decoded, so a large body costs its text and its parsed values, not the bytes as well."""
    check_json_size(raw)
    text = decode_body(raw)
    del raw[:]
    return parse_json_text(text)


def json_depth(value: Json) -> int:
    """Nesting depth of a parsed JSON value, without recursion.

    One iterator per open level, so the walk costs memory in the depth, not
    in the number of values.
    """
    deepest, stack = 0, [iter([value])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (dict, list)):
                stack.append(iter(item.values() if isinstance(item, dict) else item))
                deepest = max(deepest, len(stack) - 1)
                break
        else:
            stack.pop()
    return deepest


def check_json_size(raw: bytes | bytearray) -> None:
    """Refuse, before parsing, a body whose values would cost far more memory than its bytes.

    A 64 MB body of tiny objects parses into gigabytes of Python values. The
    counts are of raw bytes, so braces and commas inside strings count too: a
    body refused for them is text far too long for any context anyway.
    """
    containers, items = raw.count(b"{") + raw.count(b"["), raw.count(b",")
    if containers > MAX_JSON_CONTAINERS or items > MAX_JSON_ITEMS:
        raise ApiError(413, f"request body has more than {MAX_JSON_CONTAINERS} objects and arrays "
                            f"or more than {MAX_JSON_ITEMS} values", code="request_too_large")


def decode_body(raw: bytes | bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8", code="invalid_body") from None


def _not_json(constant: str) -> Json:
    raise ValueError(f"{constant} is not a JSON value")


def parse_json_text(text: str) -> dict:
    floats = wellformed.FloatWatch()
    try:
        value = json.loads(text, parse_float=floats, parse_constant=_not_json)
    except RecursionError:  # Python's parser recurses once per nesting level
        raise ApiError(400, f"JSON is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_body") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_body") from None
    if not isinstance(value, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ApiError(400, f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_body")
    wellformed.check(value, text, floats.overflowed)
    return value
