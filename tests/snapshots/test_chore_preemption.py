"""A chore steps aside for a person and resumes where it was: on the reference engine, at a
scaled K3 clock.

The chore (a background request: `priority` 1) is preempted mid-prefill, and
mid-generation, by a person's request; the person is served, the chore resumes
from the snapshot it saved, and it answers exactly as it does alone (greedy).
The engine evaluates every position once: the same count
(`Engine.evaluated`, what serve_engine_evaluated_tokens_total reports) as the
two requests run one after the other.
"""
from __future__ import annotations

import re
import threading
import time

import pytest

from scripted import call, post_open, read_all, real_service, scrape, serving, \
    sse_data, wait_idle
from serve import PrefixCache, SnapshotPolicy

from test_abandoned_prefill import SENTENCE, Progress

CHAT = "/v1/chat/completions"
GREEDY = {"temperature": 0, "reasoning_effort": "none"}
CHORE_PREFILL = {"messages": [{"role": "user", "content": "On ships: " + SENTENCE * 16}],
                 "max_tokens": 6, "priority": 1, **GREEDY}
CHORE_DECODE = {"messages": [{"role": "user", "content": "Tell me a long story about ships."}],
                "max_tokens": 40, "priority": 1, **GREEDY}
PERSON = {"messages": [{"role": "user", "content": "Tides?"}], "max_tokens": 4, **GREEDY}


class Log(Progress):
    """Prefill progress, and the positions where chores stepped aside."""

    def __init__(self):
        super().__init__()
        self.preempted: list[int] = []

    def log(self, line: str) -> None:
        found = re.search(r"chore preempted at position (\d+)", line)
        if found:
            self.preempted.append(int(found.group(1)))
        super().log(line)


def served(lib_path, container, tmp_path, name: str, log: Log):
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path / name))
    return cache, real_service(lib_path, container, prefix_cache=cache, prefill_chunk=64,
                               snapshot_policy=SnapshotPolicy(), log=log.log, thinking=False)


def answer(resp) -> tuple[str, int, dict]:
    """(the reply's text, its prompt's positions, its waste member)."""
    assert resp.status == 200, resp.body
    body = resp.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"], body["waste"]


def stream_text(raw: bytes) -> str:
    events = [e for e in sse_data(raw) if isinstance(e, dict) and e.get("choices")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def alone(lib_path, container, tmp_path, chore: dict) -> tuple[str, str, int, int]:
    """The chore, then the person, one after the other: (chore's answer, person's answer,
    positions evaluated, the chore's prompt positions)."""
    cache, service = served(lib_path, container, tmp_path, "alone", Log())
    with service as service, serving(service) as srv:
        chore_text, prompt, waste = answer(call(srv.port, "POST", CHAT, chore, timeout=120))
        assert waste["work"] == "background"
        person_text, _, _ = answer(call(srv.port, "POST", CHAT, PERSON, timeout=120))
        wait_idle(srv.port)
        evaluated = service.engine.evaluated
    cache.close()
    return chore_text, person_text, evaluated, prompt


@pytest.fixture
def slow_clock(monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", "5")   # a 64-position step lasts about a third of a second


def test_a_chore_preempted_mid_prefill_answers_as_alone_and_nothing_is_evaluated_twice(
        slow_clock, lib_path, k3_container, tmp_path):
    chore_alone, person_alone, evaluated_alone, _ = alone(lib_path, k3_container, tmp_path,
                                                          CHORE_PREFILL)
    log = Log()
    cache, service = served(lib_path, k3_container, tmp_path, "together", log)
    with service as service, serving(service) as srv:
        chore: dict = {}
        thread = threading.Thread(target=lambda: chore.update(
            resp=call(srv.port, "POST", CHAT, CHORE_PREFILL, timeout=120)))
        thread.start()
        _, done, total = log.wait_for(0.2)
        person_text, _, person_waste = answer(call(srv.port, "POST", CHAT, PERSON, timeout=120))
        assert thread.is_alive()   # the person was answered while the chore waited
        thread.join(120)
        chore_text, _, chore_waste = answer(chore["resp"])
        wait_idle(srv.port)
        assert (chore_text, person_text) == (chore_alone, person_alone)
        assert service.engine.evaluated == evaluated_alone
        assert len(log.preempted) == 1 and done <= log.preempted[0] < total
        assert person_waste["work"] == "interactive" and chore_waste["work"] == "background"
        # It waited for one step of the chore at most (and the chore's whole prefill is 15).
        assert 0 < person_waste["behind_chores_ms"] < chore_waste["ms"]
        metrics = scrape(srv.port)
        assert metrics[("serve_preemptions_total", ())] == 1
        assert metrics[("serve_snapshots_total", (("kind", "preempted"),))] == 1
        assert metrics[("serve_engine_evaluated_tokens_total", ())] == evaluated_alone
        assert metrics[("serve_engine_seconds_total", (("class", "background"),))] > 0
        assert metrics[("serve_queue_waits_total", (("class", "background"),))] == 2
    cache.close()


def test_a_chore_preempted_mid_generation_answers_as_alone_and_nothing_is_evaluated_twice(
        monkeypatch, lib_path, k3_container, tmp_path):
    monkeypatch.setenv("WASTE_DELAY_MS", "20")   # 40 tokens: about a second of generation
    chore_alone, person_alone, evaluated_alone, prompt = alone(lib_path, k3_container, tmp_path,
                                                               CHORE_DECODE)
    log = Log()
    cache, service = served(lib_path, k3_container, tmp_path, "together", log)
    with service as service, serving(service) as srv:
        stream = post_open(srv.port, {**CHORE_DECODE, "stream": True})
        got = b""
        while not re.search(rb'"content": ?"[^"]', got):   # a generated piece: it is decoding
            data = stream.recv(65536)
            assert data, got
            got += data
        person_text, _, person_waste = answer(call(srv.port, "POST", CHAT, PERSON, timeout=120))
        chore_text = stream_text(read_all(stream, got))
        wait_idle(srv.port)
        assert (chore_text, person_text) == (chore_alone, person_alone)
        assert service.engine.evaluated == evaluated_alone
        assert len(log.preempted) == 1 and log.preempted[0] >= prompt   # after the prompt
        assert person_waste["behind_chores_ms"] > 0
        assert scrape(srv.port)[("serve_preemptions_total", ())] == 1
    cache.close()


def test_a_chore_whose_client_leaves_while_it_stepped_aside_leaves_the_person_alone(
        slow_clock, lib_path, k3_container, tmp_path):
    person = {**CHORE_PREFILL, "priority": 0, "max_tokens": 4,
              "messages": [{"role": "user", "content": "On tides: " + SENTENCE * 12}]}
    cache, service = served(lib_path, k3_container, tmp_path, "alone", Log())
    with service as service, serving(service) as srv:
        person_alone, _, _ = answer(call(srv.port, "POST", CHAT, person, timeout=120))
    cache.close()
    log = Log()
    cache, service = served(lib_path, k3_container, tmp_path, "together", log)
    with service as service, serving(service) as srv:
        chore = post_open(srv.port, {**CHORE_PREFILL, "stream": True})
        log.wait_for(0.2)
        person_reply: dict = {}
        thread = threading.Thread(target=lambda: person_reply.update(
            resp=call(srv.port, "POST", CHAT, person, timeout=120)))
        thread.start()
        deadline = time.monotonic() + 60
        while not log.preempted:
            assert time.monotonic() < deadline, "the chore did not step aside"
            time.sleep(0.01)
        chore.close()   # while the person's prompt (about 400 positions, 2 s) prefills
        thread.join(120)
        person_text, _, _ = answer(person_reply["resp"])
        health = wait_idle(srv.port)
    cache.close()
    assert person_text == person_alone
    assert health["work"]["preemptions"] == 1 and health["work"]["background"]["waits"] == 1


def test_a_streamed_chore_hears_its_place_and_keeps_its_heartbeats_while_it_waits(
        slow_clock, lib_path, k3_container, tmp_path):
    stream_body = {**CHORE_PREFILL, "stream": True}
    cache, service = served(lib_path, k3_container, tmp_path, "alone", Log())
    with service as service, serving(service) as srv:
        alone_text = stream_text(read_all(post_open(srv.port, stream_body)))
    cache.close()
    log = Log()
    cache, service = served(lib_path, k3_container, tmp_path, "together", log)
    with service as service, serving(service, heartbeat=0.3) as srv:
        chore = post_open(srv.port, stream_body)
        log.wait_for(0.2)
        person = {**PERSON, "messages": [{"role": "user", "content": "On tides: " + SENTENCE * 12}]}
        assert call(srv.port, "POST", CHAT, person, timeout=120).status == 200   # about 2 s
        raw = read_all(chore)
    cache.close()
    assert len(log.preempted) == 1
    assert stream_text(raw) == alone_text   # the whole answer
    # Stepped aside, it is told its place; while the person runs, its stream beats.
    comments = [c for c in re.findall(rb": (queue \d+|keepalive|prefill \d+/\d+)", raw)]
    # (Each heartbeat in prefill carries the progress report too, at the count it stood at:
    # the chore is back once the count moves on.)
    aside = comments.index(b"queue 1")
    done = [int(c.split()[1].split(b"/")[0]) if c.startswith(b"prefill") else -1 for c in comments]
    held = max(done[:aside])
    back = next(i for i in range(aside, len(comments)) if done[i] > held)
    assert b"keepalive" in comments[aside:back], comments


def test_a_chore_that_cannot_save_its_state_goes_on_and_the_person_waits(
        slow_clock, lib_path, k3_container, tmp_path):
    # A cache smaller than any snapshot: nothing to resume from, so the chore is not preempted.
    cache = PrefixCache(1, parent_dir=str(tmp_path / "tiny"))
    log = Log()
    with real_service(lib_path, k3_container, prefix_cache=cache, prefill_chunk=64,
                      snapshot_policy=SnapshotPolicy(), log=log.log, thinking=False) as service, \
            serving(service) as srv:
        chore: dict = {}
        thread = threading.Thread(target=lambda: chore.update(
            resp=call(srv.port, "POST", CHAT, CHORE_PREFILL, timeout=120)))
        thread.start()
        log.wait_for(0.2)
        person = call(srv.port, "POST", CHAT, PERSON, timeout=120)
        thread.join(120)
        assert person.status == chore["resp"].status == 200
        assert person.json()["waste"]["behind_chores_ms"] > 0
        assert not log.preempted and scrape(srv.port)[("serve_preemptions_total", ())] == 0
    cache.close()


def test_a_chore_stepped_aside_at_shutdown_ends_in_the_shutdown_503(
        slow_clock, lib_path, k3_container, tmp_path):
    log = Log()
    cache, service = served(lib_path, k3_container, tmp_path, "together", log)
    with service as service, serving(service) as srv:
        replies: dict = {}

        def send(name: str, body: dict) -> threading.Thread:
            thread = threading.Thread(target=lambda: replies.update(
                {name: call(srv.port, "POST", CHAT, body, timeout=120)}))
            thread.start()
            return thread
        threads = [send("chore", CHORE_PREFILL)]
        log.wait_for(0.2)
        threads.append(send("person", {**PERSON, "messages": [
            {"role": "user", "content": "On tides: " + SENTENCE * 12}]}))
        deadline = time.monotonic() + 60
        while not log.preempted:
            assert time.monotonic() < deadline, "the chore did not step aside"
            time.sleep(0.01)
        service.stop()
        for thread in threads:
            thread.join(120)
        assert service.wait_idle(30)
    cache.close()
    for name in ("chore", "person"):
        assert replies[name].status == 503, replies[name].body
        assert replies[name].json()["error"]["code"] == "server_shutting_down"
