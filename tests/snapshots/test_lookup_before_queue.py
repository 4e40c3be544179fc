"""The prefix-cache lookup, and the shared tier's fetch, made while a request waits for the
engine, not on it (serve/snapshots/lookup.py).

Through real sockets on the reference engine: which thread verifies and copies, and whether
it holds the engine then; a request that waited behind another of the same conversation
restores the longer snapshot that one stored; an entry evicted or damaged while its request
waited is not restored (the answer is still a cold run's); hits and misses count once; a
client that leaves mid-fetch leaves nothing behind. The cache on its own below that.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from scripted import call, real_service, serving, wait_idle
from cache_calls import publish
from serve.service.facade import Service
from serve.formats.xtml import render as xtml
from serve.snapshots import cache as cache_module, lookup, shared_dir, tiers
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.shared_tier import SharedTier
from serve.snapshots.snapshot import Snapshot

CHAT = "/v1/chat/completions"
ANSWER_ONLY = {"temperature": 0, "seed": 3, "max_tokens": 6, "reasoning_effort": "none"}
IDENTITY = '{"model": "test"}'
SYSTEM = {"role": "system", "content": "You answer questions about the sea, briefly and kindly."}
FIRST = [SYSTEM, {"role": "user", "content": "Why are there tides on the coast of Brittany?"}]
LATER = FIRST + [{"role": "assistant", "content": "The moon pulls the water."},
                 {"role": "user", "content": "And why twice a day?"}]


def published(host: "Host") -> None:
    """Wait until what the host queued for the team is published: the server says it is idle
    (its idle-time work includes publishing), and the publisher agrees."""
    wait_idle(host.port)
    assert host.cache.shared is not None and host.cache.shared.publisher.flush(60)


def ask(port: int, messages: list, **fields: Any) -> dict:
    resp = call(port, "POST", CHAT, {"messages": messages, **ANSWER_ONLY, **fields}, timeout=120)
    assert resp.status == 200, resp.body
    return resp.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def history(host: "Host", body: dict) -> int:
    """The positions of a reply's prompt before its generation prompt (thinking off)."""
    opening = host.service.engine.tokenize_segments(xtml.generation_prompt(False))
    return body["usage"]["prompt_tokens"] - len(opening)


@pytest.fixture(scope="module")
def cold(lib_path, k3_container) -> Iterator[Any]:
    """What a server without snapshots answers (greedy): the reference every test compares to."""
    answers: dict[str, dict] = {}
    with real_service(lib_path, k3_container) as service, serving(service) as srv:
        def answer(messages: list) -> dict:
            key = repr(messages)
            if key not in answers:
                answers[key] = ask(srv.port, messages)
            return answers[key]
        yield answer


def choices(body: dict) -> list:
    return [{k: v for k, v in c.items() if k != "logprobs"} for c in body["choices"]]


class Host:
    """One server: its own local tier, maybe the team's behind it."""

    def __init__(self, cache: PrefixCache, service: Service, port: int):
        self.cache, self.service, self.port = cache, service, port


@pytest.fixture
def hosts(lib_path, k3_container, tmp_path) -> Iterator[Any]:
    with contextlib.ExitStack() as stack:
        def start(name: str, shared: bool = False, **options: Any) -> Host:
            cache = PrefixCache(256 << 20, str(tmp_path / name), identity=IDENTITY)
            stack.callback(cache.close)
            if shared:
                cache.shared = SharedTier(str(tmp_path / "shared"), 1 << 30, IDENTITY)
            service = stack.enter_context(real_service(lib_path, k3_container, prefix_cache=cache,
                                                       **options))
            srv = stack.enter_context(serving(service))
            return Host(cache, service, srv.port)
        yield start


class Trace:
    """Which calls of the lookup's costly parts (and of publishing) ran while their thread held
    the engine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[str, bool]] = []   # (what, holding the engine)
        self._holding = threading.local()
        costly = {"find": (PrefixCache, "find"), "verify": (cache_module, "open_entry"),
                  "fetch": (SharedTier, "fetch"), "crc": (lookup, "crc32"),
                  "publish": (shared_dir.SharedDir, "publish")}
        for what, (owner, name) in costly.items():
            monkeypatch.setattr(owner, name, self._traced(what, getattr(owner, name)))
        on_engine = Service._on_engine

        def traced_on_engine(service: Service, run: Any, body: Any, *args: Any, **kwargs: Any
                             ) -> Any:
            def held(found: Any) -> Any:   # on the engine's worker, the engine held
                self._holding.on = True
                try:
                    return body(found)
                finally:
                    self._holding.on = False
            return on_engine(service, run, held, *args, **kwargs)
        monkeypatch.setattr(Service, "_on_engine", traced_on_engine)

    def _traced(self, what: str, method: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((what, getattr(self._holding, "on", False)))
            return method(*args, **kwargs)
        return traced

    def on_engine(self) -> list[str]:
        return [what for what, holding in self.calls if holding]

    def off_engine(self) -> set[str]:
        return {what for what, holding in self.calls if not holding}


class Lookups:
    """Each request's lookup made before the queue (Service._look_up), as it came out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.found: list[int] = []   # positions each found (0: none)
        self.snapshots: list[Snapshot] = []   # what those that found one verified
        self.made = threading.Condition()
        look_up = Service._look_up

        def recorded(service: Service, prompt: Any, run: Any) -> Any:
            lookup = look_up(service, prompt, run)
            with self.made:
                self.found.append(lookup.found.n_tokens if lookup and lookup.found else 0)
                if lookup is not None and lookup.found is not None:
                    self.snapshots.append(lookup.found)
                self.made.notify_all()
            return lookup
        monkeypatch.setattr(Service, "_look_up", recorded)

    def wait(self, n: int) -> None:
        with self.made:
            assert self.made.wait_for(lambda: len(self.found) >= n, timeout=60)


class Idle:
    """A waiter for holding the engine from the test, as a request ahead would."""

    def queued(self, ahead: int) -> None:
        pass

    def should_stop(self) -> bool:
        return False


def in_thread(work: Any) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def waiting(service: Service, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(service.queue) < n:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.01)


# -- through the server ------------------------------------------------------------------


def test_the_engine_spends_no_time_verifying_fetching_or_publishing(
        hosts, cold, monkeypatch):
    a = hosts("a", shared=True)
    first = ask(a.port, FIRST)          # publishes the conversation's checkpoints
    published(a)
    assert a.cache.shared is not None and a.cache.shared.files.counters.published >= 1
    trace = Trace(monkeypatch)
    b = hosts("b", shared=True)         # another host: nothing local
    got = ask(b.port, LATER)
    published(b)                        # its own checkpoints, for the team
    assert choices(got) == choices(cold(LATER))
    assert cached(got) == history(a, first) > 0    # the conversation's end, fetched
    assert b.cache.shared is not None and b.cache.shared.files.counters.read == 1
    assert {"find", "fetch", "publish"} <= trace.off_engine()
    assert trace.on_engine() == []
    # Again: now a local hit, verified (CRC) while waiting, only stat()ed on the engine.
    trace.calls.clear()
    again = ask(b.port, LATER)
    assert cached(again) >= cached(got) and choices(again) == choices(got)
    assert {"find", "verify", "crc"} <= trace.off_engine() and trace.on_engine() == []
    wait_idle(b.port)
    assert b.cache.stats()["hits"] == 2 and b.cache.stats()["misses"] == 0


def test_a_request_behind_the_same_conversation_restores_the_longer_snapshot_it_stored(
        hosts, cold, monkeypatch):
    host = hosts("h")
    other = [SYSTEM, {"role": "user", "content": "What is a rip current?"}]
    ask(host.port, other)                 # leaves a snapshot of the system prompt
    lookups = Lookups(monkeypatch)
    before = host.cache.stats()
    with host.service.queue.turn(Idle()):    # the engine is busy
        first, first_out = in_thread(lambda: ask(host.port, FIRST))
        waiting(host.service, 1)
        later, later_out = in_thread(lambda: ask(host.port, LATER))
        waiting(host.service, 2)
        lookups.wait(2)
    first.join(120)
    later.join(120)
    [a], [b] = first_out, later_out
    preamble = lookups.found[1]
    assert 0 < preamble == lookups.found[0]       # both found the system prompt's, early
    # The request ahead stored its conversation's end; the one behind it restored that.
    assert cached(b) > preamble and cached(b) == history(host, a)
    assert choices(b) == choices(cold(LATER)) and choices(a) == choices(cold(FIRST))
    wait_idle(host.port)
    after = host.cache.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 0)
    assert after["restored_tokens"] - before["restored_tokens"] == cached(a) + cached(b)


@pytest.mark.parametrize("what", ["evicted", "damaged", "replaced"])
def test_an_entry_lost_while_its_request_waited_is_not_restored(what, hosts, cold, monkeypatch):
    host = hosts("h")
    ask(host.port, FIRST)
    lookups = Lookups(monkeypatch)
    before = host.cache.stats()
    with host.service.queue.turn(Idle()):
        later, out = in_thread(lambda: ask(host.port, LATER))
        lookups.wait(1)
        waiting(host.service, 1)
        [found] = lookups.snapshots           # the entry the request verified
        assert found.n_tokens > 0
        if what == "evicted":
            host.cache.drop(found)
        elif what == "damaged":
            with open(found.path, "r+b") as f:
                f.seek(100)
                f.write(b"\xff" * 64)
        else:   # the same size, a new file in its place
            data = open(found.path, "rb").read()
            os.unlink(found.path)
            with open(found.path, "wb") as f:
                f.write(bytes(b ^ 1 for b in data[:100]) + data[100:])
    later.join(120)
    [got] = out
    assert choices(got) == choices(cold(LATER))
    assert cached(got) < lookups.found[0]         # what it verified was not restored
    wait_idle(host.port)
    after = host.cache.stats()
    # Counted once, for what it restored.
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 1
    assert after["misses"] - before["misses"] == (1 if cached(got) == 0 else 0)


class SlowCopies:
    """The shared tier's copies, in small chunks the test paces: the first chunk read of a
    copy tells `copying` and waits for `go`; callers of SharedTier._alone are counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.copying, self.go = threading.Event(), threading.Event()
        self.entered = 0
        self._cond = threading.Condition()
        monkeypatch.setattr(shared_dir, "CHUNK", 4096)
        read, alone = shared_dir.Reader.read, SharedTier._alone

        def paced(reader: shared_dir.Reader, n: int) -> bytes:
            if n == 4096 and not self.copying.is_set():   # the state, not the token ids
                self.copying.set()
                assert self.go.wait(30)
            return read(reader, n)

        def counted(tier: SharedTier, name: str, stop: Any) -> bool:
            with self._cond:
                self.entered += 1
                self._cond.notify_all()
            return alone(tier, name, stop)
        monkeypatch.setattr(shared_dir.Reader, "read", paced)
        monkeypatch.setattr(SharedTier, "_alone", counted)

    def wait_entered(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.entered >= n, timeout=60)


def scratch(cache: PrefixCache) -> list[str]:
    """What this process's work directory holds besides its owner lock: unfinished writes."""
    [work] = [d for d in os.listdir(cache.root) if d.startswith("work-")]
    return sorted(set(os.listdir(os.path.join(cache.root, work))) - {"owner"})


def test_two_requests_waiting_for_the_same_shared_snapshot_copy_it_once(hosts, cold, monkeypatch):
    a = hosts("a", shared=True)
    first = ask(a.port, FIRST)
    published(a)
    b = hosts("b", shared=True)
    slow = SlowCopies(monkeypatch)
    lookups = Lookups(monkeypatch)
    with b.service.queue.turn(Idle()):
        one, one_out = in_thread(lambda: ask(b.port, LATER))
        assert slow.copying.wait(60)
        two, two_out = in_thread(lambda: ask(b.port, LATER))
        slow.wait_entered(2)          # the second waits for the first's copy
        slow.go.set()
        waiting(b.service, 2)
    one.join(120)
    two.join(120)
    [x], [y] = one_out, two_out
    # Both found the one copy early; the one served second restored what the first stored.
    assert lookups.found == [history(a, first)] * 2
    assert sorted([cached(x), cached(y)]) == [history(a, first), history(b, y)]
    assert choices(x) == choices(y) == choices(cold(LATER))
    tier = b.cache.shared
    assert tier is not None and tier.files.counters.read == 1
    assert tier.fetched_tokens == history(a, first) and scratch(b.cache) == []


def test_a_client_that_leaves_mid_fetch_leaves_nothing_behind(hosts, monkeypatch):
    a = hosts("a", shared=True)
    ask(a.port, FIRST)
    published(a)
    b = hosts("b", shared=True, finish_abandoned=False, attach=False)   # nothing kept for a return
    slow = SlowCopies(monkeypatch)
    lookups = Lookups(monkeypatch)
    body = json.dumps({"messages": LATER, "stream": True, **ANSWER_ONLY}).encode()
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert slow.copying.wait(60)
    sock.close()
    slow.go.set()
    lookups.wait(1)
    wait_idle(b.port)
    tier = b.cache.shared
    assert tier is not None and tier.files.counters.read == 0 and tier.fetched_tokens == 0
    assert lookups.found == [0] and len(b.cache) == 0 and scratch(b.cache) == []
    assert tier.files.usage()[0] >= 1      # the shared file is still there, whole, for the next
    assert not [n for n in os.listdir(tier.files.path) if n.startswith(".")]
    # The client's retry fetches it.
    assert cached(ask(b.port, LATER)) > 0 and tier.files.counters.read == 1


def test_a_stream_opens_while_its_snapshot_is_fetched(hosts, monkeypatch):
    """A copy from a slow share can outlast a client's wait for its first byte: the stream
    opens, and says why it waits, before the copy ends; then the reply comes whole."""
    a = hosts("a", shared=True)
    ask(a.port, FIRST)
    published(a)
    b = hosts("b", shared=True)
    slow = SlowCopies(monkeypatch)
    body = json.dumps({"messages": LATER, "stream": True, **ANSWER_ONLY}).encode()
    with socket.create_connection(("127.0.0.1", b.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert slow.copying.wait(60)
        raw = b""
        while b": fetching a snapshot of " not in raw:
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 200 ") and not slow.go.is_set()
        slow.go.set()
        while chunk := sock.recv(65536):
            raw += chunk
    assert b"data: [DONE]" in raw and b'"finish_reason": "length"' in raw, raw[-300:]
    tier = b.cache.shared
    assert tier is not None and tier.files.counters.read == 1


# -- the cache on its own -----------------------------------------------------------------


def state_of(tokens: list[int]) -> bytes:
    return bytes((sum(tokens) + k) % 251 for k in range(50_000))


def saver(tokens: list[int]) -> Any:
    def save(path: str) -> None:
        with open(path, "wb") as f:
            f.write(state_of(tokens))
    return save


def test_a_lookup_is_counted_when_claimed_not_when_made(tmp_path):
    cache = PrefixCache(1 << 30, str(tmp_path), identity=IDENTITY)
    try:
        prompt = list(range(200))
        cache.store(prompt[:100], saver(prompt[:100]))
        early = tiers.find(cache, SnapshotPolicy(), prompt)
        assert early.found is not None and early.found.n_tokens == 100
        assert (cache.hits, cache.misses) == (0, 0)
        assert tiers.claim(cache, SnapshotPolicy(), early).found == early.found
        assert (cache.hits, cache.misses) == (1, 0)
        # A longer one stored since is taken, verified then; a miss early can become a hit.
        cache.store(prompt[:150], saver(prompt[:150]))
        assert tiers.claim(cache, SnapshotPolicy(), early).found.n_tokens == 150
        miss = cache.find(list(range(1000, 1100)))
        cache.store(list(range(1000, 1050)), saver(list(range(1000, 1050))))
        assert cache.counted(cache.recheck(miss)).found.n_tokens == 50
        assert (cache.hits, cache.misses) == (3, 0)
        assert cache.counted(cache.recheck(cache.find([7, 8, 9]))).found is None
        assert (cache.hits, cache.misses) == (3, 1)
    finally:
        cache.close()


def test_a_copy_given_up_is_taken_over_by_the_request_waiting_for_it(tmp_path, monkeypatch):
    shared = str(tmp_path / "shared")
    a = PrefixCache(1 << 30, str(tmp_path / "a"), identity=IDENTITY)
    b = PrefixCache(1 << 30, str(tmp_path / "b"), identity=IDENTITY)
    try:
        for c in (a, b):
            c.shared = SharedTier(shared, 1 << 30, IDENTITY)
        prompt = list(range(300))
        snap = a.store(prompt[:200], saver(prompt[:200]))
        assert snap is not None and publish(a, SnapshotPolicy(), snap)
        slow = SlowCopies(monkeypatch)
        give_up = threading.Event()
        first, first_out = in_thread(lambda: tiers.find(b, SnapshotPolicy(), prompt,
                                                        stop=give_up.is_set))
        assert slow.copying.wait(30)
        second, second_out = in_thread(lambda: tiers.find(b, SnapshotPolicy(), prompt))
        slow.wait_entered(2)
        give_up.set()
        slow.go.set()
        first.join(30)
        second.join(30)
        assert first_out[0].found is None
        taken = second_out[0]
        assert taken.found is not None and taken.found.n_tokens == 200
        with open(taken.found.path, "rb") as f:
            assert f.read() == state_of(prompt[:200])
        assert b.shared is not None and b.shared.files.counters.read == 1
        assert scratch(b) == [] and len(b) == 1
    finally:
        a.close()
        b.close()


def test_a_request_refused_a_place_in_line_looks_nothing_up_first(hosts, monkeypatch):
    host = hosts("h", max_queue=0)
    ask(host.port, FIRST)
    trace = Trace(monkeypatch)
    with host.service.queue.turn(Idle()):
        resp = call(host.port, "POST", CHAT, {"messages": LATER, **ANSWER_ONLY})
    assert resp.status == 503 and "waiting for the engine" in resp.json()["error"]["message"]
    assert trace.calls == []
    got = ask(host.port, LATER)                  # with room in line, it is looked up again
    assert cached(got) > 0 and "find" in trace.off_engine() and trace.on_engine() == []
