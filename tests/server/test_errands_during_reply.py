"""Tokenizing on the engine waits for one generated token, not for the whole reply.

With --engine-tokenizer every prompt is tokenized by the engine, which on K3 is busy
for tens of minutes with one reply: waste_generate is a single call. At a scaled clock
(WASTE_DELAY_MS per evaluated token) a completion of some 2,900 sampled tokens runs
for about 40 s; a count_tokens, and a prompt too long for the context, sent while
it streams are answered within seconds, tokenized from the token callback
(serve/engine/queue.py, errands), and the reply goes on.
"""
from __future__ import annotations

import json
import time

import pytest

from fuzz_bodies import CHAT, COUNT, exchange
from served import serve
from slow_clock import Streamed, prompt_text

DELAY_MS = 15
SEED = 0             # the k3 container's sampled reply to "Once" runs all 3,000 tokens at this seed
BOUND = 8.0          # s: far below the reply's ~40 s, for all the machine's noise


@pytest.fixture(scope="module")
def replying(k3_container, lib_path, tmp_path_factory):
    """(the server, a long streamed reply in progress): past its prefill, well before its end."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(k3_container, lib_path, tmp_path_factory.mktemp("replying"), "--ctx", "4096",
                   "--no-prefix-cache", "--engine-tokenizer", "--quiet") as srv:
            assert any(line.startswith("tokens   on the engine") for line in srv.banner)
            reply = Streamed(srv.port, "/v1/completions", {
                "prompt": "Once", "max_tokens": 3000, "temperature": 1.0, "seed": SEED})
            try:
                deadline = time.monotonic() + 60
                while reply.raw.count(b"data: {") < 40 and not reply.ended.is_set():
                    assert time.monotonic() < deadline, reply.raw[-400:]
                    time.sleep(0.05)
                assert not reply.ended.is_set(), "the reply ended early: no proof"
                yield srv, reply
            finally:
                reply.close()


@pytest.mark.parametrize("path, body, status", [
    (COUNT, {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}, 200),
    (CHAT, {"messages": [{"role": "user", "content": prompt_text(400, "long")}], "stream": True},
     400)])
def test_tokenizing_waits_for_a_token_not_the_reply(replying, path, body, status):
    srv, reply = replying
    before = reply.raw.count(b"data: {")
    sent = time.monotonic()
    outcome = exchange(srv.port, path, json.dumps(body).encode(), timeout=120)
    took = time.monotonic() - sent
    assert outcome.status == status and outcome.problem is None, outcome.raw[:600]
    if status == 200:
        assert json.loads(outcome.raw.partition(b"\r\n\r\n")[2])["input_tokens"] > 0
    assert took < BOUND, f"{took:.1f} s"
    assert not reply.ended.is_set(), "the reply ended first: no proof"
    time.sleep(1.0)
    assert reply.raw.count(b"data: {") > before, "the reply stopped streaming"
