"""Tools on chat completions, scripted engine: calls in replies, results and choices in prompts."""
from __future__ import annotations

import json

import pytest

from scripted import (assert_error, call, engine, scripted_service, server, serving,
                      xtml_tool_call)

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# ---- tools ------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


def test_tool_call_reply_blocking(engine):
    engine.replies = [xtml_tool_call("get_weather", {"city": "Paris"})]
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    assert any("get_weather" in s.text for s in engine.segments if not s.markup)


def test_tool_call_reply_streamed_in_order(engine):
    engine.replies = [xtml_tool_call("get_weather", {"city": "Paris"})]
    with serving(scripted_service(engine, thinking=False)) as srv:
        events = call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS, "stream": True}).events()
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    calls = [d["tool_calls"][0] for d in deltas]
    assert all(set(d) == {"tool_calls"} for d in deltas)
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert all(c["index"] == 0 and "id" not in c for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_results_are_rendered(server, engine):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert call(server.port, "POST", CHAT, {"messages": messages, "tools": TOOLS}).status == 200
    assert any(s.text == "sunny" and not s.markup for s in engine.segments)


def test_named_tool_choice_must_be_a_declared_tool(server, engine):
    choice = {"type": "function", "function": {"name": "get_time"}}
    err = assert_error(call(server.port, "POST", CHAT, {"messages": USER, "tools": TOOLS,
                                                        "tool_choice": choice}), 400, param="tool_choice")
    assert "get_time" in err["message"]
    choice["function"]["name"] = "get_weather"
    assert call(server.port, "POST", CHAT, {"messages": USER, "tools": TOOLS,
                                            "tool_choice": choice}).status == 200
    # Rendered as `required`, plus a note naming the tool.
    texts = [s.text for s in engine.segments if not s.markup]
    assert any("tool_choice=required" in t for t in texts)
    assert any("`get_weather`" in t and "no other tool" in t for t in texts)
    assert len(engine.prompts) == 1


def _call_turn(arguments: str, call_id: str = "c1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


@pytest.mark.parametrize("arguments", ["[]", "3", '"Paris"', "null"])
def test_tool_call_arguments_that_are_json_but_not_an_object_are_a_400(server, engine, arguments):
    body = {"messages": [*USER, _call_turn(arguments)], "tools": TOOLS}
    err = assert_error(call(server.port, "POST", CHAT, body), 400,
                       param="messages[1].tool_calls[0].function.arguments")
    assert "JSON object" in err["message"]
    assert engine.prompts == []


@pytest.mark.parametrize("messages, param", [
    ([*USER, {"role": "tool", "content": "sunny"}], "messages[1]"),
    ([*USER, _call_turn("{}"), {"role": "tool", "tool_call_id": "c1", "content": "a"},
      {"role": "tool", "tool_call_id": "c9", "content": "b"}], "messages[3]"),
])
def test_tool_results_without_a_name_to_find_are_a_400(server, engine, messages, param):
    err = assert_error(call(server.port, "POST", CHAT, {"messages": messages, "tools": TOOLS}), 400,
                       param=param)
    assert "tool name" in err["message"]
    assert engine.prompts == []


def test_names_reasoning_and_positional_tool_results_reach_the_prompt(server, engine):
    messages = [{"role": "system", "content": "s", "name": "policy"},
                {"role": "user", "content": "q", "name": "ann"},
                {**_call_turn('{"city": "Paris"}'), "name": "bot", "reasoning": "look it up"},
                {"role": "tool", "content": "sunny"}]   # no id: the call at its position
    assert call(server.port, "POST", CHAT, {"messages": messages, "tools": TOOLS}).status == 200
    prompt = "".join(s.text for s in engine.segments)
    for role, name in (("system", "policy"), ("user", "ann"), ("assistant", "bot")):
        assert f'<|open|>message role="{role}" name="{name}"<|sep|>' in prompt
    assert "<|open|>think<|sep|>look it up<|close|>think" in prompt
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny' in prompt


def _two_calls() -> list[str]:
    """A reply calling get_weather twice: the first call through its close, then the
    second's call element onwards."""
    one = xtml_tool_call("get_weather", {"city": "Paris"})
    two = xtml_tool_call("get_weather", {"city": "Rome"})
    return one[:-7] + two[6:]


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_cuts_a_reply_without_a_grammar_after_one_call(engine, parallel):
    # The scripted engine has no logits: no grammar holds the reply, so the reader stops it.
    engine.replies = [_two_calls()]
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS,
                                            "parallel_tool_calls": parallel}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    cities = [json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]]
    assert cities == (["Paris", "Rome"] if parallel else ["Paris"])
