"""Bodies a client should not have sent: each is a 400 in its dialect's shape, naming the field,
and costs the server nothing it keeps. One test per failure fuzzing found (issue 23); the fuzz
suite itself is tests/server/test_fuzz.py."""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager

import pytest

from scripted import (ScriptedEngine, assert_error, call, real_service, scripted_service,
                      serving, xtml_answer)
from serve.engine.binding import Engine, EngineConfig, load_library
from serve.service.facade import Service, ServiceOptions
from serve.formats.format_choice import resolve_chat_format

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
COUNT = MESSAGES + "/count_tokens"
HI = [{"role": "user", "content": "hi"}]
INFINITY = "__1e999__"   # written into the body as the JSON number 1e999


def chat_body(parameters: dict, strict: bool = False) -> dict:
    return {"model": "m", "messages": HI, "max_tokens": 2, "reasoning_effort": "none",
            "tools": [{"type": "function", "function": {"name": "f", "strict": strict,
                                                          "parameters": parameters}}]}


def messages_body(parameters: dict, strict: bool = False) -> dict:
    return {"model": "m", "messages": HI, "max_tokens": 2, "thinking": {"type": "disabled"},
            "tools": [{"name": "f", "strict": strict, "input_schema": parameters}]}


def responses_body(parameters: dict, strict: bool = False) -> dict:
    return {"model": "m", "input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "none"},
            "tools": [{"type": "function", "name": "f", "strict": strict, "parameters": parameters}]}


# (path, body builder, where the tool's parameters are in that dialect)
DIALECTS = {"chat": (CHAT, chat_body, "tools[0].function.parameters"),
            "messages": (MESSAGES, messages_body, "tools[0].input_schema"),
            "responses": (RESPONSES, responses_body, "tools[0].parameters")}


def encode(body: dict) -> bytes:
    return json.dumps(body).replace(json.dumps(INFINITY), "1e999").encode()


def assert_refused(resp, path: str, field: str, code=None) -> str:
    """A 400 in the dialect's own error shape that names `field`; returns its message."""
    assert resp.status == 400, resp.body
    if path.startswith(MESSAGES):
        body = resp.json()
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert field in body["error"]["message"], body
        return body["error"]["message"]
    return assert_error(resp, 400, param=field, code=code)["message"]


class CountedTurns:
    """The engine's line, counting how often a request is given the engine."""

    def __init__(self, queue) -> None:
        self._turn, self.taken = queue.turn, 0
        queue.turn = self

    @contextmanager
    def __call__(self, waiter, *work, **meanwhile):
        with self._turn(waiter, *work, **meanwhile) as held:
            self.taken += 1
            yield held


@pytest.fixture(scope="module")
def k3(lib_path, k3_container):
    with real_service(lib_path, k3_container, thinking=False) as service, serving(service) as srv:
        yield srv, service


# ---- 1. tool schemas the grammar cannot build ---------------------------------------------

BROKEN_SCHEMAS = {   # parameters -> the field named, under the tool's parameters
    "ref to the root": ({"properties": {"a": {"$ref": "#"}}}, ".properties.a.$ref"),
    "ref to nothing": ({"properties": {"a": {"$ref": "#/nope"}}}, ".properties.a.$ref"),
    "remote ref": ({"properties": {"a": {"$ref": "https://example.com/a.json"}}}, ".properties.a.$ref"),
    "empty enum, required": ({"properties": {"a": {"enum": []}}, "required": ["a"]}, ".properties.a"),
    "empty type, required": ({"properties": {"a": {"type": []}}, "required": ["a"]}, ".properties.a"),
    "minLength a string": ({"properties": {"a": {"type": "string", "minLength": "x"}}},
                           ".properties.a.minLength"),
    "minLength null": ({"properties": {"a": {"type": "string", "minLength": None}}},
                       ".properties.a.minLength"),
    "minLength a list": ({"properties": {"a": {"type": "string", "minLength": []}}},
                         ".properties.a.minLength"),
    "maxLength 1e999": ({"properties": {"a": {"type": "string", "maxLength": INFINITY}}},
                        ".properties.a.maxLength"),
    "required a number": ({"properties": {"a": {"type": "string"}}, "required": 5}, ".required"),
    "anyOf through itself": ({"properties": {"a": {"anyOf": [{"$ref": "#/properties/a"}]}}},
                             ".properties.a"),
}


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("case", list(BROKEN_SCHEMAS))
def test_a_tool_schema_the_grammar_cannot_build_is_a_400_naming_the_field(k3, dialect, case):
    srv, service = k3
    path, build, where = DIALECTS[dialect]
    parameters, field = BROKEN_SCHEMAS[case]
    generated = service.engine.stats().tokens_generated
    resp = call(srv.port, "POST", path, encode(build({"type": "object", **parameters})))
    assert_refused(resp, path, where + field)
    assert service.engine.stats().tokens_generated == generated


# ---- 2. a namespace member that is not an object --------------------------------------------

def test_a_namespace_member_that_is_not_an_object_is_a_400(k3):
    srv, _ = k3
    for member in ("x", None, 5, ["f"]):
        body = {"model": "m", "input": "hi",
                "tools": [{"type": "namespace", "name": "ns", "tools": [member]}]}
        assert_refused(call(srv.port, "POST", RESPONSES, body), RESPONSES, "tools[0].tools[0]")


# ---- 3. text that is not Unicode --------------------------------------------------------------

LONE = "\ud800"
SURROGATES = [  # (path, body, the field named): fields echoed, rendered, or neither
    (RESPONSES, {"model": "m", "input": "hi", "max_output_tokens": 2, "metadata": {"k": LONE}},
     "metadata.k"),
    (RESPONSES, {"model": "m", "input": "hi", "max_output_tokens": 2, "user": "a" + LONE},
     "user"),
    (RESPONSES, {"model": "m", "input": "hi", "max_output_tokens": 2, "instructions": LONE},
     "instructions"),
    (RESPONSES, {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": LONE}]}], "max_output_tokens": 2}, "input[0].content[0].text"),
    (RESPONSES, {"model": "m", "input": "hi", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": LONE, "schema": {}}}}, "text.format.name"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": LONE}], "max_tokens": 2},
     "messages[0].content"),
    (CHAT, {"model": "m", "messages": HI, "max_tokens": 2, "user": LONE}, "user"),
    (CHAT, {"model": "m", "messages": HI, "max_tokens": 2, "stop": [LONE]}, "stop[0]"),
    (MESSAGES, {"model": "m", "messages": HI, "max_tokens": 2, "system": LONE}, "system"),
    (MESSAGES, {"model": "m", "messages": HI, "max_tokens": 2, "metadata": {"user_id": LONE}},
     "metadata.user_id"),
    (COUNT, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    (CHAT, {"model": "m", "messages": HI, "max_tokens": 2, "metadata": {LONE: "v"}}, "metadata"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,field", SURROGATES)
def test_a_lone_surrogate_is_a_400_at_parse_time_in_every_dialect(k3, path, body, field, stream):
    srv, service = k3
    generated = service.engine.stats().tokens_generated
    stored = len(srv.service.responses)
    if path != COUNT:
        body = {**body, "stream": stream}
    assert_refused(call(srv.port, "POST", path, body), path, field)
    # Refused before anything was generated or stored.
    assert service.engine.stats().tokens_generated == generated
    assert len(srv.service.responses) == stored


def test_streams_refused_for_their_text_leave_no_thread_behind(k3):
    # Each used to open its stream, fail to write the opening event, answer a second HTTP
    # response inside the stream, and leave its writer thread waiting forever.
    srv, _ = k3
    for _ in range(40):
        resp = call(srv.port, "POST", RESPONSES, {"model": "m", "input": "hi", "stream": True,
                                                  "user": LONE, "max_output_tokens": 2})
        assert_refused(resp, RESPONSES, "user")
    assert writer_threads() == 0


def test_numbers_beyond_a_double_are_a_400_naming_the_field(k3):
    srv, _ = k3
    body = encode({"model": "m", "input": "hi", "metadata": {"n": INFINITY}})
    assert_refused(call(srv.port, "POST", RESPONSES, body), RESPONSES, "metadata.n")
    for constant in (b"NaN", b"Infinity", b"-Infinity"):   # not JSON at all
        resp = call(srv.port, "POST", CHAT, b'{"messages": [], "temperature": ' + constant + b"}")
        assert_error(resp, 400, code="invalid_body")


# ---- 4. strict tools are held to what they declare --------------------------------------------

@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_strict_tool_is_refused_for_a_keyword_it_cannot_enforce(k3, dialect):
    srv, _ = k3
    path, build, where = DIALECTS[dialect]
    parameters = {"type": "object", "required": ["a"],
                  "properties": {"a": {"type": "string", "format": "regex"}}}
    message = assert_refused(call(srv.port, "POST", path, build(parameters, strict=True)), path,
                             where + ".properties.a.format",
                             code=None if dialect == "messages" else "unsupported_schema")
    assert "format" in message
    # Lenient, the keyword it cannot enforce is ignored, as for response_format.
    assert call(srv.port, "POST", path, build(parameters)).status == 200


def test_strict_tools_and_strict_formats_refuse_the_same_keywords(k3):
    srv, _ = k3
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "array", "uniqueItems": True}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    assert_error(call(srv.port, "POST", CHAT, {"messages": HI, "response_format": fmt}), 400,
                 param="response_format.json_schema.schema", code="unsupported_schema")
    assert_error(call(srv.port, "POST", CHAT, chat_body(schema, strict=True)), 400,
                 param="tools[0].function.parameters.properties.a", code="unsupported_schema")
    beyond = {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}
    assert_error(call(srv.port, "POST", CHAT, chat_body(beyond, strict=True)), 400,
                 param="tools[0].function.parameters.minProperties", code="unsupported_schema")


# ---- 5. cheap refusals, and memory given back ---------------------------------------------------

@pytest.fixture
def wide(lib_path, k3_container):
    """The reference engine at a 65536-token context, its lock counted."""
    lib = load_library(str(lib_path))
    engine = Engine(lib, k3_container, EngineConfig(ctx=65536))
    service = Service(engine, lib, resolve_chat_format(engine, k3_container),
                      ServiceOptions(model_id="wide", thinking=False))
    held = CountedTurns(service.queue)
    try:
        with serving(service) as srv:
            yield srv, held
    finally:
        service.close()
        engine.close()


def enum_tool(n: int) -> dict:
    return {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["v"],
        "properties": {"v": {"type": "string", "enum": [f"v{i}" for i in range(n)]}}}}}


def test_tools_that_cannot_fit_are_refused_before_the_engine_is_held(wide):
    srv, held = wide
    long_description = {"type": "function", "function": {"name": "f", "description": "x" * 3_000_000}}
    resp = call(srv.port, "POST", CHAT, {"messages": HI, "tools": [long_description]})
    assert_error(resp, 400, param="tools", code="context_length_exceeded")
    resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "y" * 3_000_000}]})
    assert_error(resp, 400, param="messages", code="context_length_exceeded")
    assert held.taken == 0
    assert call(srv.port, "POST", CHAT, {"messages": HI, "max_tokens": 1}).status == 200
    assert held.taken == 1   # the count sees a request that does take the engine


def test_a_megabyte_enum_is_refused_without_holding_the_engine(wide):
    # Its characters alone do not prove it too long for the context, and its grammar used to
    # be compiled while the engine was held: 34 s here for 130,000 values, then a 400.
    srv, held = wide
    resp = call(srv.port, "POST", CHAT, {"messages": HI, "tools": [enum_tool(130_000)],
                                         "max_tokens": 2}, timeout=120)
    assert resp.status == 400, resp.body
    assert held.taken == 0


# ---- streams that fail ----------------------------------------------------------------------

def writer_threads() -> int:
    return sum(t.name == "sse-writer" for t in threading.enumerate())


def failing_at_token(n: int):
    def fail(i: int) -> None:
        if i == n:
            raise RuntimeError("the disk went away")
    return fail


STREAMS = {  # path, body, how its stream says it failed
    CHAT: ({"messages": HI, "stream": True},
           lambda r: r.events()[-2]["error"]["type"] == "server_error" and r.events()[-1] == "[DONE]"),
    "/v1/completions": ({"prompt": "hi", "stream": True},
                        lambda r: r.events()[-2]["error"]["type"] == "server_error"),
    MESSAGES: ({"model": "m", "messages": HI, "max_tokens": 9, "stream": True},
               lambda r: r.named_events()[-1][0] == "error"
               and r.named_events()[-1][1]["error"]["type"] == "api_error"),
    RESPONSES: ({"model": "m", "input": "hi", "stream": True},
                lambda r: r.named_events()[-1][0] == "response.failed"),
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_an_error_inside_a_stream_is_the_dialects_event_and_frees_its_writer(path):
    engine = ScriptedEngine([xtml_answer("a", "b", "c")])
    engine.before_token = failing_at_token(1)
    body, failed = STREAMS[path]
    with serving(scripted_service(engine, thinking=False), log=lambda line: None) as srv:
        for _ in range(5):
            resp = call(srv.port, "POST", path, body)
            assert resp.status == 200 and b"HTTP/1." not in resp.body
            assert failed(resp), resp.body
    assert writer_threads() == 0


def test_a_stream_whose_failure_cannot_be_told_still_ends_whole(monkeypatch):
    # Describing the failure fails too (as an unencodable echo once did): the stream ends
    # without a second HTTP response in it, the writer thread ends, and the operator is told.
    from serve.dialects import responses

    def cannot(self, error):
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
    monkeypatch.setattr(responses.ResponsesExchange, "failed", cannot)
    engine = ScriptedEngine([xtml_answer("a", "b", "c")])
    engine.before_token = failing_at_token(1)
    lines: list[str] = []
    with serving(scripted_service(engine, thinking=False), log=lines.append) as srv:
        for _ in range(10):
            resp = call(srv.port, "POST", RESPONSES, {"model": "m", "input": "hi", "stream": True})
            assert resp.status == 200 and b"HTTP/1." not in resp.body
            assert [name for name, _ in resp.named_events()][:2] == ["response.created",
                                                                     "response.in_progress"]
        assert call(srv.port, "POST", RESPONSES, {"model": "m", "input": "hi"}).status == 500
    assert writer_threads() == 0
    assert sum("internal error: UnicodeEncodeError" in line for line in lines) == 10


# ---- what the fuzz suite found besides ----------------------------------------------------

@pytest.mark.parametrize("path", [MESSAGES, COUNT])
def test_a_forged_signature_with_any_text_in_it_is_dropped_not_a_500(k3, path):
    srv, _ = k3
    forged = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I plan.", "signature": "sig\u00e9\x80"},
        {"type": "text", "text": "Hello."}]}
    body = {"model": "m", "max_tokens": 2, "messages": [HI[0], forged, HI[0]]}
    assert call(srv.port, "POST", path, body).status == 200
