"""GET /metrics: the Prometheus exposition, parsed with prometheus_client's own parser."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest

from scripted import (ScriptedEngine, assert_error, call, held_engine, real_service, samples, scrape,
                      scripted_service, serving, xtml_answer)
from serve.core.activity import Activity
from serve.service.metrics import Metrics
from serve.snapshots.cache import PrefixCache

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def scrape_until(port: int, done: Callable[[dict], bool], seconds: float = 10.0) -> tuple[dict, int]:
    """Scrape until `done` holds of a scrape (or time is up); the last scrape, and how many."""
    deadline = time.monotonic() + seconds
    scrapes = 0
    while True:
        after = scrape(port)
        scrapes += 1
        if done(after) or time.monotonic() > deadline:
            return after, scrapes
        time.sleep(0.05)


def test_metrics_need_the_key_and_the_page_does_not():
    with serving(scripted_service(), api_key="sekrit") as srv:
        assert_error(call(srv.port, "GET", "/metrics"), 401, code="invalid_api_key")
        assert call(srv.port, "GET", "/health").status == 200
        assert call(srv.port, "GET", "/").status == 200
        assert_error(call(srv.port, "POST", "/metrics", {}, headers={"Authorization": "Bearer sekrit"}),
                     405, code="method_not_allowed")
        after = scrape(srv.port, Authorization="Bearer sekrit")
    # The refused scrape and the refused POST were counted too.
    assert after[("serve_requests_total", (("endpoint", "/metrics"), ("status", "401")))] == 1
    assert after[("serve_requests_total", (("endpoint", "/metrics"), ("status", "405")))] == 1
    assert after[("serve_requests_total", (("endpoint", "/"), ("status", "200")))] == 1


def test_counters_move_by_the_requests_made(tmp_path):
    engine = ScriptedEngine([xtml_answer("one", " two", " three")])
    cache = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    try:
        with serving(scripted_service(engine, thinking=False, prefix_cache=cache)) as srv:
            before = scrape(srv.port)
            first = call(srv.port, "POST", CHAT, {"messages": USER}).json()
            # The next turn extends the first: its prefix is restored from a snapshot.
            turn = USER + [first["choices"][0]["message"], {"role": "user", "content": "more"}]
            second = call(srv.port, "POST", CHAT, {"messages": turn, "stream": True,
                                                   "stream_options": {"include_usage": True}}).events()[-2]
            assert call(srv.port, "GET", "/nowhere").status == 404
            assert call(srv.port, "GET", "/v1/models/elsewhere").status == 404
            assert call(srv.port, "POST", CHAT, {"messages": []}).status == 400
            # A stream is counted when its handler is done, just after its client read the end.
            after, scrapes = scrape_until(srv.port, lambda a: moved(before, a, "serve_requests_total",
                                                                    endpoint=CHAT, status="200") >= 2)
            entries, used = len(cache), cache.used_bytes
            restored = cache.stats()["restored_tokens"]
    finally:
        cache.close()
    usages = [first["usage"], second["usage"]]
    requests = "serve_requests_total"
    assert moved(before, after, requests, endpoint=CHAT, status="200") == 2
    assert moved(before, after, requests, endpoint=CHAT, status="400") == 1
    assert moved(before, after, requests, endpoint="other", status="404") == 1
    assert moved(before, after, requests, endpoint="/v1/models/{model}", status="404") == 1
    # The first scrape, and those that waited for the stream's count.
    assert moved(before, after, requests, endpoint="/metrics", status="200") == scrapes
    assert moved(before, after, "serve_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved(before, after, "serve_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and moved(before, after, "serve_cached_tokens_total") == cached
    assert moved(before, after, "serve_prefix_cache_hits_total") == 1
    assert moved(before, after, "serve_prefix_cache_misses_total") == 1
    # The cache's own count: the second request's restore, and any idle-time rebuild.
    assert cached <= after[("serve_prefix_cache_restored_tokens_total", ())] <= restored
    assert after[("serve_prefix_cache_entries", ())] == entries > 0
    assert after[("serve_prefix_cache_bytes", ())] == used > 0
    # Two generations, each of several tokens: one observation each.
    for name in ("serve_time_to_first_token_seconds", "serve_decode_tokens_per_second"):
        assert moved(before, after, name + "_count") == 2
        assert after[(name + "_bucket", (("le", "+Inf"),))] == after[(name + "_count", ())]
    # The scripted engine counts 3 hits and 1 miss of 4096 bytes per token.
    tokens = sum(u["completion_tokens"] for u in usages)
    assert moved(before, after, "serve_engine_expert_hits_total") == 3 * tokens
    assert moved(before, after, "serve_engine_expert_misses_total") == tokens
    assert moved(before, after, "serve_engine_bytes_read_total") == 4096 * tokens
    assert after[("serve_queue_length", ())] == 0


def test_engine_counters_match_the_real_engine(lib_path, k3_container):
    with real_service(lib_path, k3_container) as service, serving(service) as srv:
        before = scrape(srv.port)
        body = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 8, "temperature": 0}).json()
        after = scrape(srv.port)
    waste = body["waste"]
    assert moved(before, after, "serve_engine_expert_hits_total") == waste["experts_hit"]
    assert moved(before, after, "serve_engine_expert_misses_total") == waste["experts_missed"]
    assert moved(before, after, "serve_engine_bytes_read_total") == waste["bytes_read"]
    assert moved(before, after, "serve_completion_tokens_total") == body["usage"]["completion_tokens"] == 8
    # No prefix cache: its metrics are absent rather than zero.
    assert not any(name.startswith("serve_prefix_cache") for name, _ in after)


def test_queue_length_counts_requests_waiting_for_the_engine():
    engine, held, release = held_engine(xtml_answer("slow", " reply"))
    with serving(scripted_service(engine, thinking=False)) as srv:
        threads = [threading.Thread(target=call, args=(srv.port, "POST", CHAT, {"messages": USER}))
                   for _ in range(3)]
        try:
            threads[0].start()
            assert held.wait(30)
            for t in threads[1:]:
                t.start()
            # Two requests wait behind the one holding the engine.
            waited = threading.Event()
            for _ in range(1500):
                if scrape(srv.port)[("serve_queue_length", ())] == 2:
                    break
                waited.wait(0.02)
            assert scrape(srv.port)[("serve_queue_length", ())] == 2
        finally:
            release.set()
            for t in threads:
                t.join(30)
        assert scrape(srv.port)[("serve_queue_length", ())] == 0
        assert scrape(srv.port)[("serve_requests_total", (("endpoint", CHAT), ("status", "200")))] == 3


def test_label_values_are_escaped():
    metrics = Metrics(ScriptedEngine().stats(), lambda: Activity(False, 0, False, False))
    odd = 'a "quoted" back\\slash\nnewline'
    metrics.request(odd, 200)
    parsed = samples(metrics.render().decode())
    assert parsed[("serve_requests_total", (("endpoint", odd), ("status", "200")))] == 1


def test_histogram_buckets_are_cumulative():
    metrics = Metrics(ScriptedEngine().stats(), lambda: Activity(False, 0, False, False))
    for ttft in (0.01, 0.3, 0.3, 1000.0):
        metrics.reply(1, 0, 1, ttft, None)
    parsed = samples(metrics.render().decode())
    bucket = lambda le: parsed[("serve_time_to_first_token_seconds_bucket", (("le", le),))]  # noqa: E731
    assert (bucket("0.05"), bucket("0.25"), bucket("0.5"), bucket("600.0"), bucket("+Inf")) == (1, 1, 3, 3, 4)
    assert parsed[("serve_time_to_first_token_seconds_sum", ())] == pytest.approx(1000.61)
    assert parsed[("serve_decode_tokens_per_second_count", ())] == 0
