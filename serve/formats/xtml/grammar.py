"""The XTML reply as an llguidance grammar: free reasoning until the think element closes,
the response (a JSON document when a format is asked for), then the tools block exactly as
serve/formats/xtml/render.py writes calls into history, each argument element typed by its
schema, then the message close. Markup is matched as the special tokens it is."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from serve.core.client_json import Json, JsonObject
from serve.core.errors import invalid
from serve.core.request import ChatRequest
from serve.formats.grammar import (JSON_STYLE, Lark, answer, chosen_tools, defs_of, grammar_field,
                                   json_rule, literal, numbered, regex_to_lark, shown, special)
from serve.formats.xtml.render import escape_attr

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


@dataclass(frozen=True)
class Markup:
    """The special tokens a K3 reply is structured with."""
    open: int
    sep: int
    close: int

    def element(self, header: str, body: str) -> str:
        """`<|open|>header<|sep|> body <|close|>name<|sep|>`, as grammar."""
        name = header.split(" ", 1)[0]
        return (f"{special(self.open)} {literal(header)} {special(self.sep)} {body} "
                f"{special(self.close)} {literal(name)} {special(self.sep)}")

    def closing(self, name: str) -> str:
        return f"{special(self.close)} {literal(name)} {special(self.sep)}"


def _pointer(root: Json, ref: str) -> tuple[Json, list[str]]:
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


def _resolve(schema: Json, root: JsonObject, path: str, root_path: str) -> tuple[Json, str]:
    """A schema with its $refs into `root` followed, and the path of where it now comes from."""
    for _ in range(MAX_REF_DEPTH):
        if not isinstance(schema, dict) or "$ref" not in schema:
            return schema, path
        ref, where = schema["$ref"], f"{path}.$ref"
        if ref == "#":
            raise invalid(where, f"{where}: a $ref to the whole schema is not supported here; "
                                 "put what is shared under $defs")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise invalid(where, f"{where}: only local $refs (#/...) are supported, not {shown(ref)}")
        node, steps = _pointer(root, ref)
        if not isinstance(node, (dict, bool)):
            raise invalid(where, f"{where}: {shown(ref)} does not resolve to a schema")
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        if isinstance(node, dict):
            schema = {**siblings, **node}
        else:   # true admits what the siblings admit; false admits nothing
            schema = (siblings or True) if node else False
        path = root_path + "".join(f".{step}" for step in steps)
    raise invalid(path, f"{path}: $refs lead on to $refs more than {MAX_REF_DEPTH} times")


def _check_refs(schema: Json, path: str) -> None:
    """Every $ref in a JSON-typed argument's schema points into the $defs its rule carries."""
    stack = [(schema, path)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (isinstance(ref, str) and _DEF_REF.match(ref)):
                raise invalid(f"{at}.$ref", f"{at}.$ref: inside an argument, $refs must point "
                                            f"into $defs or definitions, not {shown(ref)}")
            stack.extend((value, f"{at}.{key}") for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, f"{at}[{i}]") for i, value in enumerate(node))


def _length(schema: JsonObject, key: str, path: str) -> Optional[int]:
    """minLength or maxLength: absent (None), or a count; a 400 naming it otherwise."""
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{path}.{key}", f"{path}.{key} must be a non-negative integer, "
                                       f"not {shown(value)}")
    return value


class _ToolGrammar:
    """The tools block: calls of declared tools, each argument element typed by the schema."""

    def __init__(self, g: Lark, markup: Markup):
        self.g, self.m = g, markup
        self.strict = False   # unknown schema keywords ignored, unless the tool is strict
        self._left = 0        # how many more schemas the argument being built may expand into

    def argument_bodies(self, schema: Json, root: JsonObject, path: str,
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
            raise invalid(path, f"{path} must be a schema (an object or a boolean), not {shown(schema)}")
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
                                          f"or a list of them, not {shown(schema['type'])}")
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
                pairs.append((attr, self.g.add(json_rule(typed, defs_of(root), not self.strict),
                                               field=path)))
        return pairs

    def _raw_string(self, schema: JsonObject, path: str) -> Optional[str]:
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
        # Any character but NUL: the call comes back in the next request's history, and text
        # with a NUL cannot be tokenized (a C string ends there), so that request would be a 400.
        bound = f"/[^\\x00]{{{low},{'' if high is None or high > LONGEST_STRING else high}}}/"
        if "pattern" not in schema:
            return self.g.add(bound, field=path)
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise invalid(f"{path}.pattern", f"{path}.pattern must be a string")
        regex = "/" + regex_to_lark(pattern) + "/"
        return self.g.terminal(f"{regex} & {bound}", field=f"{path}.pattern")

    def _enum_bodies(self, values: Sequence[Json], path: str) -> list[tuple[str, str]]:
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
            rule = (literal(bodies[0]) if len(bodies) == 1 else
                    "/(?:" + "|".join(regex_to_lark(re.escape(b)) for b in bodies) + ")/")
            pairs.append((kind, self.g.add(rule, field=f"{path}.enum")))
        return pairs

    def arguments(self, parameters: Json, path: str) -> str:
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
                    raise invalid(at, f"{at}: required argument {shown(key)} admits no value")
                continue
            options = " | ".join(
                self.m.element(f'argument key="{escape_attr(key)}" type="{attr}"', body)
                for attr, body in bodies)
            rule = self.g.add(options, field=at)
            parts.append(rule if key in required else f"{rule}?")
        return " ".join(parts)

    @staticmethod
    def _check_strict_object(params: JsonObject, path: str) -> None:
        types = params.get("type", "object")
        if types != "object" and not (isinstance(types, list) and "object" in types):
            raise invalid(f"{path}.type", f"{path}.type: a strict tool's parameters are an object",
                          code="unsupported_schema")
        for key in UNENFORCED_OBJECT_KEYWORDS:
            if key in params:
                raise invalid(f"{path}.{key}", f"{path}.{key}: a strict tool's arguments are its "
                              f"declared properties, and {key} on them cannot be enforced",
                              code="unsupported_schema")

    def block(self, tools: Sequence[tuple[int, JsonObject]], at_most: int) -> str:
        """`<|open|>tools<|sep|>` one to `at_most` calls `<|close|>tools<|sep|>`, numbered from 1."""
        args = {}
        for j, tool in tools:
            fn = tool["function"]
            self.strict = fn.get("strict") is True
            args[fn["name"]] = self.g.add(
                self.arguments(fn.get("parameters"), f"tools[{j}].function.parameters") or '""')
        calls = numbered(self.g, lambda index: " | ".join(
            self.m.element(f'call tool="{escape_attr(name)}" index="{index}"', rule)
            for name, rule in args.items()), at_most)
        return self.m.element("tools", calls)


def _type_attr(value: Json) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def xtml_grammar(req: ChatRequest, markup: Markup, thinking: bool) -> Lark:
    """The whole XTML reply, from just after the generation prompt to the message close."""
    g = Lark(grammar_field(req))
    tools, at_least, at_most = chosen_tools(req)
    parts = [f"{answer(g, req, bool(at_least))} {markup.closing('response')}"]
    if at_most:
        block = _ToolGrammar(g, markup).block(tools, at_most)
        parts.append(block if at_least else f"({block})?")
    parts.append(markup.closing("message"))
    body = " ".join(parts)
    if thinking:
        body = (f"{g.add('/(?s:.*)/')} {markup.closing('think')} "
                f"{special(markup.open)} \"response\" {special(markup.sep)} {body}")
    g.add(body, "start")
    return g
