"""Clients that leave, requests that queue, engines that fail: over real sockets, scripted engine."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from scripted import assert_error, call, engine, scripted_service, server, serving, xtml_answer
from serve.engine.binding import WasteError
from serve.service.generation import ASK_EVERY_S

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# ---- disconnects and queueing -------------------------------------------------

def _held_after_the_first_token(engine, every_s: float = 0.0
                                ) -> tuple[threading.Event, threading.Event]:
    """The engine stops after its first token (`first_sent` is set) until `closed` is;
    `every_s`: the time each token takes."""
    first_sent, closed = threading.Event(), threading.Event()

    def pace(index: int) -> None:
        time.sleep(every_s)
        if index == 1:
            first_sent.set()
            assert closed.wait(10)

    engine.before_token = pace
    return first_sent, closed


def _leave_after_the_first_token(port: int, body: dict, closed: threading.Event,
                                 first_sent: threading.Event) -> bytes:
    """Send `body`, read until the first token's chunk (a stream) or the first token's
    generation (blocking), then close the socket."""
    request = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(request)}\r\n\r\n".encode()
              + request)
    assert first_sent.wait(10)
    received = b""
    while body.get("stream") and b"w0 " not in received:  # the first token's chunk
        received += s.recv(4096)
    s.close()
    closed.set()
    return received


@pytest.mark.parametrize("stream", [True, False])
def test_without_attaching_a_disconnect_cancels_at_the_next_token(engine, stream):
    """Tokens as far apart as the token callback's asks (a real model's, K3's seconds): the
    token after the client left is the last."""
    engine.replies = [xtml_answer(*[f"w{i} " for i in range(50)]), xtml_answer("next")]
    first_sent, closed = _held_after_the_first_token(engine, every_s=2 * ASK_EVERY_S)
    with serving(scripted_service(engine, thinking=False, attach=False)) as srv:
        received = _leave_after_the_first_token(srv.port, {"messages": USER, "stream": stream},
                                                closed, first_sent)
        engine.before_token = None
        nxt = call(srv.port, "POST", CHAT, {"messages": USER}).json()
    assert not stream or b"w0 " in received
    assert engine.results[0].cancelled and engine.results[0].n_tokens == 2
    assert nxt["choices"][0]["message"]["content"] == "next"


def test_a_disconnect_from_a_fast_model_costs_at_most_a_millisecond_of_tokens(engine):
    """Tokens faster than the asks (a toy model's thousands a second): the callback polls
    the client once a millisecond, not once a token, so a few more tokens follow the
    hang-up, and a reply that ends within the millisecond is not cancelled at all."""
    engine.replies = [xtml_answer(*[f"w{i} " for i in range(400)]), xtml_answer("next")]
    first_sent, closed = _held_after_the_first_token(engine, every_s=ASK_EVERY_S / 20)
    with serving(scripted_service(engine, thinking=False, attach=False)) as srv:
        _leave_after_the_first_token(srv.port, {"messages": USER}, closed, first_sent)
        nxt = call(srv.port, "POST", CHAT, {"messages": USER}).json()
    assert nxt["choices"][0]["message"]["content"] == "next"
    # 20 tokens a millisecond; a busy machine's sleeps run long, so only the bound is firm.
    assert engine.results[0].cancelled and 2 <= engine.results[0].n_tokens < 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnected_job_goes_on_and_its_retry_attaches_to_it(engine, stream):
    """The job is not the connection: its client leaves after the first token, the reply
    goes on while nobody waits, and the same request sent again gets all of it, generated
    once (the engine's second reply is never asked for)."""
    words = [f"w{i} " for i in range(50)]
    engine.replies = [xtml_answer(*words), xtml_answer("next")]
    first_sent, closed = _held_after_the_first_token(engine)
    with serving(scripted_service(engine, thinking=False)) as srv:
        _leave_after_the_first_token(srv.port, {"messages": USER, "stream": stream}, closed,
                                     first_sent)
        retry = call(srv.port, "POST", CHAT, {"messages": USER, "stream": stream})
        engine.before_token = None
        fresh = call(srv.port, "POST", CHAT, {"messages": USER, "stream": stream})
    assert retry.status == 200
    if stream:
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in retry.events()[:-1]
                       if e["choices"]) == "".join(words)
    else:
        assert retry.json()["choices"][0]["message"]["content"] == "".join(words)
    assert len(engine.results) == 2 and not engine.results[0].cancelled
    # The retry got the whole reply: the same request once more is a new question.
    assert b"next" in fresh.body


def test_each_token_reaches_the_client_before_the_next_is_generated(engine):
    # Sends are gathered only while tokens outpace the socket: a slow model's
    # tokens must each go out at once, never wait for the next one.
    words = [f"t{i} " for i in range(5)]
    engine.replies = [xtml_answer(*words)]
    received = b""
    delivered = threading.Condition()

    def pace(index: int) -> None:
        if index > 0:
            with delivered:
                assert delivered.wait_for(lambda: words[index - 1].encode() in received, 10)

    engine.before_token = pace
    with serving(scripted_service(engine, thinking=False)) as srv:
        request = json.dumps({"messages": USER, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(request)}\r\n\r\n"
                      .encode() + request)
            while b"[DONE]" not in received:
                data = s.recv(4096)
                assert data
                with delivered:
                    received += data
                    delivered.notify_all()
    assert all(w.encode() in received for w in words)


@pytest.fixture
def many_open_files():
    """Occupy descriptors up to 1100, so the server's next socket is numbered above 1023."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("needs a descriptor limit of at least 1200")
    held = []
    with open(os.devnull) as devnull:
        while not held or held[-1] < 1100:
            held.append(os.dup(devnull.fileno()))
    yield
    for fd in held:
        os.close(fd)


def test_connections_numbered_above_1023_are_served(engine, many_open_files):
    # select() cannot watch such a descriptor; the disconnect check must not take
    # that for a client that has gone away.
    engine.replies = [xtml_answer("still", " here")]
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER}).json()
        events = call(srv.port, "POST", CHAT, {"messages": USER, "stream": True}).events()
    assert body["choices"][0]["message"]["content"] == "still here"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_requests_queue_while_health_answers(engine):
    gate, holding = threading.Event(), threading.Event()

    def pace(index: int) -> None:
        if len(engine.prompts) == 1 and index == 0:
            holding.set()
            assert gate.wait(10)

    engine.before_token = pace
    results = []
    with serving(scripted_service(engine)) as srv:
        workers = [threading.Thread(target=lambda: results.append(
            call(srv.port, "POST", CHAT, {"messages": USER}).status)) for _ in range(3)]
        workers[0].start()
        assert holding.wait(10)
        for w in workers[1:]:
            w.start()
        # Generation is held mid-reply; discovery endpoints must not wait for it.
        assert call(srv.port, "GET", "/health", timeout=5).status == 200
        assert call(srv.port, "GET", "/v1/models", timeout=5).status == 200
        assert len(engine.prompts) == 1
        gate.set()
        for w in workers:
            w.join(20)
    assert results == [200, 200, 200]
    assert engine.max_active == 1 and len(engine.prompts) == 3


# ---- engine failures -------------------------------------------------------------

def fail_at(index: int):
    def pace(i: int) -> None:
        if i == index:
            raise WasteError(-1, "WASTE_E_IO", "I/O error", "short read", "waste_generate")
    return pace


def test_engine_error_mid_stream_is_an_sse_error(engine):
    engine.before_token = fail_at(2)
    lines: list[str] = []
    with serving(scripted_service(engine), log=lines.append) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": USER, "stream": True})
        assert resp.status == 200
        events = resp.events()
        assert events[-1] == "[DONE]"
        # The client gets a generic message with the request id; the details are in the log.
        rid = resp.headers["x-request-id"]
        assert events[-2]["error"] == {"message": f"internal error (request id {rid})",
                                       "type": "server_error", "param": None, "code": None}
        assert any(line.startswith(f"{rid} internal error") and "short read" in line for line in lines)
        # What was said before the failure is not taken back (a token or two, gathered or not).
        assert events[1]["choices"][0]["delta"]["reasoning_content"].startswith("Let me ")
        engine.before_token = None
        assert call(srv.port, "POST", CHAT, {"messages": USER}).status == 200


def test_engine_error_in_a_blocking_request_is_a_500(engine):
    engine.before_token = fail_at(0)
    with serving(scripted_service(engine)) as srv:
        assert_error(call(srv.port, "POST", CHAT, {"messages": USER}), 500)
        # A stream has started (headers sent) once generation begins, so the error is in-band.
        events = call(srv.port, "POST", "/v1/completions", {"prompt": "x", "stream": True}).events()
        assert events[0]["error"]["type"] == "server_error" and events[1] == "[DONE]"
        engine.before_token = None
        assert call(srv.port, "GET", "/health").status == 200
