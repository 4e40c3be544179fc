"""tests/fuzz_bodies.py against a busy engine: a refusal never waits for the engine, so it
is never an error inside a 200 stream.

Two servers on the reference engine. The first is busy: a streamed request
prefills ~3,600 tokens at a scaled clock (WASTE_DELAY_MS), some 72 s, and no one
may wait in line (--max-queue 0), so every fuzzed body is answered at once: a
4xx when it is refused, a 503 when it passed every check and would wait for the
engine (or count_tokens' 200). The second is idle and fast: each body again.
A body refused while busy is refused alike when idle, and a body that passed
every check while busy is not refused when idle (no 4xx, no error event in
its stream): whatever would refuse it was checked before the line.
"""
from __future__ import annotations

import json
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from fuzz_bodies import (ENDPOINTS, MESSAGES, OLLAMA_CHAT, OLLAMA_GENERATE, RESPONSES,
                         WITHOUT_ENGINE, bodies, encode, exchange)
from served import serve
from slow_clock import LongPrefill

pytestmark = [pytest.mark.soak,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

SHORT, LONG = 30, 400    # bodies per endpoint under make check, and under make soak
DELAY_MS = 20
LONG_ITEMS = 215         # ~3,600 tokens: ~72 s of prefill at DELAY_MS, for every endpoint
FLAGS = ("--vision", "--ctx", "4096", "--max-tokens", "8", "--no-prefix-cache",
         "--no-finish-abandoned", "--quiet")


@pytest.fixture(scope="module")
def servers(lib_path, k3_vision_container, tmp_path_factory):
    """(the busy server's port, its long prefill, the idle server's port)."""
    tmp = tmp_path_factory.mktemp("fuzz-busy")
    with serve(k3_vision_container, lib_path, tmp, *FLAGS) as idle:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
            with serve(k3_vision_container, lib_path, tmp, *FLAGS, "--max-queue", "0") as busy:
                long = LongPrefill(busy.port, LONG_ITEMS)
                try:
                    assert long.holding.wait(60), long.raw
                    yield busy.port, long, idle.port
                finally:
                    long.close()


def needs_no_engine(path: str, data: bytes) -> bool:
    """count_tokens and tokenizing, and Ollama's way of loading a model (a chat with no
    messages, a generate with no prompt): answered with a 200 without the engine."""
    if path in WITHOUT_ENGINE:
        return True
    body = json.loads(data) if path in (OLLAMA_CHAT, OLLAMA_GENERATE) else None
    key = "messages" if path == OLLAMA_CHAT else "prompt"
    return isinstance(body, dict) and body.get(key) in (None, "", [])


def stream_error(path: str, raw: bytes) -> bool:
    """A stream that carries an error: a refusal inside a 200."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"application/x-ndjson" in head:   # Ollama's: an error is a line of its own
        return b'\n{"error"' in b"\n" + body
    if b"text/event-stream" not in head:
        return False
    if path == MESSAGES:
        return b"event: error\n" in body
    if path == RESPONSES:
        return b"event: response.failed\n" in body or b"event: error\n" in body
    return b'data: {"error"' in body


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_refusal_waits_for_the_engine(servers, path, soak):
    busy, long, idle = servers
    sent: list[tuple[bytes, int]] = []

    @settings(max_examples=LONG if soak else SHORT, deadline=None, database=None,
              derandomize=not soak, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def answered_at_once(body: dict) -> None:
        data = encode(body)
        outcome = exchange(busy, path, data, timeout=30)
        accepted = outcome.status == 503 or (needs_no_engine(path, data) and outcome.status == 200)
        assert 400 <= outcome.status < 500 or accepted, (data[:1000], outcome.raw[-1000:])
        assert outcome.status == 503 or outcome.problem is None, (outcome.problem, data[:1000])
        sent.append((data, outcome.status))

    answered_at_once()
    assert not long.ended.is_set(), "the long prefill ended first: no proof"
    assert any(status in (200, 503) for _, status in sent) and any(400 <= status < 500
                                                                    for _, status in sent)
    for data, status in sent:
        again = exchange(idle, path, data, timeout=120)
        assert again.problem is None, (again.problem, data[:1000], again.raw[-1000:])
        if status in (200, 503):   # passed every check while busy: not refused when idle either
            assert again.status < 400 and not stream_error(path, again.raw), \
                (data[:1000], again.raw[-1500:])
        else:
            assert again.status == status, (data[:1000], again.raw[-1000:])
