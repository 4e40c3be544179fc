"""What a reply must look like, as an llguidance grammar, and the vocabulary it is matched on.

A request that asks for structure (`response_format`, `tools`, a `tool_choice`)
becomes one Lark grammar covering the whole reply. This module holds what every
format's grammar shares: which requests need one, the `Lark` builder, the answer
(free text or a JSON document), the tools a reply may call, compiling, and the
vocabulary. Each chat format writes its own reply's shape: XTML in
serve/formats/xtml/grammar.py, chat.json's generic calls in
serve/formats/template/grammar.py. Markup is matched as the special tokens it
is, never as text, so the reply parsers read back what was forced.

llguidance is optional: without it `missing()` says why, and nothing here
is used.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

try:
    import llguidance
except ImportError as _e:  # the server runs without it: structured output is then off
    llguidance = None  # type: ignore[assignment]
    _IMPORT_ERROR: Optional[str] = f"llguidance is not installed ({_e})"
else:
    _IMPORT_ERROR = None

from serve.core.client_json import Json, JsonObject
from serve.core.errors import ApiError, invalid
from serve.core.request import ChatRequest
from serve.engine.api import EngineApi
from serve.engine.decode import missing as _decode_missing

ENABLE_HINT = "pip install '.[structured]' (in a checkout: pip install -r requirements-optional.txt)"

# JSON in answers and argument bodies is written like json.dumps writes it
# (and like history carries it): no free whitespace, which a weak or random
# model would otherwise repeat until the token limit.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LINE_ERROR = re.compile(r"at (\d+)\(\d+\): ", re.S)   # llguidance: "at LINE(COLUMN): why"
_EXCERPT = re.compile(r"\n\s*\d+ \| ")                   # where it starts quoting the grammar
MAX_SHOWN = 300   # characters of a client's value or of llguidance's complaint put in a message
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


def check_available(req: ChatRequest, format_in_prompt: bool, tools_in_prompt: bool,
                    off: Optional[str]) -> bool:
    """True when the request is to be constrained; a 400 when it must be but cannot be.

    `off` says why structured output is off (None: it is on). Then a request falls back
    to the prompt's notes, unless it demands strictness, or asks for a format its chat
    format cannot ask for in the prompt (`format_in_prompt`), or for calls its chat
    format cannot get from the prompt alone (`tools_in_prompt`).
    """
    if not wants_grammar(req):
        return False
    if off is None:
        return True
    field = (_strict(req)
             or (None if format_in_prompt or req.response_format is None else "response_format")
             or (None if tools_in_prompt or not chosen_tools(req)[2] else "tools"))
    if field is not None:
        raise invalid(field, off_message(field, off), code="structured_output_unavailable")
    return False


# ---- grammar text ---------------------------------------------------------------------------

def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def special(token: int) -> str:
    return f"<[{token}]>"


def shown(value: Json) -> str:
    """A client's value, as a message may quote it: as JSON, and never long."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def json_rule(schema: JsonObject, defs: JsonObject, lenient: bool) -> str:
    body = dict(schema)
    for key, value in defs.items():  # $refs inside resolve against the inlined schema's root
        body.setdefault(key, value)
    body["x-guidance"] = {**JSON_STYLE, "lenient": lenient}
    return "%json " + json.dumps(body, ensure_ascii=False)


def defs_of(schema: JsonObject) -> dict:
    return {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}


class Lark:
    """A grammar's rules, one per line, each remembering the request field it enforces.

    llguidance names the line it cannot build; `explain` turns that into the
    field, so a 400 says which schema (and often which keyword) is at fault.
    Every body is one line: literals are JSON strings, regexes go through
    llguidance's own quoting, and %json bodies are json.dumps output.
    """

    def __init__(self, field: str) -> None:
        self.field = field   # the field of rules that carry no schema of their own
        self.rules: list[str] = []
        self.fields: list[str] = []
        self._n = 0

    def add(self, body: str, name: str = "", field: str = "") -> str:
        self._n += 1
        name = name or f"r{self._n}"
        self.rules.append(f"{name}: {body}")
        self.fields.append(field or self.field)
        return name

    def terminal(self, body: str, field: str) -> str:
        """A lexeme rule (an UPPERCASE name), which `&` needs."""
        return self.add(body, f"T{self._n + 1}", field)

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"

    def explain(self, complaint: str) -> tuple[str, str]:
        """(field, why) for llguidance's complaint about this grammar."""
        field, why = self.field, complaint
        at = _LINE_ERROR.match(complaint)
        if at is not None:
            line = int(at.group(1))
            field = self.fields[line - 1] if 0 < line <= len(self.fields) else self.field
            why = complaint[at.end():]
        why = " ".join(_EXCERPT.split(why, 1)[0].split())  # without its quote of the grammar
        return field, why if len(why) <= MAX_SHOWN else why[:MAX_SHOWN] + "..."


def chosen_tools(req: ChatRequest) -> tuple[list[tuple[int, dict]], int, int]:
    """(tools the reply may call, with their places in `tools`; at least; at most) for the
    request's tool_choice and parallel_tool_calls."""
    tools = list(enumerate(req.tools or ()))
    choice = req.tool_choice
    if not tools or choice == "none":
        return [], 0, 0
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        named = [(j, t) for j, t in tools if t["function"]["name"] == name]
        if not named:
            raise invalid("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return named, 1, 1
    return tools, (1 if choice == "required" else 0), (MAX_CALLS if req.parallel_tool_calls else 1)


def answer(g: Lark, req: ChatRequest, forced_call: bool) -> str:
    """The answer before any call: the JSON document a format asks for, nothing when a call
    is forced (it is the whole answer), else free text."""
    schema = _schema_of(req)
    if schema is not None:
        return g.add(json_rule(schema, defs_of(schema), lenient=not _format_strict(req)),
                     field=_format_field(req))
    return '""' if forced_call else g.add("/(?s:.*)/")


def numbered(g: Lark, call: Callable[[int], str], at_most: int) -> str:
    """One to `at_most` of `call(index)` in a row, numbered from 1."""
    more = ""
    for index in range(at_most, 0, -1):
        more = g.add(f"({call(index)}) {more}?" if more else call(index))
    return more


def _format_field(req: ChatRequest) -> str:
    fmt = req.response_format
    return "response_format.json_schema.schema" if fmt and fmt["type"] == "json_schema" else "response_format"


def regex_to_lark(pattern: str) -> str:
    """A regex as a Lark terminal's body, translated by llguidance."""
    return llguidance.regex_to_lark(pattern)


def compile_grammar(lark: Lark) -> str:
    """The grammar in llguidance's form; a 400 naming the field it cannot enforce."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark.text())
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        field, why = lark.explain(messages[0])
        raise invalid(field, f"cannot enforce {field}: {why}", code="unsupported_schema")
    return grammar


def grammar_field(req: ChatRequest) -> str:
    return "response_format" if req.response_format is not None else "tools"


# ---- the vocabulary --------------------------------------------------------------------------

class Vocabulary:
    """Every token's bytes (waste_detokenize) and llguidance's tokenizer over them."""

    def __init__(self, engine: EngineApi, n_vocab: int, eos: Sequence[int]):
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

    def __init__(self, engine: EngineApi, pieces: list[bytes], specials: list[int], eos: int):
        self._engine = engine
        self.tokens = pieces
        self.special_token_ids = specials
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, data: bytes) -> list[int]:
        return self._engine.tokenize(data.decode("utf-8", "replace").replace("\0", ""))
