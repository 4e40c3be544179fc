"""People take turns at the engine, through real sockets on the real engine at a scaled clock:
within a class the oldest waiting request of the person served least recently goes first,
and one person's waiting requests beyond --max-waiting-per-person get a 429."""
from __future__ import annotations

import threading
import time

import pytest

from scripted import call, real_service, serving
from serve.http.auth import Keys
from serve.http.keyring import KeyRing
from team import bearer, keys_file

CHAT = "/v1/chat/completions"
DELAY_MS = "8"   # per evaluated position: each request below holds the engine for seconds


@pytest.fixture
def slow_clock(monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", DELAY_MS)   # read by waste_open


def body(label: str) -> dict:
    words = " ".join(f"{label}{i}" for i in range(250))
    return {"messages": [{"role": "user", "content": f"{label}: {words}"}], "max_tokens": 3,
            "reasoning_effort": "none"}


class Sent:
    """Requests sent one by one, each once the one before waits in line (or holds the engine),
    so that their arrival order is the order they were sent; answered in the background."""

    def __init__(self, port: int, service):
        self.port, self.service = port, service
        self.done: list[str] = []      # labels, in the order their answers came
        self.statuses: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def send(self, label: str, key: str) -> None:
        queued = len(self.service.queue) + int(self.service.queue.busy)

        def run() -> None:
            resp = call(self.port, "POST", CHAT, body(label), headers=bearer(key), timeout=600)
            with self._lock:
                self.done.append(label)
                self.statuses[label] = resp.status
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)
        deadline = time.monotonic() + 60
        while len(self.service.queue) + int(self.service.queue.busy) <= queued:
            assert time.monotonic() < deadline, f"{label} never joined the line"
            time.sleep(0.005)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(600)
            assert not thread.is_alive()


def people(tmp_path, *names: str) -> tuple[dict[str, str], Keys]:
    keys = keys_file(tmp_path / "keys", *names)
    return keys, Keys(ring=KeyRing(str(tmp_path / "keys")))


def test_a_colleague_waits_for_at_most_one_of_three_parallel_requests(
        slow_clock, lib_path, k3_container, tmp_path):
    keys, ring = people(tmp_path, "alice", "bob")
    with real_service(lib_path, k3_container) as service, serving(service, keys=ring) as srv:
        sent = Sent(srv.port, service)
        for label in ("a1", "a2", "a3"):
            sent.send(label, keys["alice"])
        sent.send("b1", keys["bob"])
        sent.join()
    assert sent.statuses == {"a1": 200, "a2": 200, "a3": 200, "b1": 200}
    # bob's request is answered after alice's first (which held the engine when he came),
    # not after all three; alice's keep their order.
    assert sent.done == ["a1", "b1", "a2", "a3"]


def test_people_go_in_turn_each_in_arrival_order(slow_clock, lib_path, k3_container, tmp_path):
    keys, ring = people(tmp_path, "alice", "bob", "carol")
    with real_service(lib_path, k3_container) as service, serving(service, keys=ring) as srv:
        sent = Sent(srv.port, service)
        for label, who in (("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob"),
                           ("b2", "bob"), ("c1", "carol")):
            sent.send(label, keys[who])
        sent.join()
    assert set(sent.statuses.values()) == {200}
    # a1 held the engine; then the one served least recently: bob and carol (never), then
    # alice, bob, alice.
    assert sent.done == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_one_person_beyond_the_bound_gets_a_429_and_others_keep_their_places(
        slow_clock, lib_path, k3_container, tmp_path):
    keys, ring = people(tmp_path, "alice", "bob")
    with real_service(lib_path, k3_container, max_waiting_per_person=1) as service, \
            serving(service, keys=ring) as srv:
        sent = Sent(srv.port, service)
        sent.send("a1", keys["alice"])   # holds the engine
        sent.send("a2", keys["alice"])   # waits: alice's one
        refused = call(srv.port, "POST", CHAT, body("a3"), headers=bearer(keys["alice"]))
        sent.send("b1", keys["bob"])     # bob's one
        sent.join()
    assert refused.status == 429, refused.body
    assert refused.headers["retry-after"].isdigit()
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error",
                                                             "rate_limit_exceeded", None)
    assert sent.statuses == {"a1": 200, "a2": 200, "b1": 200}
    assert sent.done == ["a1", "b1", "a2"]
