"""Nothing that needs no engine waits for it: the audit of issue 29, as a client meets it.

`python3 -m serve` on the reference engine at a scaled clock (tests/busy.py),
with an API key: one streamed request prefills ~3,600 tokens, some 54 s. While
it runs, each request a real client sends that must be refused, or that needs no
engine, is answered with its status line (never an error event inside a 200
stream) within a bound far below the prefill's length, and before it ends: in
all four dialects, blocking and streamed, and the endpoints that read no body.
Requests that pass every check wait in line: their stream opens at once and
beats, and a client that leaves the line leaves it at once, counted as a 499.
(tests/server/test_refused_at_once.py holds the refusals that need the prompt
tokenized: too long, NUL, images, tool results, schemas.)
"""
from __future__ import annotations

import json
import re
import socket
import time
from typing import Optional

import pytest

from busy import BOUND, busy_server
from fuzz_bodies import COMPLETIONS, COUNT, MESSAGES, RESPONSES, CHAT, exchange
from scripted import scrape

KEY = "sk-busy"
AUTH = (f"Authorization: Bearer {KEY}",)
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}


def anthropic(**fields) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": USER, **fields}


def responses(**fields) -> dict:
    return {"model": "m", "input": "hi", **fields}


DANGLING_USE = [*USER, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "t1", "name": "get", "input": {}}]}, {"role": "user", "content": "and?"}]
# (what, path, body, status): each POSTed blocking and streamed, but count_tokens (never streamed).
REFUSED = [
    ("bad json", CHAT, b"{nope", 400),
    ("tool_choice names no tool", CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, 400),
    ("tool_choice required, no tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400),
    ("n 2", CHAT, {"messages": USER, "n": 2}, 400),
    ("top_logprobs 21", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400),
    ("max_tokens -1", CHAT, {"messages": USER, "max_tokens": -1}, 400),
    ("stop 5", CHAT, {"messages": USER, "stop": list("abcde")}, 400),
    ("response_format type", CHAT, {"messages": USER, "response_format": {"type": "bogus"}}, 400),
    ("response_format no json_schema", CHAT, {"messages": USER,
                                              "response_format": {"type": "json_schema"}}, 400),
    ("response_format schema 5", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": 5}}}, 400),
    ("messages empty", CHAT, {"messages": []}, 400),
    ("tool call unanswered", CHAT, {"tools": [TOOL], "messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "user", "content": "and?"}]}, 400),
    ("remote image", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}, 400),
    ("temperature 5", CHAT, {"messages": USER, "temperature": 5}, 400),
    ("prompt ids", COMPLETIONS, {"prompt": [1, 2, 3]}, 400),
    ("logprobs 6", COMPLETIONS, {"prompt": "hi", "logprobs": 6}, 400),
    ("n 2", COMPLETIONS, {"prompt": "hi", "n": 2}, 400),
    ("echo", COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, 400),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "x"}, 400),
    ("best_of 2", COMPLETIONS, {"prompt": "hi", "best_of": 2}, 400),
    ("no max_tokens", MESSAGES, {"model": "m", "messages": USER}, 400),
    ("max_tokens 0", MESSAGES, anthropic(max_tokens=0), 400),
    ("budget_tokens -1", MESSAGES, anthropic(thinking={"type": "enabled", "budget_tokens": -1}), 400),
    ("tool_use unanswered", MESSAGES, anthropic(tools=[{"name": "get", "input_schema": {}}],
                                                messages=DANGLING_USE), 400),
    ("tool_choice names no tool", MESSAGES, anthropic(tools=[{"name": "get", "input_schema": {}}],
                                                      tool_choice={"type": "tool", "name": "x"}), 400),
    ("tool_choice any, no tools", MESSAGES, anthropic(tool_choice={"type": "any"}), 400),
    ("messages empty", MESSAGES, anthropic(messages=[]), 400),
    ("stop_sequences 5", MESSAGES, anthropic(stop_sequences=list("abcde")), 400),
    ("system 5", MESSAGES, anthropic(system=5), 400),
    ("no model", COUNT, {"messages": USER}, 400),
    ("messages empty", COUNT, {"model": "m", "messages": []}, 400),
    ("tool_use unanswered", COUNT, {"model": "m", "tools": [{"name": "get", "input_schema": {}}],
                                    "messages": DANGLING_USE}, 400),
    ("previous_response_id unknown", RESPONSES, responses(previous_response_id="resp_nope"), 400),
    ("function_call_output unknown", RESPONSES, responses(input=[
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "nope", "output": "x"}]), 400),
    ("function_call unanswered", RESPONSES, responses(
        tools=[{"type": "function", "name": "get", "parameters": {}}], input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"role": "user", "content": "and?"}]), 400),
    ("input empty", RESPONSES, responses(input=[]), 400),
    ("tool_choice required, no tools", RESPONSES, responses(tool_choice="required"), 400),
    ("max_output_tokens -1", RESPONSES, responses(max_output_tokens=-1), 400),
    ("text.format type", RESPONSES, responses(text={"format": {"type": "bogus"}}), 400),
    ("background not a boolean", RESPONSES, responses(background="yes"), 400),
    ("background with store false", RESPONSES, responses(background=True, store=False), 400),
]
POSTS = [pytest.param(path, body, status, stream, id=f"{path} {what} {'streamed' if stream else 'blocking'}")
         for what, path, body, status in REFUSED
         for stream in ((False,) if path == COUNT or isinstance(body, bytes) else (False, True))]

# (method, path, status, headers): no body, and no engine.
STORED = f"{RESPONSES}/resp_nope"
NO_ENGINE = [
    ("GET", "/v1/models", 200, AUTH), ("GET", "/v1/models/nope", 404, AUTH),
    ("GET", "/health", 200, ()), ("GET", "/metrics", 200, AUTH), ("GET", "/", 200, ()),
    ("GET", STORED, 404, AUTH), ("DELETE", STORED, 404, AUTH),
    ("GET", f"{STORED}/input_items", 404, AUTH), ("POST", f"{STORED}/cancel", 404, AUTH),
    ("OPTIONS", "*", 200, ()), ("OPTIONS", CHAT, 405, AUTH), ("GET", "/nope", 404, AUTH),
    ("POST", CHAT, 401, ("Authorization: Bearer wrong",)), ("POST", MESSAGES, 401, ()),
    ("POST", COUNT, 401, ("x-api-key: wrong",)),
]


@pytest.fixture(scope="module")
def busy(k3_vision_container, lib_path, tmp_path_factory):
    yield from busy_server(k3_vision_container, lib_path, tmp_path_factory.mktemp("busy-audit"),
                           "tokens   serve's own", "--vision", "--heartbeat", "1",
                           api_key=KEY)


def timed(port: int, path: str, data: bytes, method: str = "POST",
          headers: tuple[str, ...] = AUTH):
    sent = time.monotonic()
    outcome = exchange(port, path, data, timeout=60, method=method, headers=headers)
    return outcome, time.monotonic() - sent


def assert_at_once(took: float, long) -> None:
    assert took < BOUND, f"{took:.1f} s"
    assert not long.ended.is_set(), "the long prefill ended first: no proof"


@pytest.mark.parametrize("path, body, status, stream", POSTS)
def test_a_refusal_is_its_status_line_at_once(busy, path, body, status, stream):
    srv, long = busy
    data = body if isinstance(body, bytes) else json.dumps({**body, "stream": stream}).encode()
    outcome, took = timed(srv.port, path, data)
    assert outcome.status == status and outcome.problem is None, outcome.raw[:600]
    assert b"text/event-stream" not in outcome.raw.partition(b"\r\n\r\n")[0]
    assert_at_once(took, long)


@pytest.mark.parametrize("method, path, status, headers", NO_ENGINE,
                         ids=[f"{m} {p} {s}" for m, p, s, _ in NO_ENGINE])
def test_what_needs_no_engine_is_answered_at_once(busy, method, path, status, headers):
    srv, long = busy
    outcome, took = timed(srv.port, path, b"", method, headers)
    assert outcome.status == status, outcome.raw[:600]
    assert_at_once(took, long)


QUOTES = [("chat", {"messages": USER}), ("messages", anthropic()), ("responses", responses())]


@pytest.mark.parametrize("dialect, body", QUOTES, ids=[d for d, _ in QUOTES])
def test_a_quote_is_answered_at_once(busy, dialect, body):
    srv, long = busy
    outcome, took = timed(srv.port, f"/v1/quote?dialect={dialect}", json.dumps(body).encode())
    assert outcome.status == 200, outcome.raw[:600]
    quote = json.loads(outcome.raw.partition(b"\r\n\r\n")[2])
    assert quote["positions"] > 0 and quote["to_prefill"] == quote["positions"]   # no cache
    assert quote["ahead"] >= 1   # the long prefill holds the engine
    assert_at_once(took, long)


def test_an_oversized_body_is_refused_unread_at_once(busy):
    srv, long = busy
    sent = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {65 << 20}\r\n\r\n".encode())
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 "), head[:300]
    assert_at_once(time.monotonic() - sent, long)


def test_new_refusals_are_logged_and_counted_as_400s(busy):
    srv, long = busy
    body = dict(anthropic(tools=[{"name": "get", "input_schema": {}}], messages=DANGLING_USE),
                stream=True)
    outcome, _ = timed(srv.port, MESSAGES, json.dumps(body).encode())
    assert outcome.status == 400 and b"t1" in outcome.raw, outcome.raw[:600]
    assert logged(srv, rf"POST {MESSAGES} 400 "), srv.log()[-2000:]
    counted = scrape(srv.port, Authorization=f"Bearer {KEY}")
    assert counted[("serve_requests_total", (("endpoint", MESSAGES), ("status", "400")))] >= 1
    assert ("serve_requests_total", (("endpoint", MESSAGES), ("status", "200"))) not in counted
    assert not long.ended.is_set()


class Waiting:
    """A request that passes every check, sent while the engine is busy: it waits in line."""

    def __init__(self, port: int, stream: bool):
        body = json.dumps({"messages": USER, "max_tokens": 2, "stream": stream}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                          .encode() + body)

    def read_until(self, marker: bytes, within: float) -> bytes:
        raw, deadline = b"", time.monotonic() + within
        self.sock.settimeout(0.5)
        while marker not in raw and time.monotonic() < deadline:
            try:
                raw += self.sock.recv(65536)
            except TimeoutError:
                pass
        return raw


def queue_length(port: int) -> Optional[float]:
    return scrape(port, Authorization=f"Bearer {KEY}").get(("serve_queue_length", ()))


def logged(srv, pattern: str, within: float = 10) -> Optional[re.Match]:
    deadline = time.monotonic() + within
    while not (found := re.search(pattern, srv.log())) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def clients_gone(srv) -> list[str]:
    """The log lines of chat requests whose client left."""
    return re.findall(rf"POST {CHAT} 499 [^\n]*", srv.log())


def after_leaving(srv, before: int) -> list[str]:
    """clients_gone once one more client than `before` has left (or BOUND has passed)."""
    deadline = time.monotonic() + BOUND
    while len(clients_gone(srv)) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    return clients_gone(srv)


def test_a_waiting_stream_opens_and_beats_at_once(busy):
    srv, long = busy
    before = len(clients_gone(srv))
    waiting = Waiting(srv.port, stream=True)
    try:
        sent = time.monotonic()
        head = waiting.read_until(b": queue ", BOUND)
        assert head.startswith(b"HTTP/1.1 200 OK") and b"text/event-stream" in head, head[:600]
        # --heartbeat 1: the chat dialect's sign of life follows the queue comment.
        beats = waiting.read_until(b"data: ", BOUND)
        assert b"data: " in head + beats, (head + beats)[:600]
        assert_at_once(time.monotonic() - sent, long)
    finally:
        waiting.sock.close()
    assert len(after_leaving(srv, before)) == before + 1, srv.log()[-2000:]


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streamed"])
def test_a_client_that_leaves_the_line_leaves_it_at_once(busy, stream):
    srv, long = busy
    before = len(clients_gone(srv))
    waiting = Waiting(srv.port, stream)
    deadline = time.monotonic() + BOUND
    while queue_length(srv.port) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert queue_length(srv.port) == 1, "the request never waited in line"
    waiting.sock.close()
    closed = time.monotonic()
    while queue_length(srv.port) != 0 and time.monotonic() < closed + BOUND:
        time.sleep(0.1)
    assert queue_length(srv.port) == 0, "the request stayed in line after its client left"
    assert_at_once(time.monotonic() - closed, long)
    # Logged and counted as a client that left, never having had the engine.
    gone = after_leaving(srv, before)
    assert len(gone) == before + 1, srv.log()[-2000:]
    assert "engine at" not in gone[-1], gone[-1]
    counted = scrape(srv.port, Authorization=f"Bearer {KEY}")
    assert counted[("serve_requests_total", (("endpoint", CHAT), ("status", "499")))] >= before + 1


@pytest.fixture(scope="module")
def busy_without_numpy(k3_container, lib_path, tmp_path_factory):
    """As `busy`, where numpy cannot be imported: serve cannot decode, so logprobs are off."""
    hidden = tmp_path_factory.mktemp("hidden")
    for name in ("numpy", "llguidance"):
        (hidden / name).mkdir()
        (hidden / name / "__init__.py").write_text(f"raise ImportError('{name} hidden by the test')\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(hidden))
        yield from busy_server(k3_container, lib_path, tmp_path_factory.mktemp("busy-no-numpy"),
                               "tokens   serve's own", "--quiet", api_key=KEY)


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": USER, "logprobs": True}), (COMPLETIONS, {"prompt": "hi", "logprobs": 1})],
    ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streamed"])
def test_logprobs_serve_cannot_give_are_refused_at_once(busy_without_numpy, path, body, stream):
    srv, long = busy_without_numpy
    outcome, took = timed(srv.port, path, json.dumps({**body, "stream": stream}).encode())
    assert outcome.status == 400 and outcome.problem is None, outcome.raw[:600]
    assert b"logprobs_unavailable" in outcome.raw
    assert_at_once(took, long)
