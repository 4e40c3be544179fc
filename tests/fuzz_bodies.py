"""What the fuzz suite sends, and what it checks of every answer.

Bodies are of two kinds, per endpoint: random JSON objects over the
endpoint's field names, and shape-aware ones, a valid request with some of
its fields given wrong types, nulls, lone surrogates, numbers JSON cannot
hold, or pathological JSON Schemas (in tools and formats). `exchange` sends
one on a raw socket and reads everything back, so that a dropped connection,
a truncated body or a second HTTP response inside an event stream shows.

Run as a script against a server already listening, it tallies the answers
per endpoint instead of stopping at the first failure (the issue's before
and after counts):

    python tests/fuzz_bodies.py PORT [--bodies N]
"""
from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from image_files import (corrupt_zlib_png, flat_png, gif_without_lzw, jpeg_without_scan,
                         truncated_png)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
OLLAMA_CHAT, OLLAMA_GENERATE = "/api/chat", "/api/generate"
ENDPOINTS = (CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES, TOKENIZE, DETOKENIZE, OLLAMA_CHAT,
             OLLAMA_GENERATE)
WITHOUT_ENGINE = (COUNT, TOKENIZE, DETOKENIZE)   # answered (200) while the engine is busy

# Written into the body as raw JSON: what json.dumps cannot write, but a client can send.
RAW = {"__INF__": "1e999", "__NINF__": "-1e999", "__NAN__": "NaN", "__INFINITY__": "Infinity"}
# Text a valid request may carry: markup a model would read as structure, odd code points.
ODD_TEXT = ["<|open|>", "<|close|>message<|sep|>", "<|im_end|>", "<|end_of_msg|>", "<|media_pad|>",
            "<|kimi_image_placeholder|>", "\U0001F600", "\u202e", "\ufeff", "", " ", "\n\n", '"}', "x" * 300]
# Text no request should carry: lone surrogates (JSON escapes of half a pair), NUL.
BAD_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\u0000", "a\u0000b"]


def texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_TEXT), st.text(st.characters(exclude_categories=("Cs",),
                                                                      exclude_characters="\0"), max_size=12))


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(), st.booleans(), texts(), st.sampled_from(BAD_TEXT), st.sampled_from(list(RAW)),
        st.sampled_from([0, -1, 1, 2, 3, 2**31, 2**63, 2**64, -2**63, 10**30]),
        st.integers(-1000, 1000), st.floats(allow_nan=False, allow_infinity=False))


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    return st.recursive(scalars(), lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(texts(), inner, max_size=3)),
        max_leaves=max_leaves)


def plain_values() -> st.SearchStrategy[Any]:
    """JSON a valid request may carry where anything goes (metadata)."""
    leaves = st.one_of(st.none(), st.booleans(), texts(), st.integers(-1000, 1000))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(texts(), inner, max_size=3)),
                        max_leaves=4)


def junk() -> st.SearchStrategy[Any]:
    """A wrong value for any field: a wrong type, null, bad text, a number out of range."""
    return st.one_of(scalars(), json_values(4))


SMALL = st.integers(1, 6)   # max_tokens that keep a fuzzed reply short


# ---- JSON Schemas, sane and pathological ----------------------------------------------------

REFS = ["#", "#/nope", "#/properties/a", "#/properties/a/anyOf/0", "#/$defs/d", "#/$defs/loop",
        "#/definitions/d", "https://example.com/s.json", "other.json#/x", "#/properties/~1x", 5, None]
PATTERNS = ["^[a-z]+$", "(((", "[", "x{2,1}", "(a+)+$", "(a|aa)*b", "\\", "a{1000000000}", ".*",
            "\\d{3}-\\d{4}", "(?i)abc", "\\p{L}+", "[^/]*/", "\n", "a/b"]
TYPES = ["string", "number", "integer", "boolean", "null", "object", "array", "foo", 5, None, [],
         ["string", "null"], ["integer", "string"]]
COUNTS = [0, 1, 3, 8, -1, 2.0, 2.5, "x", None, [], True, 2**40, 10**30, "__INF__"]


def counts() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(0, 8), st.sampled_from(COUNTS))


def schema_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.booleans(),
        st.builds(lambda ref: {"$ref": ref}, st.sampled_from(REFS)),
        st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
        st.builds(lambda values: {"enum": values}, st.one_of(st.lists(scalars(), max_size=4), junk())),
        st.builds(lambda v: {"const": v}, scalars()),
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": counts(), "maxLength": counts(),
            "pattern": st.one_of(st.sampled_from(PATTERNS), junk()),
            "format": st.sampled_from(["regex", "date-time", "email", "uuid", "nope", 5])}),
        st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
            "minimum": st.one_of(st.integers(-5, 5), junk()), "maximum": st.one_of(st.integers(-5, 5), junk()),
            "multipleOf": st.sampled_from([0, 2, 0.5, -1, "x"])}),
        junk())


def schemas() -> st.SearchStrategy[Any]:
    def grow(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        keys = st.sampled_from(["a", "b", "~1x", ""])
        return st.one_of(
            st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(keys, inner, max_size=3)},
                                  optional={"required": st.one_of(st.lists(keys, max_size=3), junk()),
                                            "additionalProperties": st.one_of(st.booleans(), inner),
                                            "minProperties": counts()}),
            st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                                  optional={"minItems": counts(), "maxItems": counts(),
                                            "uniqueItems": st.booleans()}),
            st.builds(lambda key, branches: {key: branches}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                      st.one_of(st.lists(inner, max_size=3), junk())),
            st.builds(lambda body, d: {**body, "$defs": {"d": d, "loop": {"$ref": "#/$defs/loop"}}}
                      if isinstance(body, dict) else body, inner, inner),
            st.builds(lambda cond, then: {"if": cond, "then": then, "not": cond}, inner, inner))
    return st.recursive(schema_leaves(), grow, max_leaves=6)


def parameters() -> st.SearchStrategy[Any]:
    """A tool's parameters: usually an object schema around random property schemas."""
    names = st.sampled_from(["a", "b", "c"])
    objects = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(names, schemas(), max_size=3)},
        optional={"required": st.one_of(st.lists(names, max_size=3), junk()),
                  "additionalProperties": st.booleans(), "$defs": st.fixed_dictionaries({"d": schemas()})})
    return st.one_of(objects, objects, objects, schemas())


# ---- valid requests -------------------------------------------------------------------------
# Valid in shape, not in content: the text is odd and the schemas pathological. `bodies` then
# breaks a few of their fields.

# Images whose header reads, but whose pixels do not decode, or that decode (one is 16x16).
IMAGE_DATA = [base64.b64encode(image).decode() for image in (
    truncated_png(), corrupt_zlib_png(), jpeg_without_scan(), gif_without_lzw(), flat_png(16, 16))]
IMAGE_URLS = ["data:image/png;base64,iVBORw0KGgo=", "data:image/png;base64,!!!", "http://example.com/x.png",
              "file:///etc/passwd", "data:text/plain,hi", "",
              *(f"data:image/png;base64,{data}" for data in IMAGE_DATA)]


def content(text_type: str, image_part: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    text = st.fixed_dictionaries({"type": st.just(text_type), "text": texts()})
    parts = st.lists(st.one_of(text, text, text, image_part), min_size=1, max_size=3)
    return st.one_of(texts(), texts(), parts)


def chat_messages() -> st.SearchStrategy[Any]:
    """Turns: a user or system message, an assistant reply, or a call and its result."""
    image = st.builds(lambda url: {"type": "image_url", "image_url": {"url": url}}, st.sampled_from(IMAGE_URLS))
    call = st.fixed_dictionaries({"id": st.just("call_1"), "type": st.just("function"),
                                  "function": st.fixed_dictionaries({
                                      "name": st.sampled_from(["f", "g"]),
                                      "arguments": st.sampled_from(['{"a": 1}', "{", "[]", "null", "{}"])})})
    plain = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                   "content": content("text", image)}).map(lambda m: [m])
    reply = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts())},
                                  optional={"reasoning_content": texts()}).map(lambda m: [m])
    called = st.tuples(
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                               "tool_calls": st.lists(call, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"),
                               "content": content("text", image)})).map(list)
    last = st.fixed_dictionaries({"role": st.just("user"), "content": texts()})
    return st.tuples(st.lists(st.one_of(plain, plain, reply, called), max_size=3), last).map(
        lambda p: [m for turn in p[0] for m in turn] + [p[1]])


def chat_tools() -> st.SearchStrategy[Any]:
    function = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "a.b"])},
                                     optional={"parameters": parameters(), "strict": st.booleans(),
                                               "description": texts()})
    return st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": function}),
                    min_size=1, max_size=2)


def response_formats() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just({"type": "json_object"}), st.just({"type": "text"}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("x"), "schema": schemas()}, optional={"strict": st.booleans()})}))


SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**64),
            "stop": st.lists(texts(), max_size=4), "user": texts(), "metadata": plain_values()}


# What serve's own decoder applies (OpenAI's chat and completions only).
ADJUSTING = {"logit_bias": st.dictionaries(st.sampled_from(["0", "5", "100", "163839", "x", "-1",
                                                            "99999999999"]),
                                           st.one_of(st.floats(-100, 100), junk()), max_size=3),
             "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2)}


def chat_body() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"messages": chat_messages(), "max_tokens": SMALL}, optional={
        "model": st.just("m"), "stream": st.booleans(), "tools": chat_tools(),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
        "response_format": response_formats(), "top_k": st.integers(0, 50),
        "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh"]),
        "parallel_tool_calls": st.booleans(),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.just(1),
        **SAMPLING, **ADJUSTING})


def completion_body() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"prompt": st.one_of(texts(), st.lists(texts(), min_size=1, max_size=2)),
                                  "max_tokens": SMALL}, optional={
        "model": st.just("m"), "stream": st.booleans(), "logprobs": st.integers(0, 5),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), **SAMPLING,
        **ADJUSTING})


def anthropic_messages() -> st.SearchStrategy[Any]:
    image = st.fixed_dictionaries({"type": st.just("image"), "source": st.one_of(
        st.fixed_dictionaries({"type": st.just("base64"), "media_type": st.just("image/png"),
                               "data": st.sampled_from(["iVBORw0KGgo=", "!!!", "", *IMAGE_DATA])}),
        st.fixed_dictionaries({"type": st.just("url"), "url": st.sampled_from(IMAGE_URLS)}))})
    tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_1"),
                                      "name": st.just("f"), "input": st.just({"a": 1})})
    thinking = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts(),
                                      "signature": st.sampled_from(["", "forged", "x" * 40])})
    result = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1")},
                                   optional={"content": content("text", image), "is_error": st.booleans()})
    user = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        content("text", image), st.lists(st.one_of(result, image), min_size=1, max_size=2))})
    assistant = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(
        texts(), st.lists(st.one_of(tool_use, thinking), max_size=2))})
    last = st.fixed_dictionaries({"role": st.just("user"), "content": texts()})
    return st.tuples(st.lists(st.one_of(user, assistant), max_size=3), last).map(lambda p: p[0] + [p[1]])


def anthropic_tools() -> st.SearchStrategy[Any]:
    tool = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "input_schema": parameters()},
                                 optional={"strict": st.booleans(), "description": texts(),
                                           "type": st.sampled_from(["custom", "web_search_20250305"])})
    return st.lists(tool, min_size=1, max_size=2)


def messages_body(counting: bool = False) -> st.SearchStrategy[dict]:
    optional = {
        "system": st.one_of(texts(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts()}),
                                              max_size=2)),
        "tools": anthropic_tools(),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                        {"type": "tool", "name": "f"}]),
        "thinking": st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                     {"type": "enabled", "budget_tokens": 2048},
                                     {"type": "enabled", "budget_tokens": 5}]),
        "output_config": st.fixed_dictionaries({}, optional={
            "effort": st.sampled_from(["low", "high", "max", "medium"]),
            "format": st.fixed_dictionaries({"type": st.just("json_schema"), "schema": schemas()})}),
        "metadata": plain_values()}
    required = {"messages": anthropic_messages(), "model": st.just("m")}
    if not counting:
        required["max_tokens"] = SMALL
        optional.update({"stream": st.booleans(), "stop_sequences": st.lists(texts(), max_size=3),
                         "temperature": st.floats(0, 1), "top_k": st.integers(0, 50)})
    return st.fixed_dictionaries(required, optional=optional)


def responses_body() -> st.SearchStrategy[dict]:
    part = st.one_of(st.fixed_dictionaries({"type": st.just("input_text"), "text": texts()}),
                     st.fixed_dictionaries({"type": st.just("input_image"),
                                            "image_url": st.sampled_from(IMAGE_URLS)}))
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                               "content": st.one_of(texts(), st.lists(part, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("c1"),
                               "name": st.just("f"), "arguments": st.just("{}")},
                              optional={"namespace": st.just("ns")}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c1"),
                               "output": st.one_of(texts(), st.lists(part, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("reasoning"), "id": st.just("rs_1"),
                               "encrypted_content": st.sampled_from(["", "forged"])}),
        st.fixed_dictionaries({"type": st.just("message"), "role": st.just("assistant"),
                               "content": st.lists(st.fixed_dictionaries(
                                   {"type": st.just("output_text"), "text": texts()}), max_size=2)}))
    function = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
                                     optional={"parameters": parameters(), "strict": st.booleans()})
    namespace = st.fixed_dictionaries({"type": st.just("namespace"), "name": st.just("ns"),
                                       "tools": st.lists(function, max_size=2)})
    tools = st.lists(st.one_of(function, function, namespace, st.just({"type": "web_search"})),
                     min_size=1, max_size=2)
    text = st.fixed_dictionaries({"format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("x"), "schema": schemas()},
                              optional={"strict": st.booleans()}))})
    return st.fixed_dictionaries({"input": st.one_of(texts(), st.lists(item, min_size=1, max_size=3)),
                                  "max_output_tokens": SMALL}, optional={
        "model": st.just("m"), "stream": st.booleans(), "instructions": texts(), "tools": tools, "text": text,
        "store": st.booleans(),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                                        {"type": "allowed_tools", "mode": "auto", "tools": []}]),
        "reasoning": st.fixed_dictionaries({}, optional={
            "effort": st.sampled_from(["none", "low", "high", "medium"]), "summary": texts()}),
        "include": st.sampled_from([["reasoning.encrypted_content"],
                                    ["message.output_text.logprobs"]]),
        "top_logprobs": counts(), "parallel_tool_calls": st.booleans(),
        **SAMPLING})


def tokenize_body() -> st.SearchStrategy[dict]:
    """llama.cpp's form, or vLLM's two."""
    flag = st.booleans()
    return st.one_of(
        st.fixed_dictionaries({"content": texts()}, optional={
            "add_special": flag, "parse_special": flag, "with_pieces": flag}),
        st.fixed_dictionaries({"prompt": texts()}, optional={
            "model": st.just("m"), "add_special_tokens": flag, "return_token_strs": flag}),
        st.fixed_dictionaries({"messages": chat_messages()}, optional={
            "model": st.just("m"), "add_generation_prompt": flag, "add_special_tokens": flag,
            "return_token_strs": flag, "tools": chat_tools(),
            "continue_final_message": flag}))


def detokenize_body() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"tokens": st.lists(
        st.one_of(st.integers(0, 300), st.integers(-5, 2**40), junk()), max_size=12)},
        optional={"model": st.just("m")})


OLLAMA_IMAGES = ["iVBORw0KGgo=", "!!!", "", "bm90IGFuIGltYWdl", *IMAGE_DATA]


def ollama_common() -> dict:
    """What /api/chat and /api/generate share: options (num_predict keeps a reply short),
    format, think, keep_alive, logprobs."""
    options = st.fixed_dictionaries({"num_predict": SMALL}, optional={
        "temperature": st.floats(0, 2), "top_k": st.integers(0, 50), "top_p": st.floats(0.01, 1),
        "seed": st.integers(-1, 2**64), "stop": st.lists(texts(), max_size=4),
        "num_ctx": st.sampled_from([1, 512, 4096, 10**9]), "repeat_penalty": st.sampled_from([1.0, 1.1]),
        "num_thread": st.integers(1, 4), "mirostat": st.sampled_from([0, 2])})
    return {"options": options, "stream": st.booleans(),
            "format": st.one_of(st.sampled_from(["", "json"]), schemas()),
            "think": st.sampled_from([True, False, "low", "medium", "high", "max", "extreme"]),
            "keep_alive": st.sampled_from(["5m", 0, -1, "1h30m", "forever"]),
            "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}


def ollama_chat_body() -> st.SearchStrategy[dict]:
    images = st.lists(st.sampled_from(OLLAMA_IMAGES), max_size=2)
    call = st.fixed_dictionaries({"function": st.fixed_dictionaries({
        "name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from([{"a": 1}, {}, "{}"])})})
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "USER"]), "content": texts()},
                              optional={"images": images}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": texts()},
                              optional={"thinking": texts(), "tool_calls": st.lists(call, max_size=2)}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": texts()},
                              optional={"tool_name": st.sampled_from(["f", "g"])}))
    last = st.fixed_dictionaries({"role": st.just("user"), "content": texts()}, optional={"images": images})
    messages = st.tuples(st.lists(message, max_size=3), last).map(lambda p: p[0] + [p[1]])
    optional = ollama_common()
    optional.update(tools=chat_tools())
    return st.fixed_dictionaries({"model": st.sampled_from(["m", "m:latest"]), "messages": messages,
                                  "options": optional.pop("options")}, optional=optional)


def ollama_generate_body() -> st.SearchStrategy[dict]:
    optional = ollama_common()
    optional.update(system=texts(), raw=st.booleans(), suffix=st.sampled_from(["", "end"]),
                    images=st.lists(st.sampled_from(OLLAMA_IMAGES), max_size=2),
                    context=st.sampled_from([[], [1, 2]]))
    return st.fixed_dictionaries({"model": st.just("m"), "prompt": texts(),
                                  "options": optional.pop("options")}, optional=optional)


VALID = {CHAT: chat_body, COMPLETIONS: completion_body, MESSAGES: messages_body,
         COUNT: lambda: messages_body(counting=True), RESPONSES: responses_body,
         TOKENIZE: tokenize_body, DETOKENIZE: detokenize_body,
         OLLAMA_CHAT: ollama_chat_body, OLLAMA_GENERATE: ollama_generate_body}
FIELDS = {CHAT: ["messages", "tools", "response_format", "stream", "max_tokens", "tool_choice"],
          COMPLETIONS: ["prompt", "stream", "max_tokens", "logprobs"],
          MESSAGES: ["messages", "system", "tools", "max_tokens", "stream", "model", "thinking"],
          COUNT: ["messages", "system", "tools", "model"],
          RESPONSES: ["input", "instructions", "tools", "text", "stream", "max_output_tokens"],
          TOKENIZE: ["content", "prompt", "messages", "with_pieces", "add_special"],
          DETOKENIZE: ["tokens", "model"],
          OLLAMA_CHAT: ["model", "messages", "tools", "format", "options", "stream", "think"],
          OLLAMA_GENERATE: ["model", "prompt", "system", "raw", "images", "options", "stream"]}


# ---- breaking them --------------------------------------------------------------------------

def _places(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a body a value sits, as a path of keys and indices."""
    places = [at] if at else []
    if isinstance(value, dict):
        for key, child in value.items():
            places += _places(child, at + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            places += _places(child, at + (i,))
    return places


def _replace(body: Any, at: tuple, value: Any) -> Any:
    """A copy of body with the value at `at` replaced (or removed, for the DELETE marker)."""
    if not at:
        return value
    copy = dict(body) if isinstance(body, dict) else list(body)
    child = _replace(copy[at[0]], at[1:], value)
    if child is _DELETE:
        del copy[at[0]]
    else:
        copy[at[0]] = child
    return copy


_DELETE = object()


@st.composite
def broken(draw: Any, valid: st.SearchStrategy[dict]) -> dict:
    """A valid body with none, one or a few of its fields given junk, or removed."""
    body = draw(valid)
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        places = _places(body)
        if not places:
            break
        at = draw(st.sampled_from(places))
        body = _replace(body, at, draw(st.one_of(junk(), st.just(_DELETE))))
    return body


def bodies(path: str) -> st.SearchStrategy[dict]:
    """Random objects over the endpoint's field names, and shape-aware requests (most of them)."""
    names = st.one_of(st.sampled_from(FIELDS[path]), texts())
    shaped = broken(VALID[path]())
    return st.one_of(st.dictionaries(names, json_values(), max_size=5), shaped, shaped, shaped)


def encode(body: Any) -> bytes:
    text = json.dumps(body)
    for marker, raw in RAW.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode()


# ---- one exchange, checked ------------------------------------------------------------------

@dataclass
class Outcome:
    status: int               # 0: no answer at all
    problem: Optional[str]    # what is wrong with the answer, or None
    raw: bytes = b""


FINAL_EVENTS = {MESSAGES: ("message_stop", "error"),
                RESPONSES: ("response.completed", "response.incomplete", "response.failed", "error")}


def exchange(port: int, path: str, data: bytes, timeout: float = 120, method: str = "POST",
             headers: tuple[str, ...] = ()) -> Outcome:
    """Send `data` (a POST's, by default), read the whole answer, and say what (if anything)
    is wrong with it; `headers` are extra header lines."""
    extra = "".join(f"{line}\r\n" for line in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
                  f"Connection: close\r\nContent-Length: {len(data)}\r\n{extra}\r\n".encode()
                  + data)
        raw = b""
        try:
            while chunk := s.recv(65536):
                raw += chunk
        except ConnectionResetError:
            return Outcome(0, "connection reset", raw)
        except TimeoutError:
            return Outcome(0, f"no end to the answer within {timeout:g} s", raw)
    return Outcome(*check(path, raw), raw)


def check(path: str, raw: bytes) -> tuple[int, Optional[str]]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return 0, "no whole answer (dropped connection)"
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return 0, f"not an HTTP status line: {lines[0]!r}"
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if status >= 500:
        return status, f"a {status}"
    if headers.get("content-type") in ("text/event-stream", "application/x-ndjson"):
        if headers.get("transfer-encoding") == "chunked":
            body, whole = unchunked(body)
            if not whole:
                return status, "an event stream without its last chunk"
        if headers["content-type"] == "application/x-ndjson":
            return status, check_ndjson(path, body)
        return status, check_stream(path, body)
    if "content-length" not in headers:
        return status, "a body without Content-Length"
    if len(body) != int(headers["content-length"]):
        return status, f"{len(body)} bytes after headers, {headers['content-length']} declared"
    try:
        payload = json.loads(body)
    except ValueError:
        return status, "a body that is not JSON"
    if status >= 400:
        return status, check_error(path, payload)
    return status, None


def unchunked(body: bytes) -> tuple[bytes, bool]:
    """A chunked body's data, and whether it ended with the last (empty) chunk."""
    out = []
    while body:
        size, crlf, rest = body.partition(b"\r\n")
        try:
            n = int(size, 16)
        except ValueError:
            return b"".join(out), False
        if not crlf or rest[n:n + 2] != b"\r\n":
            return b"".join(out), False
        if n == 0:
            return b"".join(out), rest[2:] == b""
        out.append(rest[:n])
        body = rest[n + 2:]
    return b"".join(out), False


def check_error(path: str, payload: Any) -> Optional[str]:
    """The dialect's own error shape: Anthropic's on /v1/messages*, Ollama's on /api/*, OpenAI's
    elsewhere."""
    if path.startswith("/api/"):
        ok = isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], str)
    elif path.startswith(MESSAGES):
        ok = (isinstance(payload, dict) and payload.get("type") == "error"
              and isinstance(payload.get("error"), dict) and isinstance(payload["error"].get("message"), str)
              and isinstance(payload["error"].get("type"), str))
    else:
        error = payload.get("error") if isinstance(payload, dict) else None
        ok = isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} \
            and isinstance(error["message"], str)
    return None if ok else f"an error body in the wrong shape: {payload!r:.200}"


def check_stream(path: str, body: bytes) -> Optional[str]:
    """An event stream: no second HTTP response in it, every event whole, a proper end."""
    if b"HTTP/1." in body:
        return "a second HTTP response inside the event stream"
    if not body.endswith(b"\n\n"):
        return "an event stream cut mid-event"
    events = []
    for block in body.decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            continue
        name, _, data = block.rpartition("\n")
        if not data.startswith("data: "):
            return f"an event without data: {block!r:.200}"
        events.append((name.removeprefix("event: ") or None, data[6:]))
    if not events:
        return "an event stream with no events"
    name, data = events[-1]
    if path in FINAL_EVENTS:
        return None if name in FINAL_EVENTS[path] else f"an event stream ending in {name!r}"
    if data != "[DONE]":
        return "an event stream not ending in [DONE]"
    payloads = [json.loads(data) for _, data in events[:-1]]
    return next((check_error(path, p) for p in payloads if "error" in p and check_error(path, p)), None)


def check_ndjson(path: str, body: bytes) -> Optional[str]:
    """An Ollama stream: JSON objects one a line and nothing else, ending done or in an error."""
    if b"HTTP/1." in body:
        return "a second HTTP response inside the stream"
    if not body.endswith(b"\n"):
        return "a stream cut mid-line"
    try:
        records = [json.loads(line) for line in body.decode().split("\n")[:-1]]
    except ValueError:
        return "a stream line that is not JSON"
    if not records or not all(isinstance(r, dict) for r in records):
        return "a stream with no records, or one that is not an object"
    last = records[-1]
    if "error" in last:
        return check_error(path, last)
    return None if last.get("done") is True else "a stream not ending done"


# ---- the tally ------------------------------------------------------------------------------

def tally(port: int, n: int) -> dict[str, Counter]:
    """Per endpoint, how `n` fuzzed bodies were answered: status classes and problems. The
    bodies are the same from run to run (derandomized), so two servers can be compared."""
    counts: dict[str, Counter] = {}
    for path in ENDPOINTS:
        seen = counts[path] = Counter()

        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(body=bodies(path))
        def send(body: dict) -> None:
            outcome = exchange(port, path, encode(body))
            seen["bodies"] += 1
            seen[f"{outcome.status // 100}xx" if outcome.status else "no answer"] += 1
            if outcome.problem:
                seen[outcome.problem] += 1
        send()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description="Tally a running server's answers to fuzzed bodies.")
    parser.add_argument("port", type=int)
    parser.add_argument("--bodies", type=int, default=500, help="bodies per endpoint")
    args = parser.parse_args()
    for path, seen in tally(args.port, args.bodies).items():
        problems = {k: v for k, v in seen.items() if k not in ("bodies", "2xx", "4xx", "5xx", "no answer")}
        print(f"{path}: {seen['bodies']} bodies, 2xx {seen['2xx']}, 4xx {seen['4xx']}, "
              f"5xx {seen['5xx']}, no answer {seen['no answer']}; problems {problems or 'none'}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
