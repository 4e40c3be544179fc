"""What a reply must look like, as an llguidance grammar, and the vocabulary it is matched on.

A request that asks for structure (`response_format`, `tools`, a `tool_choice`)
becomes one Lark grammar covering the whole reply: on XTML, free reasoning
until the think element closes, then the response (a JSON document when a
format is asked for), then the tools block exactly as `xtml._write_tool_call`
writes calls into history, then the message close; on a chat.json model, the
answer, then calls in serve's generic format (serve/formats/template/tools.py), each
after the template's `open` markup. Markup is matched as the special tokens it
is, never as text, so the reply parsers read back what was forced.

llguidance is optional: without it `missing()` says why, and nothing here
is used.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

try:
    import llguidance
except ImportError as _e:  # the server runs without it: structured output is then off
    llguidance = None  # type: ignore[assignment]
    _IMPORT_ERROR: Optional[str] = f"llguidance is not installed ({_e})"
else:
    _IMPORT_ERROR = None

from serve.core.api import ApiError, ChatRequest, invalid
from serve.engine.decode import missing as _decode_missing
from serve.formats.xtml.render import escape_attr

ENABLE_HINT = "pip install '.[structured]' (in a checkout: pip install -r requirements-optional.txt)"

# JSON in answers and argument bodies is written like json.dumps writes it
# (and like history carries it): no free whitespace, which a weak or random
# model would otherwise repeat until the token limit.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Every JSON type an argument element can declare, and the JSON Schema types behind it.
ARGUMENT_TYPES = {"string": ("string",), "number": ("integer", "number"), "boolean": ("boolean",),
                  "null": ("null",), "object": ("object",), "array": ("array",)}
MAX_REF_DEPTH = 32        # $refs followed in a row, and anyOf/oneOf levels, in one argument
MAX_ALTERNATIVES = 1024   # schemas one argument's anyOf/oneOf branches may expand into
# A string argument is written unquoted, so its body is a regex of its own making: no reply
# holds a string this long, so a longer maxLength bounds nothing and a longer minLength
# admits nothing a reply could end.
LONGEST_STRING = 1 << 24
JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
# What constrains a string that its regex does not enforce: a strict tool is refused for
# them, a lenient one ignores them (as llguidance ignores what it cannot enforce).
UNENFORCED_STRING_KEYWORDS = ("format", "allOf", "not", "if", "then", "else")
# What constrains the arguments object beyond its declared keys, which calls are built from.
UNENFORCED_OBJECT_KEYWORDS = ("minProperties", "maxProperties", "patternProperties",
                              "propertyNames", "dependentRequired", "dependentSchemas",
                              "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then", "else")
# A JSON-typed argument is enforced as its own %json document, whose root carries the tool's
# $defs: only $refs into those mean there what they meant in the tool's schema.
_DEF_REF = re.compile(r"#/(\$defs|definitions)/")
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
             or (None if tools_in_prompt or not _chosen_tools(req)[2] else "tools"))
    if field is not None:
        raise invalid(field, off_message(field, off), code="structured_output_unavailable")
    return False


# ---- grammar text ---------------------------------------------------------------------------

def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _special(token: int) -> str:
    return f"<[{token}]>"


def _shown(value: Any) -> str:
    """A client's value, as a message may quote it: as JSON, and never long."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _json_rule(schema: Mapping[str, Any], defs: Mapping[str, Any], lenient: bool) -> str:
    body = dict(schema)
    for key, value in defs.items():  # $refs inside resolve against the inlined schema's root
        body.setdefault(key, value)
    body["x-guidance"] = {**JSON_STYLE, "lenient": lenient}
    return "%json " + json.dumps(body, ensure_ascii=False)


def _defs(schema: Mapping[str, Any]) -> dict:
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


def _pointer(root: Any, ref: str) -> tuple[Any, list[str]]:
    """What a local `#/a/b` reference points at in `root` (None if nothing), and its steps."""
    steps = [part.replace("~1", "/").replace("~0", "~") for part in ref[2:].split("/")]
    node = root
    for step in steps:
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None, steps
    return node, steps


def _resolve(schema: Any, root: Mapping[str, Any], path: str, root_path: str) -> tuple[Any, str]:
    """A schema with its $refs into `root` followed, and the path of where it now comes from."""
    for _ in range(MAX_REF_DEPTH):
        if not isinstance(schema, dict) or "$ref" not in schema:
            return schema, path
        ref, where = schema["$ref"], f"{path}.$ref"
        if ref == "#":
            raise invalid(where, f"{where}: a $ref to the whole schema is not supported here; "
                                 "put what is shared under $defs")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise invalid(where, f"{where}: only local $refs (#/...) are supported, not {_shown(ref)}")
        node, steps = _pointer(root, ref)
        if not isinstance(node, (dict, bool)):
            raise invalid(where, f"{where}: {_shown(ref)} does not resolve to a schema")
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        if isinstance(node, dict):
            schema = {**siblings, **node}
        else:   # true admits what the siblings admit; false admits nothing
            schema = (siblings or True) if node else False
        path = root_path + "".join(f".{step}" for step in steps)
    raise invalid(path, f"{path}: $refs lead on to $refs more than {MAX_REF_DEPTH} times")


def _check_refs(schema: Any, path: str) -> None:
    """Every $ref in a JSON-typed argument's schema points into the $defs its rule carries."""
    stack = [(schema, path)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (isinstance(ref, str) and _DEF_REF.match(ref)):
                raise invalid(f"{at}.$ref", f"{at}.$ref: inside an argument, $refs must point "
                                            f"into $defs or definitions, not {_shown(ref)}")
            stack.extend((value, f"{at}.{key}") for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, f"{at}[{i}]") for i, value in enumerate(node))


def _length(schema: Mapping[str, Any], key: str, path: str) -> Optional[int]:
    """minLength or maxLength: absent (None), or a count; a 400 naming it otherwise."""
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{path}.{key}", f"{path}.{key} must be a non-negative integer, "
                                       f"not {_shown(value)}")
    return value


class _ToolGrammar:
    """The tools block: calls of declared tools, each argument element typed by the schema."""

    def __init__(self, g: Lark, markup: Markup):
        self.g, self.m = g, markup
        self.strict = False   # unknown schema keywords ignored, unless the tool is strict
        self._left = 0        # how many more schemas the argument being built may expand into

    def argument_bodies(self, schema: Any, root: Mapping[str, Any], path: str,
                        root_path: str, depth: int = 0) -> list[tuple[str, str]]:
        """(type attribute, body rule) pairs a value of `schema` (found at `path`) can be written as."""
        self._left -= 1
        if depth > MAX_REF_DEPTH or self._left < 0:
            raise invalid(path, f"{path}: anyOf/oneOf nest deeper than {MAX_REF_DEPTH} levels or "
                                f"expand into more than {MAX_ALTERNATIVES} schemas (is it recursive?)")
        schema, path = _resolve(schema, root, path, root_path)
        if isinstance(schema, bool):
            schema = {} if schema else {"enum": []}   # true admits anything, false nothing
        if not isinstance(schema, dict):
            raise invalid(path, f"{path} must be a schema (an object or a boolean), not {_shown(schema)}")
        for key in ("anyOf", "oneOf"):
            if key not in schema:
                continue
            branches = schema[key]
            if not isinstance(branches, list):
                raise invalid(f"{path}.{key}", f"{path}.{key} must be a list of schemas")
            rest = {k: v for k, v in schema.items() if k != key}   # a oneOf beside it applies too
            pairs = []
            for i, branch in enumerate(branches):
                branch, at = _resolve(branch, root, f"{path}.{key}[{i}]", root_path)
                if isinstance(branch, dict):
                    branch = {**rest, **branch}
                elif branch is True:
                    branch = rest
                pairs += self.argument_bodies(branch, root, at, root_path, depth + 1)
            return pairs
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list):
                raise invalid(f"{path}.enum", f"{path}.enum must be a list")
            return self._enum_bodies(values, path)
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if "type" in schema and not (isinstance(types, list)
                                      and all(isinstance(t, str) and t in JSON_TYPES for t in types)):
            raise invalid(f"{path}.type", f"{path}.type must be one of {', '.join(JSON_TYPES)} "
                                          f"or a list of them, not {_shown(schema['type'])}")
        pairs = []
        for attr, json_types in ARGUMENT_TYPES.items():
            allowed = [t for t in json_types if types is None or t in types]
            if not allowed:
                continue
            if attr == "string":
                body = self._raw_string(schema, path)
                if body is not None:
                    pairs.append((attr, body))
            else:
                typed = {**schema, "type": "number" if "number" in allowed else allowed[0]}
                _check_refs(typed, path)
                pairs.append((attr, self.g.add(_json_rule(typed, _defs(root), not self.strict),
                                               field=path)))
        return pairs

    def _raw_string(self, schema: Mapping[str, Any], path: str) -> Optional[str]:
        """An argument body of type string: the text itself, unquoted, as history writes it;
        None when the schema admits no string."""
        if self.strict:
            for key in UNENFORCED_STRING_KEYWORDS:
                if key in schema:
                    raise invalid(f"{path}.{key}", f"{path}.{key}: a string argument is written "
                                  "unquoted, and its pattern, minLength, maxLength, enum and const "
                                  f"are all a strict tool can enforce there, not {key}",
                                  code="unsupported_schema")
        low, high = _length(schema, "minLength", path) or 0, _length(schema, "maxLength", path)
        if low > LONGEST_STRING:
            raise invalid(f"{path}.minLength", f"{path}.minLength: no reply holds a string that long")
        if high is not None and high < low:
            return None
        bound = f"/(?s:.{{{low},{'' if high is None or high > LONGEST_STRING else high}}})/"
        if "pattern" not in schema:
            return self.g.add(bound, field=path)
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise invalid(f"{path}.pattern", f"{path}.pattern must be a string")
        regex = "/" + llguidance.regex_to_lark(pattern) + "/"
        if low == 0 and high is None:
            return self.g.add(regex, field=f"{path}.pattern")
        return self.g.terminal(f"{regex} & {bound}", field=f"{path}.pattern")

    def _enum_bodies(self, values: Sequence[Any], path: str) -> list[tuple[str, str]]:
        by_type: dict[str, list[str]] = {}
        for value in values:
            kind = _type_attr(value)
            body = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            by_type.setdefault(kind, []).append(body)
        pairs = []
        for kind, bodies in by_type.items():
            bodies = list(dict.fromkeys(bodies))
            # One regex, not a Lark alternation: llguidance builds the latter in time that
            # grows with the square of its length (a 130,000-value enum took 34 s).
            rule = (_literal(bodies[0]) if len(bodies) == 1 else
                    "/(?:" + "|".join(llguidance.regex_to_lark(re.escape(b)) for b in bodies) + ")/")
            pairs.append((kind, self.g.add(rule, field=f"{path}.enum")))
        return pairs

    def arguments(self, parameters: Any, path: str) -> str:
        """The argument elements of one call: declared keys in order, required ones present."""
        root = parameters if isinstance(parameters, dict) else {}
        params, where = _resolve(root, root, path, path)
        if not isinstance(params, dict):
            raise invalid(where, f"{where} must be a JSON Schema object")
        props = params.get("properties")
        props = {} if props is None else props
        if not isinstance(props, dict):
            raise invalid(f"{where}.properties", f"{where}.properties must be an object")
        required = params.get("required")
        required = [] if required is None else required
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise invalid(f"{where}.required", f"{where}.required must be a list of strings")
        if self.strict:
            self._check_strict_object(params, where)
        keys = list(props) + [k for k in required if k not in props]
        parts = []
        for key in keys:
            self._left = MAX_ALTERNATIVES
            at = f"{where}.properties.{key}"
            bodies = self.argument_bodies(props.get(key, {}), root, at, path)
            if not bodies:
                if key in required:
                    raise invalid(at, f"{at}: required argument {_shown(key)} admits no value")
                continue
            options = " | ".join(
                self.m.element(f'argument key="{escape_attr(key)}" type="{attr}"', body)
                for attr, body in bodies)
            rule = self.g.add(options, field=at)
            parts.append(rule if key in required else f"{rule}?")
        return " ".join(parts)

    @staticmethod
    def _check_strict_object(params: Mapping[str, Any], path: str) -> None:
        types = params.get("type", "object")
        if types != "object" and not (isinstance(types, list) and "object" in types):
            raise invalid(f"{path}.type", f"{path}.type: a strict tool's parameters are an object",
                          code="unsupported_schema")
        for key in UNENFORCED_OBJECT_KEYWORDS:
            if key in params:
                raise invalid(f"{path}.{key}", f"{path}.{key}: a strict tool's arguments are its "
                              f"declared properties, and {key} on them cannot be enforced",
                              code="unsupported_schema")

    def block(self, tools: Sequence[tuple[int, Mapping[str, Any]]], at_most: int) -> str:
        """`<|open|>tools<|sep|>` one to `at_most` calls `<|close|>tools<|sep|>`, numbered from 1."""
        args = {}
        for j, tool in tools:
            fn = tool["function"]
            self.strict = fn.get("strict") is True
            args[fn["name"]] = self.g.add(
                self.arguments(fn.get("parameters"), f"tools[{j}].function.parameters") or '""')
        calls = _numbered(self.g, lambda index: " | ".join(
            self.m.element(f'call tool="{escape_attr(name)}" index="{index}"', rule)
            for name, rule in args.items()), at_most)
        return self.m.element("tools", calls)


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


def _chosen_tools(req: ChatRequest) -> tuple[list[tuple[int, dict]], int, int]:
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


def _answer(g: Lark, req: ChatRequest, forced_call: bool) -> str:
    """The answer before any call: the JSON document a format asks for, nothing when a call
    is forced (it is the whole answer), else free text."""
    schema = _schema_of(req)
    if schema is not None:
        return g.add(_json_rule(schema, _defs(schema), lenient=not _format_strict(req)),
                     field=_format_field(req))
    return '""' if forced_call else g.add("/(?s:.*)/")


def _numbered(g: Lark, call: Callable[[int], str], at_most: int) -> str:
    """One to `at_most` of `call(index)` in a row, numbered from 1."""
    more = ""
    for index in range(at_most, 0, -1):
        more = g.add(f"({call(index)}) {more}?" if more else call(index))
    return more


def _format_field(req: ChatRequest) -> str:
    fmt = req.response_format
    return "response_format.json_schema.schema" if fmt and fmt["type"] == "json_schema" else "response_format"


def xtml_grammar(req: ChatRequest, markup: Markup, thinking: bool) -> Lark:
    """The whole XTML reply, from just after the generation prompt to the message close."""
    g = Lark(grammar_field(req))
    tools, at_least, at_most = _chosen_tools(req)
    parts = [f"{_answer(g, req, bool(at_least))} {markup.closing('response')}"]
    if at_most:
        block = _ToolGrammar(g, markup).block(tools, at_most)
        parts.append(block if at_least else f"({block})?")
    parts.append(markup.closing("message"))
    body = " ".join(parts)
    if thinking:
        body = (f"{g.add('/(?s:.*)/')} {markup.closing('think')} "
                f"{_special(markup.open)} \"response\" {_special(markup.sep)} {body}")
    g.add(body, "start")
    return g


def _call_arguments(parameters: Any, path: str) -> dict:
    """A tool's parameters as the schema its arguments object is held to: an object, with
    its declared keys (required ones among them) and, unless it allows more, no others:
    a weak model would invent them."""
    schema = dict(parameters) if isinstance(parameters, dict) else {}
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid(f"{path}.type", f"{path}.type: a tool's arguments are an object, "
                                      f"not {_shown(kind)}")
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
    tools, at_least, at_most = _chosen_tools(req)
    body = _answer(g, req, bool(at_least))
    if at_most:
        opening = " ".join(_special(part) if isinstance(part, int) else _literal(part)
                           for part in marker)
        alternatives = []
        for j, tool in tools:
            fn = tool["function"]
            field = f"tools[{j}].function.parameters"
            arguments = g.add(_json_rule(_call_arguments(fn.get("parameters"), field), {},
                                         lenient=fn.get("strict") is not True), field=field)
            head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
            alternatives.append(f"{_literal(head)} {arguments} {_literal('}')}")
        call = g.add(f"{opening} ({' | '.join(alternatives)})")
        calls = _numbered(g, lambda index: call, at_most)
        body = f"{body} {calls}" if at_least else f"{body} ({calls})?"
    g.add(body, "start")
    return g


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
