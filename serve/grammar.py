"""What a reply must look like, as an llguidance grammar, and the vocabulary it is matched on.

A request that asks for structure (`response_format`, `tools`, a `tool_choice`)
becomes one Lark grammar covering the whole reply: on XTML, free reasoning
until the think element closes, then the response (a JSON document when a
format is asked for), then the tools block exactly as `xtml._write_tool_call`
writes calls into history, then the message close; on a chat.json model, the
JSON document alone. Markup is matched as the special tokens it is, never as
text, so the reply parser (serve/xtml_reply.py) reads back what was forced.

llguidance is optional: without it `missing()` says why, and nothing here
is used.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

try:
    import llguidance
except ImportError as _e:  # the server runs without it: structured output is then off
    llguidance = None
    _IMPORT_ERROR: Optional[str] = f"llguidance is not installed ({_e})"
else:
    _IMPORT_ERROR = None

from .api import ApiError, ChatRequest, invalid
from .decode import missing as _decode_missing
from .xtml import escape_attr

ENABLE_HINT = "pip install -r requirements-optional.txt"

# JSON in answers and argument bodies is written like json.dumps writes it
# (and like history carries it): no free whitespace, which a weak or random
# model would otherwise repeat until the token limit.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Every JSON type an argument element can declare, and the JSON Schema types behind it.
ARGUMENT_TYPES = {"string": ("string",), "number": ("integer", "number"), "boolean": ("boolean",),
                  "null": ("null",), "object": ("object",), "array": ("array",)}
MAX_REF_DEPTH = 32
_UNESCAPED_SLASH = re.compile(r"(?<!\\)/")   # ends a Lark regex literal
# Tool calls are numbered in the grammar (index="1", "2", ...) up to this many per reply.
MAX_CALLS = 16


def missing() -> Optional[str]:
    """Why structured output is off, or None when it is on."""
    return _IMPORT_ERROR or _decode_missing()


def off_message(what: str, why: str) -> str:
    return f"{what} needs structured output, which is off here ({why}); to enable: {ENABLE_HINT}"


# ---- which requests need a grammar ---------------------------------------------------------

def _schema_of(req: ChatRequest) -> Optional[dict]:
    """The JSON Schema the answer must satisfy, or None when no format is asked for."""
    fmt = req.response_format
    if fmt is None:
        return None
    if fmt["type"] == "json_object":
        return {"type": "object"}
    schema = fmt["json_schema"].get("schema")
    return schema if isinstance(schema, dict) else {}


def _format_strict(req: ChatRequest) -> bool:
    fmt = req.response_format
    return fmt is not None and fmt["type"] == "json_schema" and fmt["json_schema"].get("strict") is True


def _strict(req: ChatRequest) -> Optional[str]:
    """The field of a request that demands enforced structure, if any."""
    if _format_strict(req):
        return "response_format.json_schema.strict"
    for j, tool in enumerate(req.tools or ()):
        if (tool.get("function") or {}).get("strict") is True:
            return f"tools[{j}].function.strict"
    return None


def wants_grammar(req: ChatRequest) -> bool:
    """Does this request ask for anything a grammar enforces?"""
    return req.response_format is not None or bool(req.tools)


def check_available(req: ChatRequest, format_in_prompt: bool, off: Optional[str]) -> bool:
    """True when the request is to be constrained; a 400 when it must be but cannot be.

    `off` says why structured output is off (None: it is on). Then a request
    falls back to the prompt's notes, unless it demands strictness or its chat
    format has no way to ask for the format.
    """
    if not wants_grammar(req):
        return False
    if off is None:
        return True
    field = _strict(req) or (None if format_in_prompt or req.response_format is None
                             else "response_format")
    if field is not None:
        raise invalid(field, off_message(field, off), code="structured_output_unavailable")
    return False


# ---- grammar text ---------------------------------------------------------------------------

def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _special(token: int) -> str:
    return f"<[{token}]>"


def _json_rule(schema: Mapping[str, Any], defs: Mapping[str, Any], lenient: bool) -> str:
    body = dict(schema)
    for key, value in defs.items():  # $refs inside resolve against the inlined schema's root
        body.setdefault(key, value)
    body["x-guidance"] = {**JSON_STYLE, "lenient": lenient}
    return "%json " + json.dumps(body, ensure_ascii=False)


def _defs(schema: Mapping[str, Any]) -> dict:
    return {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}


class _Lark:
    """Accumulates named rules."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self._n = 0

    def add(self, body: str, name: str = "") -> str:
        self._n += 1
        name = name or f"r{self._n}"
        self.rules.append(f"{name}: {body}")
        return name

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"


@dataclass(frozen=True)
class Markup:
    """The special tokens a K3 reply is structured with."""
    open: int
    sep: int
    close: int

    def element(self, header: str, body: str) -> str:
        """`<|open|>header<|sep|> body <|close|>name<|sep|>`, as grammar."""
        name = header.split(" ", 1)[0]
        return (f"{_special(self.open)} {_literal(header)} {_special(self.sep)} {body} "
                f"{_special(self.close)} {_literal(name)} {_special(self.sep)}")

    def closing(self, name: str) -> str:
        return f"{_special(self.close)} {_literal(name)} {_special(self.sep)}"


def _resolve(schema: Any, root: Mapping[str, Any]) -> dict:
    """A property's schema with local $refs followed (for deciding its element's type)."""
    for _ in range(MAX_REF_DEPTH):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            break
        node: Any = root
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"only local $refs are supported, not {ref!r}")
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ValueError(f"$ref {ref!r} does not resolve")
        schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **node}
    return schema if isinstance(schema, dict) else {}


def _raw_string(g: _Lark, schema: Mapping[str, Any]) -> str:
    """An argument body of type string: the text itself, unquoted, as history writes it."""
    if isinstance(schema.get("pattern"), str):
        return g.add("/" + _UNESCAPED_SLASH.sub(r"\\/", schema["pattern"]) + "/")
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return g.add(f"/(?s:.{{{int(low)},{'' if high is None else int(high)}}})/")


class _ToolGrammar:
    """The tools block: calls of declared tools, each argument element typed by the schema."""

    def __init__(self, g: _Lark, markup: Markup):
        self.g, self.m = g, markup
        self.lenient = True   # unknown schema keywords ignored, unless the tool is strict

    def argument_bodies(self, schema: Any, root: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(type attribute, body rule) pairs a value of `schema` can be written as."""
        schema = _resolve(schema, root)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            return [pair for branch in branches
                    for pair in self.argument_bodies({**rest, **_resolve(branch, root)}, root)]
        values = ([schema["const"]] if "const" in schema
                  else schema["enum"] if isinstance(schema.get("enum"), list) else None)
        if values is not None:
            return self._enum_bodies(values)
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        pairs = []
        for attr, json_types in ARGUMENT_TYPES.items():
            allowed = [t for t in json_types if types is None or t in types]
            if not allowed:
                continue
            if attr == "string":
                pairs.append((attr, _raw_string(self.g, schema)))
            else:
                typed = {**schema, "type": "number" if "number" in allowed else allowed[0]}
                pairs.append((attr, self.g.add(_json_rule(typed, _defs(root), self.lenient))))
        return pairs

    def _enum_bodies(self, values: Sequence[Any]) -> list[tuple[str, str]]:
        by_type: dict[str, list[str]] = {}
        for value in values:
            kind = _type_attr(value)
            body = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            by_type.setdefault(kind, []).append(_literal(body))
        return [(kind, self.g.add(" | ".join(dict.fromkeys(bodies)))) for kind, bodies in by_type.items()]

    def arguments(self, parameters: Any) -> str:
        """The argument elements of one call: declared keys in order, required ones present."""
        params = parameters if isinstance(parameters, dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = [k for k in params.get("required") or () if isinstance(k, str)]
        keys = list(props) + [k for k in required if k not in props]
        parts = []
        for key in keys:
            bodies = self.argument_bodies(props.get(key, {}), params)
            if not bodies:
                if key in required:
                    raise ValueError(f"required argument {key!r} admits no value")
                continue
            options = " | ".join(
                self.m.element(f'argument key="{escape_attr(key)}" type="{attr}"', body)
                for attr, body in bodies)
            rule = self.g.add(options)
            parts.append(rule if key in required else f"{rule}?")
        return " ".join(parts)

    def block(self, tools: Sequence[Mapping[str, Any]], at_most: int) -> str:
        """`<|open|>tools<|sep|>` one to `at_most` calls `<|close|>tools<|sep|>`, numbered from 1."""
        args = {}
        for tool in tools:
            fn = tool["function"]
            self.lenient = fn.get("strict") is not True
            args[fn["name"]] = self.g.add(self.arguments(fn.get("parameters")) or '""')
        more = ""
        for index in range(at_most, 0, -1):
            call = " | ".join(self.m.element(f'call tool="{escape_attr(name)}" index="{index}"', rule)
                              for name, rule in args.items())
            more = self.g.add(f"({call}) {more}?" if more else call)
        return self.m.element("tools", more)


def _type_attr(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _chosen_tools(req: ChatRequest) -> tuple[list, int, int]:
    """(tools the reply may call, at least, at most) for the request's tool_choice."""
    tools = list(req.tools or ())
    choice = req.tool_choice
    if not tools or choice == "none":
        return [], 0, 0
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise invalid("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return named, 1, 1
    return tools, (1 if choice == "required" else 0), MAX_CALLS


def xtml_grammar(req: ChatRequest, markup: Markup, thinking: bool) -> str:
    """The whole XTML reply, from just after the generation prompt to the message close."""
    g = _Lark()
    schema = _schema_of(req)
    tools, at_least, at_most = _chosen_tools(req)
    if schema is not None:
        response = g.add(_json_rule(schema, _defs(schema), lenient=not _format_strict(req)))
    elif at_least:
        response = '""'  # a forced call is the whole answer
    else:
        response = g.add("/(?s:.*)/")
    parts = [f"{response} {markup.closing('response')}"]
    if at_most:
        block = _ToolGrammar(g, markup).block(tools, at_most)
        parts.append(block if at_least else f"({block})?")
    parts.append(markup.closing("message"))
    body = " ".join(parts)
    if thinking:
        body = (f"{g.add('/(?s:.*)/')} {markup.closing('think')} "
                f"{_special(markup.open)} \"response\" {_special(markup.sep)} {body}")
    g.add(body, "start")
    return g.text()


def json_grammar(req: ChatRequest) -> str:
    """A chat.json reply: the JSON document and nothing else (that format refuses tools)."""
    schema = _schema_of(req)
    return f"start: {_json_rule(schema, _defs(schema), lenient=not _format_strict(req))}\n"


def compile_grammar(lark: str, field: str) -> str:
    """The grammar in llguidance's form; a 400 naming `field` when it cannot be enforced."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise invalid(field, f"cannot enforce this structure: {messages[0]}",
                      code="unsupported_schema")
    return grammar


def grammar_field(req: ChatRequest) -> str:
    return "response_format" if req.response_format is not None else "tools"


# ---- the vocabulary --------------------------------------------------------------------------

class Vocabulary:
    """Every token's bytes (waste_detokenize) and llguidance's tokenizer over them."""

    def __init__(self, engine: Any, n_vocab: int, eos: Sequence[int]):
        self.n_vocab = n_vocab
        self.pieces = [engine.detokenize([i]) for i in range(n_vocab)]
        specials = sorted(i for i in engine.specials.values() if i < n_vocab)
        self.eos = tuple(eos)
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Encoder(engine, self.pieces, specials, self.eos[0])),
            n_vocab=n_vocab, eos_token=list(self.eos))

    def matcher(self, grammar: str) -> "llguidance.LLMatcher":
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ApiError(400, f"cannot enforce this structure: {m.get_error()}",
                           code="unsupported_schema")
        return m


class _Encoder:
    """What llguidance's TokenizerWrapper reads: token bytes, specials, and an encoder."""

    def __init__(self, engine: Any, pieces: list[bytes], specials: list[int], eos: int):
        self._engine = engine
        self.tokens = pieces
        self.special_token_ids = specials
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, data: bytes) -> list[int]:
        return self._engine.tokenize(data.decode("utf-8", "replace").replace("\0", ""))
