"""Fuzzing every dialect through a real server: whatever the body, a whole answer and no 5xx.

A server subprocess on the reference engine gets hypothesis' bodies (tests/fuzz_bodies.py)
on each endpoint; every answer is checked (a status below 500, a whole body or event stream in
the dialect's shapes, never a second HTTP response inside a stream), some streams are left
mid-way, and afterwards the server's threads and memory are back where they started.
`make check` runs a bounded, derandomized run; `make soak` a long random one.
"""
from __future__ import annotations

import json
import socket
import sys
import threading

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fuzz_bodies import CHAT, ENDPOINTS, MESSAGES, RESPONSES, bodies, encode, exchange
from scripted import call, wait_idle
from served import serve, settle
from team import keys_file

pytestmark = [pytest.mark.soak,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

SHORT, LONG = 200, 3000   # bodies per endpoint under make check, and under make soak
RSS_SLACK_KB = 24 * 1024


@pytest.fixture(scope="module")
def fuzzed(lib_path, k3_vision_container, tmp_path_factory):
    """One server for the whole run, warmed: its grammar vocabulary, an image, a stream."""
    tmp = tmp_path_factory.mktemp("fuzz")
    with serve(k3_vision_container, lib_path, tmp, "--quiet", "--vision", "--ctx", "2048",
               "--max-tokens", "8") as srv:
        warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "json_object"}, "logprobs": True, "stream": True}
        assert call(srv.port, "POST", CHAT, warm, timeout=120).status == 200
        yield srv
        assert "Traceback" not in srv.log(), srv.log()


def hang_up(port: int, path: str, data: bytes, after: int) -> None:
    """A client that reads `after` bytes of its answer (if that many come) and leaves."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while len(got) < after and (chunk := s.recv(4096)):
            got += chunk


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_body_gets_a_whole_answer_and_never_a_5xx(fuzzed, path, soak):
    srv = fuzzed
    wait_idle(srv.port)
    threads, rss = srv.status("Threads"), srv.status("VmRSS")

    @settings(max_examples=LONG if soak else SHORT, deadline=None, database=None,
              derandomize=not soak, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path), leave=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 600)))
    def answered(body: dict, leave) -> None:
        data = encode(body)
        if leave is not None and isinstance(body, dict) and body.get("stream") is True:
            hang_up(srv.port, path, data, leave)
            return
        outcome = exchange(srv.port, path, data)
        assert outcome.problem is None, (outcome.problem, data[:2000], outcome.raw[-2000:])

    answered()
    wait_idle(srv.port)
    settle(lambda: srv.status("Threads"), threads, 1, "threads")
    settle(lambda: srv.status("VmRSS"), rss, RSS_SLACK_KB, "RSS (kB)")


@pytest.fixture(scope="module")
def fuzzed_with_keys(lib_path, k3_container, tmp_path_factory):
    """A server with a key per person (--api-keys), and alice's key."""
    tmp = tmp_path_factory.mktemp("fuzz-keys")
    keys = keys_file(tmp / "keys", "alice", "bob")
    with serve(k3_container, lib_path, tmp, "--quiet", "--ctx", "2048", "--max-tokens", "8",
               "--api-keys", str(tmp / "keys")) as srv:
        yield srv, keys["alice"]
        assert "Traceback" not in srv.log(), srv.log()


@pytest.mark.parametrize("path", ENDPOINTS)
def test_with_keys_every_body_gets_a_whole_answer_and_never_a_5xx(fuzzed_with_keys, path, soak):
    srv, key = fuzzed_with_keys
    senders = st.sampled_from([(f"Authorization: Bearer {key}",), (f"x-api-key: {key}",),
                               (f"Authorization: bearer {key}",), ("Authorization: Bearer no",),
                               ("x-api-key: " + key[:-1],), ()])

    @settings(max_examples=(LONG if soak else SHORT) // 4, deadline=None, database=None,
              derandomize=not soak, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path), headers=senders)
    def answered(body: dict, headers: tuple[str, ...]) -> None:
        outcome = exchange(srv.port, path, encode(body), headers=headers)
        assert outcome.problem is None, (outcome.problem, outcome.raw[-2000:])
        authorized = bool(headers) and key in headers[0]
        assert (outcome.status == 401) != authorized, (headers, outcome.raw[-500:])

    answered()


def test_a_burst_of_large_bodies_gives_its_memory_back(lib_path, k3_container, tmp_path):
    # Sixteen 10 MB bodies, four at a time: each parsed on its own connection thread (and
    # so its own malloc arena), then refused.
    big = "x" * (10 << 20)
    kinds = [(CHAT, {"messages": [{"role": "user", "content": big}]}),
             (RESPONSES, {"input": "hi", "metadata": {"k": big}, "temperature": "hot"}),
             (MESSAGES, {"model": "m", "max_tokens": 2,
                         "messages": [{"role": "user", "content": [{"type": "text", "text": big}]}]}),
             (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": "x", "pad": [big[:100]] * 100_000})]
    with serve(k3_container, lib_path, tmp_path, "--quiet") as srv:
        assert call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2}).status == 200
        wait_idle(srv.port)
        rss = srv.status("VmRSS")
        for _ in range(4):
            answers: list[int] = []
            sending = [threading.Thread(target=lambda p=p, b=b: answers.append(
                call(srv.port, "POST", p, json.dumps(b).encode(), timeout=120).status))
                for p, b in kinds]
            for t in sending:
                t.start()
            for t in sending:
                t.join()
            assert answers == [400] * 4
        wait_idle(srv.port)
        # The last thread out trims the heap just after its answer went.
        settle(lambda: srv.status("VmRSS"), rss, RSS_SLACK_KB, "RSS (kB)")
