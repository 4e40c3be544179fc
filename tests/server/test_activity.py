"""/health and /metrics say what the engine is doing: a request on it, a line, idle-time work.

Operators and routers place work by it, and tests wait on `idle` before they
inspect what idle-time work changes (snapshot files, eviction, counters).
"""
from __future__ import annotations

import threading

from scripted import (ScriptedEngine, settling, call, held_engine, scrape, scripted_service, serving, wait_idle,
                      xtml_answer)
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Tides?"}]
REPLY = xtml_answer("The rise", " and fall", " of the sea.", thinking=["It", " says", " so."])


def health(port: int) -> dict:
    """/health without its "work" member (tests/server/test_work_classes.py reads that)."""
    resp = call(port, "GET", "/health")
    assert resp.status == 200, resp.body
    body = resp.json()
    body.pop("work")
    return body


def gauges(port: int) -> tuple[float, float, float]:
    """(serve_busy, serve_queue_length, serve_idle) from /metrics."""
    now = scrape(port)
    return now[("serve_busy", ())], now[("serve_queue_length", ())], now[("serve_idle", ())]


def test_a_request_on_the_engine_and_one_in_line_are_reported():
    engine, held, release = held_engine(xtml_answer("slow", " reply"))
    with serving(scripted_service(engine, thinking=False)) as srv:
        assert health(srv.port) == {"status": "ok", "warming": None, "idle": True, "busy": False,
                                    "queue": 0, "deferred": False}
        assert gauges(srv.port) == (0, 0, 1)
        threads = [threading.Thread(target=call, args=(srv.port, "POST", CHAT, {"messages": USER}))
                   for _ in range(2)]
        try:
            threads[0].start()
            assert held.wait(30)
            assert health(srv.port) == {"status": "ok", "warming": None, "idle": False, "busy": True,
                                        "queue": 0, "deferred": False}
            threads[1].start()
            waited = threading.Event()
            while health(srv.port)["queue"] != 1:
                waited.wait(0.02)
            assert health(srv.port)["busy"] and gauges(srv.port) == (1, 1, 0)
        finally:
            release.set()
            for t in threads:
                t.join(30)
        assert wait_idle(srv.port)["queue"] == 0 and gauges(srv.port) == (0, 0, 1)


def test_idle_time_work_keeps_the_server_from_idle_until_it_ends(tmp_path):
    engine = ScriptedEngine([REPLY])
    in_settle, go_on = threading.Event(), threading.Event()

    def pace(chunk: int) -> None:
        if settling():
            in_settle.set()
            go_on.wait(30)

    engine.before_eval = pace
    cache = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    service = scripted_service(engine, prefix_cache=cache, reply_memory=ReplyMemory())
    try:
        with serving(service) as srv:
            # Cut by max_tokens: the idle engine then evaluates the reply's closing markup.
            first = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 10}).json()
            assert first["choices"][0]["finish_reason"] == "length"
            assert in_settle.wait(30)
            assert health(srv.port) == {"status": "ok", "warming": None, "idle": False, "busy": False,
                                        "queue": 0, "deferred": True}
            assert gauges(srv.port) == (0, 0, 0)
            entries = len(cache)
            go_on.set()
            assert wait_idle(srv.port)["deferred"] is False
            # The settled state was stored before the server said it was idle.
            assert len(cache) == entries + 1 and gauges(srv.port) == (0, 0, 1)
    finally:
        go_on.set()
        cache.close()
