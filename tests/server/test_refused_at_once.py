"""A request that will be refused is refused at once, however busy the engine.

`python3 -m serve` on the reference engine at a scaled clock (WASTE_DELAY_MS):
one streamed request prefills a prompt of ~3,600 tokens, some 54 s. While it
runs, in every dialect, blocking and streamed: count_tokens, a prompt too long
for the context, a NUL character, an image that does not decode, a tool result
naming no call, and a schema the grammar refuses are each answered with their
4xx as a real status line (never an error event inside a 200 stream), within a
bound far below the prefill's length and before it ends; the log and /metrics
count them as what they are.
"""
from __future__ import annotations

import base64
import json
import re
import time

import pytest

from busy import BOUND, DELAY_MS, busy_server
from fuzz_bodies import COMPLETIONS, COUNT, MESSAGES, RESPONSES, CHAT, exchange
from scripted import scrape
from slow_clock import prompt_text

TOO_LONG = prompt_text(400, "long")   # ~6,700 tokens; too few characters to refuse uncounted
BAD_IMAGE = "data:image/png;base64," + base64.b64encode(b"this is not an image at all").decode()
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "((("}}}


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def chat_case(case: str) -> dict:
    if case == "too long":
        return {"messages": user(TOO_LONG)}
    if case == "nul":
        return {"messages": user("a\u0000b")}
    if case == "image":
        return {"messages": user([{"type": "text", "text": "what?"},
                                  {"type": "image_url", "image_url": {"url": BAD_IMAGE}}])}
    if case == "tool result":
        return {"messages": [*user("hi"), {"role": "tool", "tool_call_id": "nope", "content": "x"}]}
    return {"messages": user("hi"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": BAD_SCHEMA}}}


def responses_case(case: str) -> dict:
    if case == "too long":
        return {"input": TOO_LONG}
    if case == "nul":
        return {"input": "a\u0000b"}
    if case == "image":
        return {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": BAD_IMAGE}]}]}
    if case == "tool result":
        return {"input": [{"role": "user", "content": "hi"},
                          {"type": "function_call_output", "call_id": "nope", "output": "x"}]}
    return {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                               "schema": BAD_SCHEMA}}}


def messages_case(case: str) -> dict:
    if case == "too long":
        return {"messages": user(TOO_LONG)}
    if case == "nul":
        return {"messages": user("a\u0000b")}
    if case == "image":
        return {"messages": user([{"type": "text", "text": "what?"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png",
            "data": base64.b64encode(b"this is not an image at all").decode()}}])}
    if case == "tool result":
        return {"messages": user([{"type": "tool_result", "tool_use_id": "nope", "content": "x"}])}
    return {"messages": user("hi"), "output_config": {"format": {"type": "json_schema",
                                                                 "schema": BAD_SCHEMA}}}


CASES = ["too long", "nul", "image", "tool result", "schema"]
BODIES = {
    CHAT: (chat_case, CASES),
    COMPLETIONS: (lambda case: {"prompt": TOO_LONG if case == "too long" else "a\u0000b"},
                  ["too long", "nul"]),
    RESPONSES: (responses_case, CASES),
    MESSAGES: (lambda case: {"model": "m", "max_tokens": 8, **messages_case(case)}, CASES),
    COUNT: (lambda case: {"model": "m", **messages_case(case)}, ["too long", "nul", "image", "tool result"]),
}
PARAMS = [(path, case, stream) for path, (_, cases) in BODIES.items() for case in cases
          for stream in ((False,) if path == COUNT else (False, True))]


@pytest.fixture(scope="module")
def busy(k3_vision_container, lib_path, tmp_path_factory):
    yield from busy_server(k3_vision_container, lib_path, tmp_path_factory.mktemp("busy"),
                           "tokens   serve's own", "--vision")


def test_count_tokens_answers_while_a_prefill_runs(busy):
    srv, long = busy
    body = {"model": "m", "messages": user("hello there")}
    sent = time.monotonic()
    outcome = exchange(srv.port, COUNT, json.dumps(body).encode(), timeout=60)
    took = time.monotonic() - sent
    assert outcome.status == 200 and outcome.problem is None, outcome.raw
    assert json.loads(outcome.raw.partition(b"\r\n\r\n")[2])["input_tokens"] > 0
    assert took < BOUND and not long.ended.is_set()


@pytest.mark.parametrize("path, case, stream", PARAMS)
def test_a_refusal_is_a_4xx_status_line_at_once(busy, path, case, stream):
    srv, long = busy
    make, _ = BODIES[path]
    body = {**make(case), **({"stream": True} if stream else {})}
    sent = time.monotonic()
    outcome = exchange(srv.port, path, json.dumps(body).encode(), timeout=60)
    took = time.monotonic() - sent
    assert outcome.status == 400 and outcome.problem is None, outcome.raw[:600]
    head = outcome.raw.partition(b"\r\n\r\n")[0]
    assert b"text/event-stream" not in head
    if case == "too long":
        error = json.loads(outcome.raw.partition(b"\r\n\r\n")[2])["error"]
        assert "tokens" in error["message"]
    assert took < BOUND, f"{took:.1f} s"
    assert not long.ended.is_set(), "the long prefill ended first: no proof"


def test_the_log_and_metrics_count_refusals_as_400s(busy):
    srv, long = busy
    exchange(srv.port, CHAT, json.dumps({**chat_case("nul"), "stream": True}).encode(), timeout=60)
    deadline = time.monotonic() + 10
    while not re.search(rf"POST {CHAT} 400 ", srv.log()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.search(rf"POST {CHAT} 400 ", srv.log()), srv.log()[-2000:]
    counted = scrape(srv.port)
    assert counted[("serve_requests_total", (("endpoint", CHAT), ("status", "400")))] >= 1
    assert ("serve_requests_total", (("endpoint", CHAT), ("status", "200"))) not in counted
    assert not long.ended.is_set()


@pytest.fixture(scope="module")
def busy_engine_tokenizer(k3_container, lib_path, tmp_path_factory):
    """As `busy`, tokenizing on the engine (--engine-tokenizer): between its prefill chunks."""
    yield from busy_server(k3_container, lib_path, tmp_path_factory.mktemp("busy-engine"),
                           "tokens   on the engine", "--engine-tokenizer", "--quiet")


CHUNK_S = 512 * DELAY_MS / 1000   # one prefill chunk: ~8 s


@pytest.mark.parametrize("path, body, status", [
    (COUNT, {"model": "m", "messages": user("hello there")}, 200),
    (CHAT, {"messages": user(TOO_LONG), "stream": True}, 400),
    (MESSAGES, {"model": "m", "max_tokens": 8, "messages": user("a\u0000b"), "stream": True}, 400)])
def test_tokenizing_on_the_engine_waits_for_a_chunk_not_the_prefill(busy_engine_tokenizer, path,
                                                                     body, status):
    srv, long = busy_engine_tokenizer
    sent = time.monotonic()
    outcome = exchange(srv.port, path, json.dumps(body).encode(), timeout=120)
    took = time.monotonic() - sent
    assert outcome.status == status and outcome.problem is None, outcome.raw[:600]
    assert took < 2 * CHUNK_S + BOUND, f"{took:.1f} s"
    assert not long.ended.is_set(), "the long prefill ended first: no proof"
