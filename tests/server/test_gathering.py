"""A reader takes the job's log in batches (serve/http/sinks.py's GATHER): a fast model's
tokens go out several to an event, saying exactly what they would one by one, and a slow
model's still go out one by one, as each comes."""
from __future__ import annotations

import codecs
import json
import statistics

import pytest

from scripted import (ScriptedEngine, block_data, blocking_and_streamed, call, real_service,
                      scripted_service, serving, sse_events, timed_blocks, xtml_answer,
                      xtml_tool_call)
from served import serve
from serve.core.reply import Delta, joined
from serve.service.journal import Emitted, Progress, gathered

WORDS = [f"w{i} " for i in range(400)]
ASK = [{"role": "user", "content": "hi"}]


# -- joining deltas ---------------------------------------------------------------------

def test_a_run_of_one_channel_joins_and_channels_stay_apart():
    deltas = [Delta(reasoning_content="a"), Delta(reasoning_content="b"), Delta(content="c"),
              Delta(content="d"), Delta(reasoning_content="e")]
    assert joined(deltas) == [Delta(reasoning_content="ab"), Delta(content="cd"),
                              Delta(reasoning_content="e")]


def test_call_arguments_join_but_never_into_the_calls_first_delta():
    first = Delta(tool_call={"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": ""}})
    pieces = [Delta(tool_call={"index": 0, "function": {"arguments": p}}) for p in ('{"a"', ': 1}')]
    second = Delta(tool_call={"index": 1, "id": "call_2", "type": "function",
                              "function": {"name": "g", "arguments": ""}})
    more = Delta(tool_call={"index": 1, "function": {"arguments": "{}"}})
    out = joined([first, *pieces, second, more])
    assert out == [first, Delta(tool_call={"index": 0, "function": {"arguments": '{"a": 1}'}}),
                   second, more]


def test_logprobs_join_only_between_deltas_that_both_have_them():
    a = Delta(content="a", logprobs=[{"token": "a"}])
    b = Delta(content="b", logprobs=[{"token": "b"}])
    plain = Delta(content="c")
    assert joined([a, b, plain, Delta(content="d")]) == [
        Delta(content="ab", logprobs=[{"token": "a"}, {"token": "b"}]), Delta(content="cd")]


def test_joining_leaves_the_given_deltas_as_they_were():
    # Other readers of the log hold the same deltas.
    pieces = [Delta(tool_call={"index": 0, "function": {"arguments": p}}) for p in "xyz"]
    texts = [Delta(content=t, logprobs=[{"token": t}]) for t in "xyz"]
    joined(pieces + texts)
    assert [d.tool_call for d in pieces] == [{"index": 0, "function": {"arguments": p}}
                                             for p in "xyz"]
    assert [(d.content, d.logprobs) for d in texts] == [(t, [{"token": t}]) for t in "xyz"]


def test_gathered_joins_runs_of_emitted_and_keeps_other_events_between():
    progress = Progress(done=1, total=2)
    events = [Emitted(Delta(content="a"), at=1.0), Emitted(Delta(content="b"), at=2.0), progress,
              Emitted(Delta(content="c"), at=3.0)]
    out = gathered(events)
    assert out == [Emitted(Delta(content="ab"), at=1.0), progress,
                   Emitted(Delta(content="c"), at=3.0)]


# -- a fast model: fewer events, the same words ------------------------------------------

def test_a_fast_chat_stream_sends_its_tokens_in_fewer_chunks_saying_the_same():
    body = {"model": "m", "messages": ASK, "max_tokens": 1000, "reasoning_effort": "none"}
    blocking, streamed = blocking_and_streamed(xtml_answer(*WORDS), "/v1/chat/completions", body)
    chunks = [c["choices"][0]["delta"].get("content") for c in sse_events(streamed) if c["choices"]]
    chunks = [c for c in chunks if c]
    assert "".join(chunks) == "".join(WORDS) == json.loads(blocking)["choices"][0]["message"]["content"]
    # 400 tokens came within milliseconds of one another: batches of them, not one each.
    assert len(chunks) < len(WORDS) / 2, len(chunks)


def test_a_fast_tool_calls_arguments_arrive_whole_in_fewer_chunks():
    value = "".join(WORDS)
    script = xtml_tool_call("note", {"text": value})
    # The argument's value as 400 tokens, so its JSON comes in as many pieces.
    at = script.index(value)
    script[at:at + 1] = WORDS
    function = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}
    body = {"model": "m", "messages": ASK, "max_tokens": 1000, "reasoning_effort": "none",
            "tools": [function]}
    blocking, streamed = blocking_and_streamed(script, "/v1/chat/completions", body)
    calls = [c for chunk in sse_events(streamed) if chunk["choices"]
             for c in chunk["choices"][0]["delta"].get("tool_calls") or []]
    assert len([c for c in calls if "id" in c]) == 1 and "id" in calls[0]
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(arguments) == {"text": value}
    assert json.loads(json.loads(blocking)["choices"][0]["message"]["tool_calls"][0]
                      ["function"]["arguments"]) == {"text": value}
    assert len(calls) < len(WORDS) / 2, len(calls)


def test_a_fast_messages_stream_keeps_thinking_and_text_in_their_blocks():
    script = xtml_answer(*WORDS, thinking=WORDS[:200])
    body = {"model": "m", "messages": ASK, "max_tokens": 1000}
    blocking, streamed = blocking_and_streamed(script, "/v1/messages", body)
    events = sse_events(streamed)
    deltas = [(e["index"], e["delta"]) for e in events if e["type"] == "content_block_delta"
              and e["delta"]["type"] in ("thinking_delta", "text_delta")]
    thinking = "".join(d["thinking"] for i, d in deltas if d["type"] == "thinking_delta")
    text = "".join(d["text"] for i, d in deltas if d["type"] == "text_delta")
    blocks = json.loads(blocking)["content"]
    assert thinking == "".join(WORDS[:200]) == blocks[0]["thinking"]
    assert text == "".join(WORDS) == blocks[1]["text"]
    assert {i for i, d in deltas if d["type"] == "thinking_delta"} == {0}
    assert {i for i, d in deltas if d["type"] == "text_delta"} == {1}
    assert len(deltas) < 600 / 2, len(deltas)


# -- the real engine -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3(lib_path, k3_container):
    with real_service(lib_path, k3_container, prefix_cache=None) as service, \
            serving(service) as srv:
        yield srv.server_address[1]


def test_each_chunks_logprobs_are_the_tokens_of_its_text(k3):
    body = {"model": "m", "messages": ASK, "max_tokens": 64, "temperature": 0,
            "reasoning_effort": "none", "logprobs": True, "stream": True}
    reply = call(k3, "POST", "/v1/chat/completions", body)
    chunks = [c["choices"][0] for c in reply.events()[:-1] if c["choices"]]
    said = [c for c in chunks if c["delta"].get("content")]
    assert said
    # A token may end inside a character, which the next token's text finishes.
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    for chunk in said:
        entries = chunk["logprobs"]["content"]
        assert entries
        assert decode(b"".join(bytes(e["bytes"]) for e in entries)) == chunk["delta"]["content"]
    assert decode(b"", True) == ""


@pytest.mark.parametrize("path, body, text", [
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "none"},
     lambda events, body: ("".join(c["choices"][0]["delta"].get("content") or ""
                                   for c in events if c.get("choices")),
                           body["choices"][0]["message"]["content"])),
    ("/v1/messages", {"messages": ASK, "thinking": {"type": "disabled"}},
     lambda events, body: ("".join(e["delta"].get("text", "") for e in events
                                   if e.get("type") == "content_block_delta"),
                           "".join(b.get("text", "") for b in body["content"]))),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "none"}},
     lambda events, body: ("".join(e.get("delta", "") for e in events
                                   if e.get("type") == "response.output_text.delta"),
                           "".join(part["text"] for item in body["output"]
                                   if item["type"] == "message" for part in item["content"]))),
])
def test_a_real_fast_stream_says_what_the_blocking_reply_says(k3, path, body, text):
    ask = {"model": "m", "max_tokens": 96, "temperature": 0, **body}
    streamed = call(k3, "POST", path, {**ask, "stream": True})
    blocking = call(k3, "POST", path, ask)
    assert streamed.status == blocking.status == 200
    said, whole = text(sse_events(streamed.body), blocking.json())
    assert said and said == whole


def test_a_real_fast_ollama_stream_says_what_the_blocking_reply_says(k3):
    ask = {"model": "m", "messages": ASK, "think": False, "options": {"temperature": 0,
                                                                      "num_predict": 96}}
    streamed = call(k3, "POST", "/api/chat", {**ask, "stream": True})
    blocking = call(k3, "POST", "/api/chat", {**ask, "stream": False})
    lines = [json.loads(line) for line in streamed.body.splitlines() if line.strip()]
    said = "".join(line["message"]["content"] for line in lines)
    assert said and said == blocking.json()["message"]["content"]


DELAY_MS = 40


def test_a_slow_models_tokens_still_go_out_one_by_one(k3_container, lib_path, tmp_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(k3_container, lib_path, tmp_path, "--no-thinking",
                   "--no-prefix-cache") as served:
            _, blocks = timed_blocks(served.port, "/v1/chat/completions", {
                "model": "m", "messages": ASK, "max_tokens": 24, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}})
    chunks = [(at, block_data(block)) for at, block in blocks if block_data(block)]
    said = [at for at, chunk in chunks
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content")]
    tokens = [chunk for _, chunk in chunks if chunk.get("usage")][0]["usage"]["completion_tokens"]
    # A token every 40 ms: each is sent as it comes, not held for the next.
    assert len(said) >= 0.7 * tokens, (len(said), tokens)
    gaps = [b - a for a, b in zip(said, said[1:])]
    assert statistics.median(gaps) > DELAY_MS / 2000, gaps
