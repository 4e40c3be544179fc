"""Ollama's replies where their content is the point (a scripted engine, through the `ollama` client
and real sockets): tool calls whole with object arguments, a tool loop, reasoning as `thinking`,
heartbeats and waits that are nothing but JSON lines, an error inside a stream, and a client
that leaves one."""
from __future__ import annotations

import json
import socket
import time

import ollama
import pytest

from scripted import (ScriptedEngine, call, read_until, scripted_service, serving, waiting_in_line,
                      xtml_answer, xtml_tool_call)

ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
BEAT, HOLD = 0.3, 1.5   # the server's heartbeat, and how long the engine holds a token


def two_calls() -> list[str]:
    """One reply calling get_weather for Paris, then for Oslo."""
    paris, oslo = xtml_tool_call("get_weather", {"city": "Paris"}), \
        xtml_tool_call("get_weather", {"city": "Oslo"})
    return paris[:-7] + oslo[6:]   # the first call's tools block goes on with the second call


def client_for(port: int) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)


def lines(body: bytes) -> list[dict]:
    """A stream's NDJSON records: every line one JSON object, and nothing else."""
    text = body.decode()
    assert text.endswith("\n")
    return [json.loads(line) for line in text[:-1].split("\n")]


def test_tool_calls_come_whole_each_with_its_arguments_as_an_object():
    engine = ScriptedEngine([two_calls(), two_calls()])
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        done = client.chat(model="m", messages=ASK, tools=TOOLS)
        assert done.done_reason == "stop" and done.message.content == ""
        assert [(c.function.name, c.function.arguments) for c in done.message.tool_calls] == \
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
        raw = lines(call(srv.port, "POST", "/api/chat", {"model": "m", "messages": ASK,
                                                         "tools": TOOLS}).body)
    calls = [r["message"]["tool_calls"] for r in raw if r["message"].get("tool_calls")]
    assert [c[0]["function"] for c in calls] == [
        {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
        {"index": 1, "name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert all(len(c) == 1 and c[0]["id"].startswith("call_") for c in calls)
    assert raw[-1]["done"] and raw[-1]["done_reason"] == "stop"


def test_a_tool_loop_renders_the_call_and_its_result_by_name():
    engine = ScriptedEngine([xtml_tool_call("get_weather", {"city": "Paris"}),
                             xtml_answer("Sunny in Paris.")])
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        first = client.chat(model="m", messages=ASK, tools=TOOLS)
        rendered = len(engine.segments)   # the first prompt's
        history = [*ASK, first.message, {"role": "tool", "content": "18 C, sunny",
                                         "tool_name": "get_weather"}]
        second = client.chat(model="m", messages=history, tools=TOOLS)
    assert second.message.content == "Sunny in Paris."
    prompt = "".join(s.text for s in engine.segments[rendered:])
    # The call as the model made it, then its result, named for the tool it answers.
    assert 'call tool="get_weather"' in prompt and 'key="city" type="string"<|sep|>Paris' in prompt
    assert 'role="tool" tool="get_weather"' in prompt and "18 C, sunny" in prompt


def test_a_call_cut_by_num_predict_is_never_sent_as_a_call():
    engine = ScriptedEngine([xtml_tool_call("get_weather", {"city": "Paris"})] * 2)
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = {"model": "m", "messages": ASK, "tools": TOOLS, "options": {"num_predict": 11}}
        blocking = call(srv.port, "POST", "/api/chat", {**body, "stream": False}).json()
        streamed = lines(call(srv.port, "POST", "/api/chat", body).body)
    assert blocking["done_reason"] == "length" and "tool_calls" not in blocking["message"]
    assert not any(r["message"].get("tool_calls") for r in streamed)
    assert streamed[-1]["done_reason"] == "length"


def test_reasoning_is_thinking_streamed_and_blocking():
    engine = ScriptedEngine([xtml_answer("Hel", "lo", thinking=["Let me ", "think."])] * 2)
    with serving(scripted_service(engine)) as srv, client_for(srv.port) as client:
        done = client.chat(model="m", messages=ASK)
        parts = list(client.chat(model="m", messages=ASK, stream=True))
    assert (done.message.thinking, done.message.content) == ("Let me think.", "Hello")
    assert "".join(p.message.thinking or "" for p in parts) == "Let me think."
    assert "".join(p.message.content for p in parts) == "Hello"


def test_a_slow_first_token_gets_heartbeats_that_are_empty_pieces():
    engine = ScriptedEngine([xtml_answer("Sunny.")] * 2)
    engine.before_token = lambda n: time.sleep(HOLD) if n == 0 else None
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        raw = lines(call(srv.port, "POST", "/api/chat", {"model": "m", "messages": ASK}).body)
        with client_for(srv.port) as client:
            parts = list(client.chat(model="m", messages=ASK, stream=True))
    beats = raw[:next(i for i, r in enumerate(raw) if r["message"]["content"])]
    assert len(beats) >= 2   # HOLD is several heartbeats
    assert all(b["message"] == {"role": "assistant", "content": ""} and b["done"] is False
               for b in beats)
    assert "".join(p.message.content for p in parts) == "Sunny." and parts[-1].done


def test_a_wait_in_line_sends_nothing_but_json():
    service = waiting_in_line(scripted_service(ScriptedEngine([xtml_answer("ok")]), thinking=False),
                              2, 1)
    with serving(service) as srv:
        raw = lines(call(srv.port, "POST", "/api/chat", {"model": "m", "messages": ASK}).body)
    assert "".join(r["message"]["content"] for r in raw) == "ok" and raw[-1]["done"]


def test_an_engine_failure_is_a_500_or_the_streams_last_line():
    engine = ScriptedEngine([xtml_answer("a", "b", "c")])

    def fail(n: int) -> None:
        if n == 1:
            raise RuntimeError("the disk went away")

    engine.before_token = fail
    with serving(scripted_service(engine, thinking=False), log=lambda line: None) as srv:
        body = {"model": "m", "messages": ASK}
        blocking = call(srv.port, "POST", "/api/chat", {**body, "stream": False})
        assert blocking.status == 500
        assert blocking.json()["error"].startswith("internal error (request id req-")
        raw = lines(call(srv.port, "POST", "/api/chat", body).body)
        assert set(raw[-1]) == {"error"} and raw[-1]["error"].startswith("internal error")
        assert all(not r.get("done") for r in raw[:-1])
        with client_for(srv.port) as client, pytest.raises(ollama.ResponseError) as caught:
            list(client.chat(model="m", messages=ASK, stream=True))
        assert "internal error" in caught.value.error


def test_a_client_that_leaves_mid_stream_stops_the_reply():
    engine = ScriptedEngine([xtml_answer(*[f"w{i} " for i in range(40)]), xtml_answer("next")])
    engine.before_token = lambda n: time.sleep(0.05) if n > 8 else None
    log: list[str] = []
    with serving(scripted_service(engine, thinking=False), log=log.append) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            body = json.dumps({"model": "m", "messages": ASK}).encode()
            s.sendall(b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            read_until(s, b"w2 ")   # a few pieces in (a line each, or gathered)
        with client_for(srv.port) as client:   # the engine is free again
            assert client.chat(model="m", messages=ASK).message.content == "next"
    assert engine.results[0].cancelled and engine.results[0].n_tokens < 40
    assert any("POST /api/chat 499 " in line for line in log)
