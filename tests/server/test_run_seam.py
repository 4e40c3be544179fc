"""The threads running a request hand its events to the request's Journal and run no HTTP code.

Over real sockets with the scripted engine: every call the request's thread makes
while it is inside the service (waiting in line, reading the reply back), and
every call the engine's worker makes while it runs the request's body (prefill,
generation: serve/engine/worker.py), is watched, and none may reach serve/http/
or serve/dialects/ (the exchange's bytes, the stream's writer). The events still
reach the client, whole and in order.
"""
from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

import pytest

from scripted import ScriptedEngine, call, held_engine, scripted_service, serving, xtml_answer
from serve.core.reply import Delta
from serve.dialects import openai
from serve.dialects.sse import EventWriter
from serve.engine.worker import EngineWorker
from serve.service.facade import Service
from serve.service.journal import Journal

SERVE = Path(__file__).resolve().parents[2] / "serve"
HTTP_SIDE = (str(SERVE / "http") + "/", str(SERVE / "dialects") + "/")
USER = [{"role": "user", "content": "hi"}]
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
ANSWER = xtml_answer("Hel", "lo")


class Watched:
    """The serve modules each thread called into while inside Service.chat/complete."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []   # (thread name, file)
        self._lock = threading.Lock()

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            name = threading.current_thread().name

            def profile(frame: FrameType, event: str, arg: Any) -> None:
                if event == "call" and frame.f_code.co_filename.startswith(str(SERVE)):
                    with self._lock:
                        self.calls.append((name, frame.f_code.co_filename))
            before = sys.getprofile()   # a worker's call from itself nests
            sys.setprofile(profile)
            try:
                return method(*args, **kwargs)
            finally:
                sys.setprofile(before)
        return watched

    def http_side(self) -> list[str]:
        return [path for _, path in self.calls if path.startswith(HTTP_SIDE)]

    def ran(self, module: str) -> bool:
        return any(path.endswith(module) for _, path in self.calls)


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watched]:
    watch = Watched()
    monkeypatch.setattr(Service, "chat", watch.wrap(Service.chat))
    monkeypatch.setattr(Service, "complete", watch.wrap(Service.complete))
    handed = EngineWorker.call
    monkeypatch.setattr(EngineWorker, "call", lambda worker, fn: handed(worker, watch.wrap(fn)))
    yield watch


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": USER}),
    (CHAT, {"messages": USER, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    (MESSAGES, {"model": "m", "messages": USER, "max_tokens": 50}),
    (MESSAGES, {"model": "m", "messages": USER, "max_tokens": 50, "stream": True}),
    ("/v1/responses", {"input": "hi", "stream": True}),
])
def test_generation_runs_no_http_code(watched: Watched, path: str, body: dict):
    engine, held, release = held_engine(ANSWER)
    release.set()
    with serving(scripted_service(engine, thinking=False)) as srv:
        resp = call(srv.port, "POST", path, body)
    assert resp.status == 200, resp.body
    assert b"Hel" in resp.body and b"lo" in resp.body   # the reply reached the client
    assert watched.ran("serve/service/journal.py") and watched.ran("serve/service/generation.py")
    assert watched.http_side() == []


def test_a_stream_waiting_in_line_opens_from_an_http_thread(watched: Watched):
    """The line's events (the stream opens, says its place) come while the waiting thread
    is inside the service: they too are written by the HTTP side."""
    engine, held, release = held_engine(ANSWER)
    service = scripted_service(engine, thinking=False)

    def release_once_the_second_waits() -> None:
        deadline = time.monotonic() + 30
        while len(service.queue) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)   # its place told, and the stream opened
        release.set()

    with serving(service) as srv:
        first = threading.Thread(target=call, args=(srv.port, "POST", CHAT, {"messages": USER}))
        first.start()
        assert held.wait(10)
        threading.Thread(target=release_once_the_second_waits).start()
        # Not the first's question (its own max_tokens), so it waits instead of attaching.
        second = call(srv.port, "POST", CHAT, {"messages": USER, "stream": True, "max_tokens": 9})
        first.join(30)
    assert second.status == 200
    assert "queue 1" in second.comments()
    events = second.events()
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"]) == "Hello"
    assert watched.http_side() == []


# ---- when the HTTP side fails ---------------------------------------------------------


class Broken(io.RawIOBase):
    """A client's socket that refuses every send."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raise BrokenPipeError("the client went away")


def test_a_failed_send_tells_the_run_once():
    left: list[int] = []
    writer = EventWriter(Broken(), on_failed=lambda: left.append(1))
    writer.start()
    writer.put(b"data: one\n\n")
    time.sleep(0.1)
    writer.put(b"data: two\n\n")
    writer.close()
    assert writer.failed and left == [1]


def test_the_run_says_gone_once_nobody_follows_it_it_is_stopped_or_shutdown_began():
    stopping = threading.Event()
    run = Journal(stopping)
    assert not run.should_stop() and run.detached_for() is None
    reader = run.follow()
    assert not run.should_stop()
    run.unfollow(reader)
    assert run.should_stop() and not run.cut and run.detached_for() is not None
    client_left = threading.Event()
    run.follow(client_left.is_set)   # an identical request came back for it
    assert not run.should_stop() and run.detached_for() is None
    client_left.set()                # its client closed its socket: known before its reader looks
    assert run.should_stop() and run.detached_for() is not None
    run.follow()
    assert not run.should_stop()
    run.stop()
    assert run.should_stop() and run.stopped and not run.cut
    stopping.set()
    assert run.should_stop() and run.cut


def test_an_exchange_that_fails_ends_the_reply_and_a_stream_stops_generating(monkeypatch):
    reply = xtml_answer(*[f"w{i} " for i in range(40)])
    engine = ScriptedEngine([reply])
    tokens: list[int] = []

    def pace(n: int) -> None:   # a model slow enough for the failure to reach the engine's thread
        tokens.append(n)
        time.sleep(0.05)

    engine.before_token = pace
    real = openai.ChatExchange.delta

    def delta(self: openai.ChatExchange, d: Delta) -> bytes:
        if "w3" in d.content:
            raise RuntimeError("the exchange broke")
        return real(self, d)

    monkeypatch.setattr(openai.ChatExchange, "delta", delta)
    with serving(scripted_service(engine, thinking=False)) as srv:
        streamed = call(srv.port, "POST", CHAT, {"messages": USER, "stream": True})
        generated = len(tokens)
        engine.before_token = None
        blocking = call(srv.port, "POST", CHAT, {"messages": USER})
        after = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 3})
    # The stream: the failure event ends it, and generation stopped (at the next token the
    # engine's thread began after the sse-events thread told the Journal).
    assert streamed.status == 200
    events = streamed.events()
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == "w0 w1 w2 "
    assert generated < len(reply)
    # The blocking reply, whose exchange takes the deltas once generation is over: a 500.
    assert blocking.status == 500 and "internal error" in blocking.json()["error"]["message"]
    assert after.status == 200   # the server goes on
