"""Structured output on the reference engine's random-weight model: whatever the model would
write, the reply is valid JSON for the schema, and tool calls are well-formed calls."""
from __future__ import annotations

import json
import string

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripted import assert_error, call, real_service, serving
from serve.formats import grammar
from serve.formats.xtml.grammar import Markup, xtml_grammar
from serve.formats.xtml import render as xtml
from serve.dialects.openai_request import parse_chat_request
from serve.engine.binding import Engine, EngineConfig

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Tell me about the lighthouse."}]
HOT = {"temperature": 1.5, "max_tokens": 400, "reasoning_effort": "none"}
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def k3(lib_path, k3_container):
    with real_service(lib_path, k3_container) as service, serving(service) as srv:
        yield srv


def chat(port: int, **fields) -> dict:
    resp = call(port, "POST", CHAT, {"messages": USER, **HOT, **fields})
    assert resp.status == 200, resp.body
    return resp.json()


def json_schema_format(schema: dict, strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "strict": strict, "schema": schema}}


# ---- random schemas ----------------------------------------------------------------------

NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)
WORDS = st.text(string.ascii_letters + " ", max_size=6)


def leaves() -> st.SearchStrategy[dict]:
    bounded = st.integers(-1000, 1000)
    return st.one_of(
        st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                  st.integers(0, 3), st.integers(0, 12)),
        st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)},
                  bounded, bounded),
        st.builds(lambda a: {"type": "number", "minimum": a, "maximum": a + 100}, bounded),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.sampled_from(["yes", 3, True, None]).map(lambda v: {"const": v}),
    )


def objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(props: dict, required: list) -> dict:
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [k for k, keep in zip(props, required) if keep]}
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda required: build(props, required)))


def schemas() -> st.SearchStrategy[dict]:
    return st.recursive(leaves(), lambda inner: st.one_of(
        objects(inner),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner,
                  st.integers(0, 3)),
        st.lists(inner, min_size=2, max_size=2).map(lambda branches: {"anyOf": branches}),
    ), max_leaves=6)


def with_ref(schema: dict, name: str) -> dict:
    """The schema behind a $ref in $defs, as generated models write nested types."""
    return {"type": "object", "properties": {"item": {"$ref": f"#/$defs/{name}"}},
            "required": ["item"], "additionalProperties": False, "$defs": {name: schema}}


# ---- JSON answers --------------------------------------------------------------------------

@PROPERTY
@given(schema=st.one_of(objects(schemas()), schemas().map(lambda s: with_ref(s, "Inner"))),
       strict=st.booleans(), seed=st.integers(0, 2**32))
def test_random_schemas_give_valid_json(k3, schema, strict, seed):
    body = chat(k3.port, response_format=json_schema_format(schema, strict), seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert body["waste"]["constrained"] is True


@PROPERTY
@given(seed=st.integers(0, 2**32))
def test_json_object_gives_an_object(k3, seed):
    body = chat(k3.port, response_format={"type": "json_object"}, seed=seed, max_tokens=60,
                temperature=0.2)
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:   # cut by max_tokens: still the start of an object
        assert choice["message"]["content"].startswith("{")


def test_think_channel_stays_free_and_the_answer_follows_it(k3):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    finished = []
    for seed in range(12):
        body = chat(k3.port, response_format=json_schema_format(schema, True), seed=seed,
                    reasoning_effort="high")
        message = body["choices"][0]["message"]
        assert message["reasoning_content"]   # reasoning is not held to the schema
        if body["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(message["content"]), schema)
            finished.append(seed)
    assert finished, "no reply closed its think channel within the token limit"


def test_same_seed_same_answer_and_logprobs_do_not_change_it(k3):
    fields = dict(response_format=json_schema_format(with_ref({"type": "string", "maxLength": 9}, "S"),
                                                     True), seed=11, top_p=0.9, top_k=50)
    first, second = chat(k3.port, **fields), chat(k3.port, **fields)
    with_logprobs = chat(k3.port, **fields, logprobs=True)
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert with_logprobs["choices"][0]["message"] == first["choices"][0]["message"]
    assert first["choices"][0]["logprobs"] is None and with_logprobs["choices"][0]["logprobs"]["content"]


def test_waste_reports_the_constraint(k3):
    body = chat(k3.port, response_format={"type": "json_object"}, seed=1, temperature=0, max_tokens=30)
    waste = body["waste"]
    assert waste["constrained"] is True and waste["mask_ms"] > 0
    # Greedy on a random model: its first pick is not "{", so the mask changed at least that.
    assert 1 <= waste["mask_changed"] <= body["usage"]["completion_tokens"]
    plain = chat(k3.port, seed=1, max_tokens=5)["waste"]
    assert (plain["constrained"], plain["mask_ms"], plain["mask_changed"]) == (False, 0.0, 0)


def test_streamed_constrained_reply_matches_blocking(k3):
    fields = dict(response_format={"type": "json_object"}, seed=5, temperature=0.7, max_tokens=80)
    blocking = chat(k3.port, **fields)["choices"][0]["message"]["content"]
    events = call(k3.port, "POST", CHAT, {"messages": USER, **HOT, **fields, "stream": True}).events()
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == blocking


def test_a_chat_json_model_holds_the_whole_reply_to_the_schema(lib_path, kimi_linear_container):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
              "required": ["ok", "n"], "additionalProperties": False}
    with real_service(lib_path, kimi_linear_container) as service, serving(service) as srv:
        for seed in range(3):
            resp = call(srv.port, "POST", CHAT, {"messages": USER, "temperature": 1.5, "seed": seed,
                                                 "max_tokens": 100,
                                                 "response_format": json_schema_format(schema, False)})
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_schemas_that_cannot_be_enforced_are_a_400(k3):
    bad = json_schema_format({"type": "object", "properties": {"a": {"type": "string",
                                                                    "pattern": "(unclosed"}}}, True)
    assert_error(call(k3.port, "POST", CHAT, {"messages": USER, "response_format": bad}), 400,
                 param="response_format.json_schema.schema", code="unsupported_schema")
    named = {"type": "function", "function": {"name": "nowhere"}}
    assert_error(call(k3.port, "POST", CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": named}),
                 400, param="tool_choice")
    assert chat(k3.port, max_tokens=3, seed=1)["choices"][0]["finish_reason"] == "length"  # still serving


# ---- tool calls ------------------------------------------------------------------------------

def argument_schemas() -> st.SearchStrategy[dict]:
    return objects(st.one_of(leaves(), objects(leaves()),
                             st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2},
                                       leaves())))


@PROPERTY
@given(parameters=argument_schemas(), named=st.booleans(), seed=st.integers(0, 2**32))
def test_forced_calls_parse_back_into_valid_arguments(k3, parameters, named, seed):
    tool = {"type": "function", "function": {"name": "random_tool", "parameters": parameters}}
    choice = {"type": "function", "function": {"name": "random_tool"}} if named else "required"
    # A random model opens another call as often as it closes the block: room for many.
    body = chat(k3.port, tools=[TIME, tool], tool_choice=choice, seed=seed, max_tokens=1200)
    reply = body["choices"][0]
    calls = reply["message"]["tool_calls"]
    assert calls and (len(calls) == 1 or not named)
    # Random weights may open call after call until max_tokens cuts the last one: every call
    # the model finished must parse back valid; the cut one is what the model wrote so far.
    assert reply["finish_reason"] in ("tool_calls", "length"), reply
    if reply["finish_reason"] == "length":
        calls = calls[:-1]
    for call_ in calls:
        name = call_["function"]["name"]
        assert name == "random_tool" or (name == "get_time" and not named)
        schema = parameters if name == "random_tool" else TIME["function"]["parameters"]
        jsonschema.validate(json.loads(call_["function"]["arguments"]), schema)


def test_named_tool_choice_always_yields_that_call(k3):
    for seed in range(5):
        body = chat(k3.port, tools=[WEATHER, TIME], seed=seed,
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
        (only,) = body["choices"][0]["message"]["tool_calls"]
        assert only["function"]["name"] == "get_time"
        assert set(json.loads(only["function"]["arguments"])) == {"zone"}


def test_tool_choice_none_never_yields_a_call(k3):
    for seed in range(5):
        body = chat(k3.port, tools=[WEATHER], tool_choice="none", seed=seed, max_tokens=60)
        assert "tool_calls" not in body["choices"][0]["message"]
        assert body["waste"]["constrained"] is True


@pytest.fixture(scope="module")
def matcher_for(lib, k3_container):
    """Builds a matcher for a request, as the service does, on the k3 vocabulary."""
    with Engine(lib, k3_container, EngineConfig()) as engine:
        markers = [engine.specials[t] for t in (xtml.OPEN, xtml.SEP, xtml.CLOSE)]
        n_vocab = len(engine.eval(engine.tokenize("x", add_bos=True)))
        vocabulary = grammar.Vocabulary(engine, n_vocab, [engine.specials[xtml.END_OF_MSG]])

        def build(body: dict, thinking: bool = False):
            req = parse_chat_request({"messages": USER, **body})
            lark = xtml_grammar(req, Markup(*markers), thinking)
            return vocabulary.matcher(grammar.compile_grammar(lark)), engine
        yield build


def history_reply(engine, calls: list[dict], content: str = "") -> list[int]:
    """The ids of a reply as xtml writes it into history, after the generation prompt."""
    segments = xtml.build_chat_segments(
        [{"role": "assistant", "content": content, "reasoning_content": "",
          "tool_calls": [{"id": f"c{i}", "type": "function", "function": f} for i, f in enumerate(calls)]}],
        add_generation_prompt=False)
    ids = engine.tokenize_segments(segments)
    prompt = engine.tokenize_segments(xtml.generation_prompt(False))
    # History always writes an (empty) think element; the generation prompt skips it.
    response = engine.tokenize_segments([xtml.Segment(xtml.OPEN, True), xtml.Segment("response", False),
                                         xtml.Segment(xtml.SEP, True)])
    start = next(i for i in range(len(ids)) if ids[i:i + len(response)] == response) + len(response)
    assert ids[:len(prompt) - len(response)] == prompt[:len(prompt) - len(response)]
    return ids[start:-1]   # up to the message close; <|end_of_msg|> is the stop token


def accepts(matcher, ids: list[int]) -> bool:
    return matcher.validate_tokens(ids) == len(ids) and (matcher.consume_tokens(ids) and matcher.is_accepting())


def test_the_grammar_accepts_exactly_the_calls_history_writes(matcher_for):
    auto = {"tools": [WEATHER, TIME]}
    good = [{"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
            {"name": "get_time", "arguments": json.dumps({"zone": "UTC"})}]
    matcher, engine = matcher_for(auto)
    assert accepts(matcher, history_reply(engine, good, "Let me look."))
    bad_calls = {
        "unknown tool": [{"name": "get_mood", "arguments": "{}"}],
        "missing required key": [{"name": "get_weather", "arguments": json.dumps({"days": 3})}],
        "unknown key": [{"name": "get_weather", "arguments": json.dumps({"city": "P", "x": 1})}],
        "wrong type": [{"name": "get_weather", "arguments": json.dumps({"city": "P", "days": "3"})}],
        "out of range": [{"name": "get_weather", "arguments": json.dumps({"city": "P", "days": 9})}],
        "not in enum": [{"name": "get_weather", "arguments": json.dumps({"city": "P", "unit": "K"})}],
    }
    for what, calls in bad_calls.items():
        matcher, engine = matcher_for(auto)
        assert not accepts(matcher, history_reply(engine, calls)), what
    # none: no tools block at all; required: not without one; named: only that tool.
    matcher, engine = matcher_for({**auto, "tool_choice": "none"})
    assert not accepts(matcher, history_reply(engine, good[1:]))
    matcher, engine = matcher_for({**auto, "tool_choice": "required"})
    assert not accepts(matcher, history_reply(engine, [], "no call"))
    matcher, engine = matcher_for({**auto, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert accepts(matcher, history_reply(engine, good[1:]))
    matcher, engine = matcher_for({**auto, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert not accepts(matcher, history_reply(engine, good[:1]))


def test_a_string_argument_never_holds_a_nul(matcher_for):
    # The call comes back in the next request's history, and text with a NUL cannot be
    # tokenized: the random model wrote one in about 1 forced call in 120 before it was barred.
    weather = WEATHER["function"]
    patterned = {"type": "function", "function": {**weather, "parameters": {
        **weather["parameters"], "properties": {"city": {"type": "string", "pattern": "^P.*$"}}}}}
    _, engine = matcher_for({"tools": [WEATHER]})
    ids = history_reply(engine, [{"name": "get_weather", "arguments": json.dumps({"city": "Pa"})}])
    city = engine.tokenize("Pa")
    at = next(i for i in range(len(ids)) if ids[i:i + len(city)] == city) + len(city)
    nul = next(t for t in range(1 << 20) if engine.detokenize([t]) == b"\0")
    for tool in (WEATHER, patterned):
        body = {"tools": [tool], "tool_choice": "required"}
        assert accepts(matcher_for(body)[0], ids)
        assert not accepts(matcher_for(body)[0], ids[:at] + [nul] + ids[at:]), tool


def test_string_patterns_and_strict_tools(k3):
    code = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["code", "path"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "path": {"type": "string", "pattern": "[a-z]{1,4}/[a-z]{1,4}"}}}}}
    named = {"type": "function", "function": {"name": "lookup"}}
    for seed in range(3):
        (only,) = chat(k3.port, tools=[code], tool_choice=named, seed=seed)["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(only["function"]["arguments"]), code["function"]["parameters"])
    # A strict tool whose schema uses what cannot be enforced is refused, not loosened.
    unique = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
        "type": "object", "required": ["n"], "additionalProperties": False,
        "properties": {"n": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True,
                             "maxItems": 2}}}}}
    assert_error(call(k3.port, "POST", CHAT, {"messages": USER, "tools": [unique], "tool_choice": "required"}),
                 400, param="tools[0].function.parameters.properties.n", code="unsupported_schema")
    unique["function"]["strict"] = False
    assert chat(k3.port, tools=[unique], tool_choice="required", seed=1)["choices"][0]["message"]["tool_calls"]
