"""Publishing to the team's tier on the publisher thread (serve/snapshots/publishing.py): the
engine's thread only queues; the line is bounded and drops nothing; a superseded progress
snapshot still waiting is never published; at shutdown the line drains within its time or
leaves no partial file."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from scripted import call
from served import serve
from serve.snapshots import tiers
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.publishing import Publisher
from serve.snapshots.shared_tier import SharedTier
from serve.snapshots.shared_dir import SharedDir

IDENTITY = '{"model": "test"}'


def saver(tokens: list[int]) -> Any:
    def save(path: str) -> None:
        with open(path, "wb") as f:
            f.write(bytes((sum(tokens) + k) % 251 for k in range(300_000)))
    return save


class Gate:
    """SharedDir.publish held at its start until `go`; `started` tells each one begun."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.started, self.go = threading.Semaphore(0), threading.Event()
        self.threads: list[str] = []
        publish = SharedDir.publish

        def gated(d: SharedDir, *args: Any, **kwargs: Any) -> bool:
            self.threads.append(threading.current_thread().name)
            self.started.release()
            assert self.go.wait(30)
            return publish(d, *args, **kwargs)
        monkeypatch.setattr(SharedDir, "publish", gated)


@pytest.fixture
def host(tmp_path):
    cache = PrefixCache(1 << 30, str(tmp_path / "local"), identity=IDENTITY)
    cache.shared = SharedTier(str(tmp_path / "shared"), 1 << 30, IDENTITY)
    yield cache
    cache.shared.publisher.drain(0)
    cache.close()


def stored(cache: PrefixCache, n: int):
    tokens = list(range(n))
    snap = cache.store(tokens, saver(tokens))
    assert snap is not None
    return snap


def names(cache: PrefixCache) -> list[str]:
    assert cache.shared is not None
    return cache.shared.files.names()


def test_the_engines_thread_only_queues_and_the_publisher_thread_publishes(host, monkeypatch):
    gate = Gate(monkeypatch)
    policy = SnapshotPolicy()
    snap = stored(host, 100)
    tiers.publish_later(host, policy, snap)       # returns at once, the publish held
    assert gate.started.acquire(timeout=30)
    assert host.shared.publisher.pending == 1 and names(host) == []
    host.drop(snap)                                # evicted locally meanwhile: still published
    gate.go.set()
    assert host.shared.publisher.flush(30)
    assert gate.threads == ["publish"] and len(names(host)) == 1
    assert policy.costs.publish_seconds is not None


def test_a_full_line_waits_for_room_and_drops_nothing(tmp_path, monkeypatch):
    cache = PrefixCache(1 << 30, str(tmp_path / "local"), identity=IDENTITY)
    cache.shared = SharedTier(str(tmp_path / "shared"), 1 << 30, IDENTITY)
    publisher = cache.shared.publisher = Publisher(cache.shared, max_waiting=1)
    gate = Gate(monkeypatch)
    policy = SnapshotPolicy()
    try:
        tiers.publish_later(cache, policy, stored(cache, 100))
        assert gate.started.acquire(timeout=30)      # the first is being published
        tiers.publish_later(cache, policy, stored(cache, 200))   # the one place in line
        third = threading.Thread(target=tiers.publish_later,
                                 args=(cache, policy, stored(cache, 300)))
        third.start()
        third.join(0.3)
        assert third.is_alive()                      # waits for room
        gate.go.set()
        third.join(30)
        assert publisher.flush(30) and len(names(cache)) == 3
    finally:
        gate.go.set()
        publisher.drain(0)
        cache.close()


def test_a_progress_snapshot_superseded_while_waiting_is_never_published(host, monkeypatch):
    gate = Gate(monkeypatch)
    policy = SnapshotPolicy()
    first = stored(host, 64)
    tiers.publish_later(host, policy, first)         # published, the next held behind it
    assert gate.started.acquire(timeout=30)
    rolling = stored(host, 128)
    tiers.publish_later(host, policy, rolling)
    latest = stored(host, 192)
    tiers.publish_later(host, policy, latest, supersedes=rolling)
    gate.go.set()
    assert host.shared.publisher.flush(30)
    assert len(gate.threads) == 2                     # the rolling one was never copied
    assert host.shared.published(list(range(192))) == 192
    assert host.shared.published(list(range(128))) == 64


def test_a_drain_publishes_what_waits_within_its_time(host, monkeypatch):
    gate = Gate(monkeypatch)
    for n in (100, 200):
        tiers.publish_later(host, SnapshotPolicy(), stored(host, n))
    assert gate.started.acquire(timeout=30)
    gate.go.set()
    assert host.shared.publisher.drain(30) and len(names(host)) == 2
    tiers.publish_later(host, SnapshotPolicy(), stored(host, 300))   # after: kept local only
    assert len(names(host)) == 2 and host.shared.publisher.pending == 0


def test_a_drain_out_of_time_leaves_no_partial_file(host, monkeypatch):
    copying = threading.Event()
    monkeypatch.setattr("serve.snapshots.shared_tier.CHUNK", 4096)
    publish = SharedDir.publish

    def slow(d: SharedDir, name: str, kind: str, extra: dict, body: Any, n: int) -> bool:
        def paced() -> Any:
            for piece in body:
                copying.set()
                time.sleep(0.05)   # a slow mount: ~75 chunks of 4 KiB
                yield piece
        return publish(d, name, kind, extra, paced(), n)
    monkeypatch.setattr(SharedDir, "publish", slow)
    tiers.publish_later(host, SnapshotPolicy(), stored(host, 100))
    tiers.publish_later(host, SnapshotPolicy(), stored(host, 200))
    assert copying.wait(30)
    assert not host.shared.publisher.drain(0.2)       # out of time mid-copy
    assert os.listdir(host.shared.files.path) == []   # nothing published, no temporary file
    assert host.shared.files.counters.publish_failed == 0
    assert len(host) == 2                             # both still in the local tier


def test_a_copy_stuck_in_one_write_does_not_hold_a_hurried_shutdown(host, monkeypatch):
    """A write on a lost mount never returns to look at the halt: drain waits for it only
    until hurry() (the second signal) says to go, and then returns."""
    gate = Gate(monkeypatch)    # the publish blocks, as a write to a lost mount would
    hurried = threading.Event()
    tiers.publish_later(host, SnapshotPolicy(), stored(host, 100))
    assert gate.started.acquire(timeout=30)
    out: list[bool] = []
    drained = threading.Thread(target=lambda: out.append(
        host.shared.publisher.drain(0, hurried.is_set)))
    drained.start()
    drained.join(0.5)
    assert drained.is_alive()                   # a first signal waits for the write
    hurried.set()
    drained.join(30)
    assert not drained.is_alive() and out == [False]
    gate.go.set()                               # the mount comes back: the thread ends
    assert host.shared.publisher.flush(30)


def test_a_server_stopped_right_after_a_reply_stops_in_time_its_snapshots_published_whole(
        lib_path, k3_container, tmp_path, monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", "2")   # prefill dear enough that publishing pays
    team = tmp_path / "team"
    chat = {"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(150))}],
            "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"}
    with serve(k3_container, lib_path, tmp_path, "--shared-cache", str(team)) as server:
        assert call(server.port, "POST", "/v1/chat/completions", chat).status == 200
        started = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 30    # the drain time (10 s) and then some
    snaps = list((team / "snapshots").glob("*/*"))
    assert snaps and all(p.suffix == ".snap" for p in snaps)   # published whole, none partial
    assert "stopped" in server.log()
