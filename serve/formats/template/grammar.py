"""A chat.json reply as an llguidance grammar: the answer, then calls in serve's generic
format (serve/formats/template/tools.py), each after the template's `open` markup."""
from __future__ import annotations

import json
from typing import Sequence

from serve.core.client_json import Json
from serve.core.errors import invalid
from serve.core.request import ChatRequest
from serve.formats.grammar import (answer, chosen_tools, grammar_field, json_rule, Lark, literal,
                                   numbered, shown, special)

def _call_arguments(parameters: Json, path: str) -> dict:
    """A tool's parameters as the schema its arguments object is held to: an object, with
    its declared keys (required ones among them) and, unless it allows more, no others:
    a weak model would invent them."""
    schema = dict(parameters) if isinstance(parameters, dict) else {}
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid(f"{path}.type", f"{path}.type: a tool's arguments are an object, "
                                      f"not {shown(kind)}")
    schema["type"] = "object"
    properties = schema.get("properties")
    if properties is None or isinstance(properties, dict):
        required = schema.get("required")
        declared = [k for k in required if isinstance(k, str)] if isinstance(required, list) else []
        schema["properties"] = {**{key: {} for key in declared}, **(properties or {})}
        schema.setdefault("additionalProperties", False)
    return schema


def template_grammar(req: ChatRequest, marker: Sequence[int | str]) -> Lark:
    """A chat.json reply: the answer, then the calls of the generic format
    (serve/formats/template/tools.py), each `marker` (the template's `open` markup: special token
    ids and text) then `{"name": NAME, "arguments": ARGUMENTS}`."""
    g = Lark(grammar_field(req))
    tools, at_least, at_most = chosen_tools(req)
    body = answer(g, req, bool(at_least))
    if at_most:
        opening = " ".join(special(part) if isinstance(part, int) else literal(part)
                           for part in marker)
        alternatives = []
        for j, tool in tools:
            fn = tool["function"]
            field = f"tools[{j}].function.parameters"
            arguments = g.add(json_rule(_call_arguments(fn.get("parameters"), field), {},
                                         lenient=fn.get("strict") is not True), field=field)
            head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
            alternatives.append(f"{literal(head)} {arguments} {literal('}')}")
        call = g.add(f"{opening} ({' | '.join(alternatives)})")
        calls = numbered(g, lambda index: call, at_most)
        body = f"{body} {calls}" if at_least else f"{body} ({calls})?"
    g.add(body, "start")
    return g
