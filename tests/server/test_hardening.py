"""Overload, shutdown and hostile clients, in process against the scripted engine.

The same defects on the real engine, in a server subprocess and at soak
scale, are in test_soak.py.
"""
from __future__ import annotations

import re
import socket
import struct
import threading
import time

import pytest

from scripted import (ScriptedEngine, assert_error, call, post_open, raw_exchange, read_all,
                      read_until, scripted_service, serving, sse_data, status_of, xtml_answer)
from serve.http.server import Server
from serve.http.json_body import MAX_JSON_CONTAINERS, MAX_JSON_ITEMS

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
LONG = xtml_answer(*[f"w{i} " for i in range(40)])


class Gate:
    """Holds the first generation at its second token until opened."""

    def __init__(self, engine: ScriptedEngine):
        self.holding, self.open = threading.Event(), threading.Event()
        engine.before_token = self.pace
        self._engine = engine

    def pace(self, index: int) -> None:
        if len(self._engine.prompts) == 1 and index == 1:
            self.holding.set()
            assert self.open.wait(20)


def wait_for(condition, what: str, limit: float = 20) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def prompt_number(engine: ScriptedEngine, prompt: list[int]) -> int:
    return int(re.search(rb"request (\d+)", engine.detokenize(prompt)).group(1))


# ---- the queue ---------------------------------------------------------------

def test_requests_are_served_first_come_first_served():
    engine = ScriptedEngine([LONG, xtml_answer("ok")])
    gate = Gate(engine)
    with serving(scripted_service(engine, max_queue=64)) as srv:
        first = post_open(srv.port, {"messages": [{"role": "user", "content": "request 0"}], "stream": True})
        assert gate.holding.wait(20)
        waiting = []
        for i in range(1, 51):
            s = post_open(srv.port, {"messages": [{"role": "user", "content": f"request {i}"}],
                                "stream": True})
            # It is in line once it is told how many are ahead: the running one and i - 1.
            waiting.append((s, read_until(s, f": queue {i}\n\n".encode())))
        gate.open.set()
        bodies = [read_all(s, got) for s, got in [(first, b"")] + waiting]
    assert [prompt_number(engine, p) for p in engine.prompts] == list(range(51))
    for body in bodies[1:]:
        assert sse_data(body)[-1] == "[DONE]"
        # Positions only count down (a fast line may skip some), and the role chunk comes after.
        positions = [int(n) for n in re.findall(rb": queue (\d+)", body)]
        assert positions == sorted(positions, reverse=True)
        assert body.rindex(b": queue") < body.index(b'"role"')


def test_a_full_queue_is_a_503_with_retry_after():
    engine = ScriptedEngine([LONG, xtml_answer("ok")])
    gate = Gate(engine)
    with serving(scripted_service(engine, max_queue=1)) as srv:
        first = post_open(srv.port, {"messages": USER})
        assert gate.holding.wait(20)
        second = post_open(srv.port, {"messages": USER, "stream": True})
        told = read_until(second, b": queue 1\n\n")
        refused = call(srv.port, "POST", CHAT, {"messages": USER})
        err = assert_error(refused, 503, code="server_overloaded")
        assert refused.headers["retry-after"].isdigit()
        assert refused.headers["x-request-id"] in err["message"]
        gate.open.set()
        assert status_of(read_all(first)) == 200 and sse_data(read_all(second, told))[-1] == "[DONE]"


def test_a_client_that_leaves_the_queue_gives_up_its_place():
    engine = ScriptedEngine([LONG, xtml_answer("ok")])
    gate = Gate(engine)
    lines: list[str] = []
    service = scripted_service(engine, max_queue=1)
    with serving(service, log=lines.append) as srv:
        first = post_open(srv.port, {"messages": USER})
        assert gate.holding.wait(20)
        leaving = post_open(srv.port, {"messages": USER})
        wait_for(lambda: len(service.queue) == 1, "the second request never queued")
        leaving.close()
        wait_for(lambda: len(service.queue) == 0, "the departed client kept its place")
        gate.open.set()
        assert status_of(read_all(first)) == 200
        wait_for(lambda: len(lines) == 2, "two log lines")
    assert len(engine.prompts) == 1
    assert any(" 499 " in line for line in lines)


# ---- shutdown -------------------------------------------------------------------

def test_stop_cuts_the_running_request_and_empties_the_queue():
    engine = ScriptedEngine([LONG, xtml_answer("ok")])
    gate = Gate(engine)
    service = scripted_service(engine)
    with serving(service) as srv:
        running = post_open(srv.port, {"messages": USER, "stream": True})
        assert gate.holding.wait(20)
        blocking = post_open(srv.port, {"messages": USER})
        streaming = post_open(srv.port, {"messages": USER, "stream": True})
        wait_for(lambda: len(service.queue) == 2, "two requests in line")
        service.stop()
        gate.open.set()
        assert service.wait_idle(20)
        cut, refused, queued = read_all(running), read_all(blocking), read_all(streaming)
        after = call(srv.port, "POST", CHAT, {"messages": USER})
    events = sse_data(cut)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert events[1]["choices"][0]["delta"]  # it was cut mid-reply
    assert status_of(refused) == 503 and b"server_shutting_down" in refused
    assert sse_data(queued)[-2]["error"]["code"] == "server_shutting_down"
    assert_error(after, 503, code="server_shutting_down")
    assert len(engine.prompts) == 1 and engine.results[0].cancelled


def test_stop_reaches_a_prefill_at_its_next_chunk():
    engine = ScriptedEngine([xtml_answer("ok")])
    service = scripted_service(engine, prefill_chunk=64)
    engine.before_eval = lambda n: service.stop() if n == 1 else None
    with serving(service) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "x" * 400}]})
    assert_error(resp, 503, code="server_shutting_down")
    assert len(engine.evals) == 2 and engine.prompts == []


# ---- connections ------------------------------------------------------------------

def test_connections_beyond_the_cap_get_a_503():
    with serving(scripted_service(), max_connections=2) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=20) for _ in range(2)]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as third:
            third.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            refused = read_all(third)
        assert status_of(refused) == 503 and b"Retry-After: " in refused
        assert b"too_many_connections" in refused
        for s in idle:
            s.close()
        wait_for(lambda: status_of(raw_exchange(srv.port, HEALTH)) == 200, "served again once they closed")


def test_a_trickling_client_is_cut_at_the_request_deadline():
    # One header line at a time, each well inside any per-read timeout.
    with serving(scripted_service(), request_timeout=1.0, socket_timeout=30.0) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        ended = time.monotonic() + 30
        with s:
            try:
                while time.monotonic() < ended:
                    s.sendall(b"X-Slow: 1\r\n")
                    time.sleep(0.1)
            except OSError:
                pass  # the server closed the connection
            else:
                pytest.fail("the server kept a trickling client for 30 seconds")


def test_listen_backlog_holds_a_burst():
    # Nobody accepts: only the kernel's backlog can complete these connects.
    server = Server(("127.0.0.1", 0), scripted_service())
    clients = []
    try:
        for _ in range(120):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", server.port))
            clients.append(c)
        deadline = time.monotonic() + 20
        pending = list(clients)
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
                       or not _connected(c)]
            time.sleep(0.05)
        assert not pending, f"{len(pending)} of 120 connects waited on the backlog"
    finally:
        for c in clients:
            c.close()
        server.server_close()


def _connected(c: socket.socket) -> bool:
    try:
        c.getpeername()
        return True
    except OSError:
        return False


# ---- requests ------------------------------------------------------------------

def test_with_a_key_unknown_paths_are_401_and_the_scheme_is_case_insensitive():
    with serving(scripted_service(), api_key="k") as srv:
        assert_error(call(srv.port, "GET", "/v1/nothing"), 401)
        assert_error(call(srv.port, "GET", "/admin", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(call(srv.port, "GET", "/v1/nothing", headers={"Authorization": "Bearer k"}), 404)
        for scheme in ("bearer", "BEARER", "BeArEr"):
            assert call(srv.port, "GET", "/v1/models",
                        headers={"Authorization": f"{scheme} k"}).status == 200
        assert call(srv.port, "GET", "/v1/models", headers={"Authorization": "Basic k"}).status == 401


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/scripted"])
def test_head_gets_the_headers_of_get(path):
    with serving(scripted_service()) as srv:
        got, head = call(srv.port, "GET", path), call(srv.port, "HEAD", path)
        raw = raw_exchange(srv.port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                     .encode())
    assert head.status == 200 and head.body == b""
    assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.body))
    assert head.headers["content-type"] == got.headers["content-type"]
    assert raw.endswith(b"\r\n\r\n")  # nothing after the headers on the wire either


def test_a_blocking_client_that_sends_more_and_closes_is_gone():
    engine = ScriptedEngine([LONG, xtml_answer("next")])
    gate = Gate(engine)
    lines: list[str] = []
    # Without attaching, so that the job stops once it knows its client left (with attaching it
    # goes on for a retry: tests/server/test_disconnects.py).
    with serving(scripted_service(engine, attach=False), log=lines.append) as srv:
        s = post_open(srv.port, {"messages": USER})
        assert gate.holding.wait(20)
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")  # unread bytes: peeking finds data, not EOF
        s.close()
        time.sleep(0.2)  # lets the close reach the server; correctness does not depend on it
        gate.open.set()
        assert call(srv.port, "POST", CHAT, {"messages": USER}).status == 200
    assert engine.results[0].cancelled and engine.results[0].n_tokens == 2
    assert any("POST /v1/chat/completions 499 " in line for line in lines)


def test_a_reset_connection_is_one_log_line(capfd):
    lines: list[str] = []
    with serving(scripted_service(), log=lines.append) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        s.sendall(b"GET /hea")
        time.sleep(0.2)  # the server is reading the request line when the reset comes
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        wait_for(lambda: lines, "a log line for the reset")
        assert call(srv.port, "GET", "/health").status == 200
    assert "Traceback" not in capfd.readouterr().err
    assert len(lines) == 2 and "connection ended" in lines[0]


# ---- prompts that cannot fit ---------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x" * 300_000}),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 300_000}]}),
])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(path, body):
    engine = ScriptedEngine(ctx_max=4096)
    tokenized: list[int] = []
    tokenize = engine.tokenize
    engine.tokenize = lambda text, **kw: (tokenized.append(len(text)), tokenize(text, **kw))[1]
    with serving(scripted_service(engine)) as srv:
        resp = call(srv.port, "POST", path, body)
    assert_error(resp, 400, code="context_length_exceeded")
    assert max(tokenized, default=0) < 1000 and engine.prompts == []


# ---- bodies whose parsed values would dwarf their bytes -------------------------------

@pytest.mark.parametrize("item,limit", [({}, MAX_JSON_CONTAINERS), (0, MAX_JSON_ITEMS)])
def test_too_many_json_values_are_refused_before_parsing(item, limit):
    engine = ScriptedEngine()
    with serving(scripted_service(engine)) as srv:
        refused = call(srv.port, "POST", CHAT, {"messages": USER, "metadata": [item] * (limit + 1)})
        assert_error(refused, 413, code="request_too_large")
        # A few fewer (the rest of the body has some of its own) are parsed, the field ignored.
        fewer = call(srv.port, "POST", CHAT, {"messages": USER, "metadata": [item] * (limit - 5)})
        assert fewer.status == 200
    assert len(engine.prompts) == 1
