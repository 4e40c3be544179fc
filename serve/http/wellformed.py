"""Every string in a request body is Unicode that can be written back, and every number finite.

JSON can carry what a reply cannot: a lone surrogate (`"\\ud800"`, which no
UTF-8 encoder writes) and numbers past a double's range (`1e999` parses as
infinity, which JSON cannot write). Echoed into a reply, stored, or handed to
the engine, either fails long after the request was accepted. So a body
holding one is a 400 at parse time, naming the field, in every dialect alike.

The walk is paid for only when the body can hold one: a lone surrogate comes
only from a `\\uD800`-`\\uDFFF` escape in the raw text, and an infinity only
from a float the parser saw overflow.
"""
from __future__ import annotations

import math
import re
from typing import Callable

from serve.core.client_json import Json
from serve.core.errors import invalid

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Python's decoder pairs escaped surrogates, so any left in a str stand alone.
_SURROGATE = re.compile("[\ud800-\udfff]")


class FloatWatch:
    """json.loads' parse_float: floats as usual, remembering whether one overflowed."""

    def __init__(self) -> None:
        self.overflowed = False

    def __call__(self, text: str) -> float:
        value = float(text)
        if math.isinf(value):
            self.overflowed = True
        return value


def check(value: Json, text: str, overflowed: bool) -> None:
    """A 400 naming the first field of the parsed body `value` (parsed from `text`) that
    holds a lone surrogate or an infinite number."""
    # Surrogates first: a path through a key that holds one could not be written either.
    if _SURROGATE_ESCAPE.search(text):
        _walk(value, lambda item: isinstance(item, str) and _SURROGATE.search(item) is not None,
              "holds a lone surrogate (half of a UTF-16 pair), which is not Unicode text")
    if overflowed:
        _walk(value, lambda item: isinstance(item, float) and math.isinf(item),
              "is a number beyond the range of a double")


def _walk(value: Json, bad: Callable[[Json], bool], why: str) -> None:
    stack: list[tuple[Json, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if bad(key):
                    raise invalid(path or "body", f"{path or 'the body'} has a key that {why}")
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
        elif bad(item):
            raise invalid(path, f"{path} {why}")
