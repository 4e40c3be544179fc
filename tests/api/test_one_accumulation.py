"""Each dialect's blocking body and its stream come from the same events: through real
sockets, the same scripted reply asked for blocking and streamed says the same thing in
both, block by block (thinking, text, a tool call), in every wire format."""
from __future__ import annotations

import json

import pytest

from scripted import blocking_and_streamed, sse_events, xtml_answer, xtml_tool_call

THINKS = xtml_answer("Hel", "lo", " there", thinking=["Let me ", "think."])
CALLS = xtml_tool_call("get_weather", {"city": "Paris"})
ASK = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
FUNCTION = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


@pytest.mark.parametrize("script, extra, blocks", [
    (THINKS, {}, [("thinking", "Let me think."), ("text", "Hello there")]),
    (CALLS, {"thinking": {"type": "disabled"},
             "tools": [{"name": "get_weather", "input_schema": SCHEMA}]},
     [("tool_use", {"city": "Paris"})])])
def test_messages_blocks_are_the_same_blocking_and_streamed(script, extra, blocks):
    ask = {"model": "m", "max_tokens": 50, "messages": ASK, **extra}
    blocking, streamed = blocking_and_streamed(script, "/v1/messages", ask)
    body = json.loads(blocking)
    said = [(b["type"], b.get("thinking") or b.get("text") or b.get("input"))
            for b in body["content"]]
    assert said == blocks
    events = sse_events(streamed)
    opened = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    pieces: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] != "signature_delta":
            delta = e["delta"]
            pieces[e["index"]] = pieces.get(e["index"], "") + (
                delta.get("thinking") or delta.get("text") or delta.get("partial_json") or "")
    streamed_blocks = [(kind, json.loads(pieces[i]) if kind == "tool_use" else pieces[i])
                       for i, kind in enumerate(opened)]
    assert streamed_blocks == blocks
    stop = [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"]
    assert stop == [body["stop_reason"]]


@pytest.mark.parametrize("script, extra", [
    (THINKS, {}),
    (CALLS, {"reasoning": {"effort": "none"},
             "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]})])
def test_a_response_is_the_same_blocking_and_streamed(script, extra):
    blocking, streamed = blocking_and_streamed(script, "/v1/responses",
                                                {"model": "m", "input": "hi", **extra})
    body = json.loads(blocking)
    final = [e for e in sse_events(streamed) if e["type"] == "response.completed"]
    assert len(final) == 1
    def shape(output: list[dict]) -> list:
        return [(item["type"], item.get("content"), item.get("name"), item.get("arguments"))
                for item in output]
    assert shape(body["output"]) == shape(final[0]["response"]["output"]) and body["output"]
    assert body["status"] == final[0]["response"]["status"] == "completed"


@pytest.mark.parametrize("script, extra, said", [
    (THINKS, {}, {"reasoning_content": "Let me think.", "content": "Hello there"}),
    (CALLS, {"reasoning_effort": "none", "tools": [FUNCTION]},
     {"tool": ("get_weather", {"city": "Paris"})})])
def test_a_chat_completion_is_the_same_blocking_and_streamed(script, extra, said):
    blocking, streamed = blocking_and_streamed(script, "/v1/chat/completions",
                                               {"model": "m", "messages": ASK, **extra})
    message = json.loads(blocking)["choices"][0]["message"]
    deltas = [e["choices"][0]["delta"] for e in sse_events(streamed) if e.get("choices")]
    for kind in ("reasoning_content", "content"):
        if kind in said:
            assert message[kind] == "".join(d.get(kind) or "" for d in deltas) == said[kind]
    if "tool" in said:
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        arguments = "".join(c["function"].get("arguments") or "" for c in calls)
        name = next(c["function"]["name"] for c in calls if c["function"].get("name"))
        whole = message["tool_calls"][0]["function"]
        assert (name, json.loads(arguments)) == (whole["name"], json.loads(whole["arguments"])) \
            == said["tool"]


@pytest.mark.parametrize("script, extra, said", [
    (THINKS, {}, {"thinking": "Let me think.", "content": "Hello there"}),
    (CALLS, {"think": False, "tools": [FUNCTION]},
     {"tool_calls": [("get_weather", {"city": "Paris"})]})])
def test_an_ollama_chat_is_the_same_blocking_and_streamed(script, extra, said):
    blocking, streamed = blocking_and_streamed(script, "/api/chat",
                                                {"model": "m", "messages": ASK, **extra})
    message = json.loads(blocking)["message"]
    pieces = [json.loads(line)["message"] for line in streamed.splitlines() if line]
    for kind in ("thinking", "content"):
        if kind in said:
            assert message[kind] == "".join(p.get(kind) or "" for p in pieces) == said[kind]
    if "tool_calls" in said:
        streamed_calls = [(c["function"]["name"], c["function"]["arguments"])
                          for p in pieces for c in p.get("tool_calls") or []]
        blocking_calls = [(c["function"]["name"], c["function"]["arguments"])
                          for c in message["tool_calls"]]
        assert streamed_calls == blocking_calls == said["tool_calls"]
