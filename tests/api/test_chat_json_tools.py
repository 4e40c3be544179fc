"""Tools on a chat.json container (random weights, the reference engine), through the official
clients: serve's generic call format, forced, named and free, in every dialect; parallel calls
and calls cut by max_tokens; and, on K3's XTML, the same cuts."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from scripted import call, real_service, serving
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"enum": ["metric", "imperial"]}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
HOT = {"temperature": 1.0, "max_tokens": 300}


@pytest.fixture(scope="module")
def srv(lib_path, kimi_linear_container):
    with real_service(lib_path, kimi_linear_container) as service, serving(service) as server:
        yield server


@pytest.fixture(scope="module")
def oai(srv):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(srv):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", api_key="x", max_retries=0,
                             timeout=120) as client:
        yield client


def valid_call(name: str, arguments) -> dict:
    """The call's arguments, parsed and checked against its tool's schema."""
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


# ---- forced, named and free calls ---------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_and_named_calls_parse_with_schema_valid_arguments(oai, choice, seed):
    done = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       seed=seed, **HOT)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    assert choice_.message.content is None and choice_.message.tool_calls
    for tool_call in choice_.message.tool_calls:
        if isinstance(choice, dict):
            assert tool_call.function.name == "get_time"
        valid_call(tool_call.function.name, tool_call.function.arguments)
    assert done.model_extra["waste"]["constrained"] is True


# One call at most: Messages has no seed, and a random model free to chain calls at
# temperature 1 now and then chains them past max_tokens.
@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather",
                                     "disable_parallel_tool_use": True}])
def test_forced_and_named_tool_use_through_the_anthropic_client(claude, choice):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    message = claude.messages.create(model="m", max_tokens=300, messages=ASK, tools=tools,
                                     tool_choice=choice, temperature=1.0)
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(block.id.startswith("toolu_") for block in uses)
    for block in uses:
        valid_call(block.name, block.input)
    if choice["type"] == "tool":
        assert {block.name for block in uses} == {"get_weather"}


def test_streamed_call_arrives_in_pieces_that_join_to_the_blocking_one(oai):
    request = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", seed=5, **HOT)
    whole = oai.chat.completions.create(**request).choices[0].message.tool_calls
    pieces: dict[int, list[str]] = {}
    names = {}
    for chunk in oai.chat.completions.create(stream=True, **request):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta.function.name:
                names[delta.index] = delta.function.name
            pieces.setdefault(delta.index, []).append(delta.function.arguments or "")
    assert [(names[i], "".join(pieces[i])) for i in sorted(pieces)] == \
        [(c.function.name, c.function.arguments) for c in whole]


@pytest.mark.parametrize("seed", range(6))
def test_auto_yields_text_or_a_call_never_a_broken_one(oai, seed):
    done = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="auto",
                                       seed=seed, temperature=1.0, max_tokens=40)
    choice = done.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            for tool_call in choice.message.tool_calls:
                valid_call(tool_call.function.name, tool_call.function.arguments)
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_leaves_the_tools_out(srv):
    without = call(srv.port, "POST", CHAT, {"messages": ASK, "max_tokens": 1, "seed": 1}).json()
    none = call(srv.port, "POST", CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                         "max_tokens": 1, "seed": 1}).json()
    auto = call(srv.port, "POST", CHAT, {"messages": ASK, "tools": TOOLS, "max_tokens": 1,
                                         "seed": 1}).json()
    assert none["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]
    assert auto["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]
    assert "tool_calls" not in none["choices"][0]["message"]


# ---- random schemas, hot -------------------------------------------------------------

LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 16)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.sampled_from(["a", "b", 3, True, None]), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n},
              st.integers(0, 4)))
KEYS = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def objects(values):
    """Objects bounded as tools declare them (no keys beyond their own), so that a call
    at temperature 1.5 ends well within max_tokens."""
    return st.dictionaries(KEYS, values, min_size=0, max_size=4).flatmap(
        lambda props: st.builds(lambda required: {"type": "object", "properties": props,
                                                  "required": required,
                                                  "additionalProperties": False},
                                st.lists(st.sampled_from(sorted(props)), unique=True)
                                if props else st.just([])))


SCHEMA = objects(st.one_of(LEAVES, objects(LEAVES)))


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])
@given(schema=SCHEMA, seed=st.integers(0, 2**32 - 1))
def test_calls_on_random_schemas_at_temperature_1_5_are_valid(oai, schema, seed):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    done = oai.chat.completions.create(model="m", messages=ASK, tools=tools, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "f"}},
                                       temperature=1.5, max_tokens=400)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (tool_call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(tool_call.function.arguments), schema)


# ---- a tool loop ---------------------------------------------------------------------

def test_a_three_turn_tool_loop_renders_and_reuses_its_prefix(lib_path, kimi_linear_container,
                                                              tmp_path):
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path))
    try:
        with real_service(lib_path, kimi_linear_container, prefix_cache=cache,
                          reply_memory=ReplyMemory()) as service, serving(service) as server:
            def ask(messages, **fields):
                body = call(server.port, "POST", CHAT, {"messages": messages, "tools": TOOLS,
                                                        "seed": 3, "temperature": 0,
                                                        "max_tokens": 60, **fields}).json()
                service.settle()
                return body
            first = ask(ASK, tool_choice="required")
            called = first["choices"][0]["message"]
            (tool_call,) = called["tool_calls"][:1]
            valid_call(tool_call["function"]["name"], tool_call["function"]["arguments"])
            history = [*ASK, {**called, "tool_calls": called["tool_calls"][:1]},
                       {"role": "tool", "tool_call_id": tool_call["id"], "content": "Sunny, 21 C"}]
            # The tools stay declared (tool_choice none would leave them out, and with them
            # the prefix): the model answers, or calls again.
            second = ask(history)
            answer = second["choices"][0]["message"]
            assert answer.get("tool_calls") or answer["content"]
            third = ask([*history, answer, {"role": "user", "content": "And tomorrow?"}])
    finally:
        cache.close()
    # Each turn restores at least the whole prompt before it (the call's own ids included,
    # from reply memory): only the new messages are prefilled.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"]


# ---- parallel calls, in every dialect ------------------------------------------------

def _calls(dialect: str, port: int, parallel: bool, seed: int, max_tokens: int = 300) -> tuple:
    """(calls as (name, arguments text), how the reply ended) in `dialect`."""
    if dialect == "chat":
        body = call(port, "POST", CHAT, {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                         "parallel_tool_calls": parallel, "seed": seed,
                                         "temperature": 1.5, "max_tokens": max_tokens}).json()
        choice = body["choices"][0]
        return ([(c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"].get("tool_calls", [])], choice["finish_reason"])
    if dialect == "messages":
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                 for t in TOOLS]
        # Messages has no seed: each reply is drawn afresh.
        body = call(port, "POST", "/v1/messages", {
            "model": "m", "messages": ASK, "tools": tools, "max_tokens": max_tokens,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": not parallel},
            "temperature": 1.0}).json()
        return ([(b["name"], json.dumps(b["input"])) for b in body["content"]
                 if b["type"] == "tool_use"], body["stop_reason"])
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    body = call(port, "POST", "/v1/responses", {
        "model": "m", "input": ASK, "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": parallel, "max_output_tokens": max_tokens, "temperature": 1.5,
        "store": False}).json()
    assert body["parallel_tool_calls"] is parallel
    return ([(item["name"], item["arguments"]) for item in body["output"]
             if item["type"] == "function_call"], body["status"])


ENDED_BY_CALLS = {"chat": "tool_calls", "messages": "tool_use", "responses": "completed"}


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_parallel_tool_calls_false_yields_one_call_and_ends_after_it(srv, dialect):
    for seed in range(4):
        calls, ended = _calls(dialect, srv.port, False, seed)
        assert len(calls) == 1 and ended == ENDED_BY_CALLS[dialect], (calls, ended)


def test_parallel_calls_are_allowed_when_not_refused(srv):
    # Hot sampling on random weights: some seed makes more than one call.
    counts = [len(_calls("chat", srv.port, True, seed)[0]) for seed in range(12)]
    assert max(counts) > 1, counts


# ---- a call cut by max_tokens, in every dialect --------------------------------------

def _cut_point(port: int) -> tuple[str, int]:
    """A forced call's full arguments, greedy, and a token count that ends inside the call
    (half its tokens: past the call's opening, before its end, in either format)."""
    body = call(port, "POST", CHAT, {"messages": ASK, "tools": TOOLS[:1], "tool_choice": "required",
                                     "parallel_tool_calls": False, "temperature": 0,
                                     "max_tokens": 300}).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    arguments = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    return arguments, body["usage"]["completion_tokens"] // 2


def _truncated(whole: str, part: str) -> None:
    """`part` is a proper prefix of the call's arguments, left as generated (not JSON)."""
    assert whole.startswith(part) and len(part) < len(whole)
    with pytest.raises(ValueError):
        json.loads(part)


CUT = {"messages": ASK, "tools": TOOLS[:1], "tool_choice": "required", "temperature": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_call_cut_by_max_tokens_arrives_truncated_with_length(srv, stream):
    whole, cut = _cut_point(srv.port)
    resp = call(srv.port, "POST", CHAT, {**CUT, "max_tokens": cut, "stream": stream})
    if stream:
        events = resp.events()[:-1]
        arguments = "".join(d["function"].get("arguments", "") for e in events if e["choices"]
                            for d in e["choices"][0]["delta"].get("tool_calls", []))
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    else:
        choice = resp.json()["choices"][0]
        arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
        finish = choice["finish_reason"]
    assert finish == "length"
    _truncated(whole, arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_tool_use_cut_by_max_tokens_stops_at_max_tokens(srv, stream):
    whole, cut = _cut_point(srv.port)
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
    body = {"model": "m", "messages": ASK, "tools": tools, "tool_choice": {"type": "any"},
            "temperature": 0, "max_tokens": cut, "stream": stream}
    resp = call(srv.port, "POST", "/v1/messages", body)
    if not stream:
        message = resp.json()
        assert message["stop_reason"] == "max_tokens"
        # As Anthropic shapes it: the cut block is there, its input empty, never half-parsed.
        (block,) = [b for b in message["content"] if b["type"] == "tool_use"]
        assert block["name"] == "get_weather" and block["input"] == {}
        return
    events = [data for _, data in resp.named_events()]
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    _truncated(whole, partial)
    (stop,) = [e for e in events if e["type"] == "message_delta"]
    assert stop["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_call_cut_by_max_output_tokens_is_incomplete(srv, stream):
    whole, cut = _cut_point(srv.port)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather",
              "parameters": WEATHER}]
    resp = call(srv.port, "POST", "/v1/responses", {
        "model": "m", "input": ASK, "tools": tools, "tool_choice": "required", "temperature": 0,
        "max_output_tokens": cut, "stream": stream, "store": False})
    response = [data for kind, data in resp.named_events()][-1]["response"] if stream else resp.json()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = [i for i in response["output"] if i["type"] == "function_call"]
    assert item["status"] == "incomplete"
    _truncated(whole, item["arguments"])


def test_an_xtml_call_cut_by_max_tokens_is_not_closed_either(lib_path, k3_container):
    with real_service(lib_path, k3_container, thinking=False) as service, serving(service) as server:
        whole, cut = _cut_point(server.port)
        choice = call(server.port, "POST", CHAT, {**CUT, "max_tokens": cut}).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    _truncated(whole, choice["message"]["tool_calls"][0]["function"]["arguments"])


def test_parameters_that_are_not_an_object_are_a_400_naming_the_field(srv):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    resp = call(srv.port, "POST", CHAT, {"messages": ASK, "tools": tools, "max_tokens": 5})
    assert resp.status == 400
    assert resp.json()["error"]["param"] == "tools[0].function.parameters.type"


def test_a_schema_the_grammar_cannot_build_is_a_400_naming_the_tool(srv):
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}]
    resp = call(srv.port, "POST", CHAT, {"messages": ASK, "tools": tools, "max_tokens": 5})
    assert resp.status == 400, resp.body
    assert resp.json()["error"]["param"].startswith("tools[0].function.parameters")


def test_a_required_argument_the_schema_does_not_describe_is_still_written(srv):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"required": ["a"]}}}]
    body = call(srv.port, "POST", CHAT, {"messages": ASK, "tools": tools, "tool_choice": "required",
                                         "parallel_tool_calls": False, "seed": 4,
                                         "temperature": 1.0, "max_tokens": 200}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert list(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == ["a"]
