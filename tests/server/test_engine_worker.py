"""Every engine call after a service is built comes from the engine's one worker thread
(serve/engine/worker.py): on the reference engine at a scaled clock, through real sockets.

The engine is wrapped so that each call notes the thread that made it and the functions on
that thread's stack (which work it was part of). Each test drives one kind of work and
checks both: the work happened on the engine, and only the worker called it. Then the
worker alone: what it raises, a call from itself, a call after it stopped.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from scripted import call, post_open, read_all, read_until, serving, sse_data, wait_idle
from serve.app.warm import parse_body
from serve.core.work_classes import BACKGROUND, INTERACTIVE
from serve.core.errors import ApiError
from serve.engine.binding import Engine, EngineConfig, load_library
from serve.engine.queue import EngineQueue, shutting_down
from serve.engine.worker import EngineWorker
from serve.formats.format_choice import resolve_chat_format
from serve.service.facade import Service, ServiceOptions
from serve.service.warming import warm
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.reply_memory import ReplyMemory

from test_engine_queue import Waiter, wait_until

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = {"temperature": 0, "reasoning_effort": "none"}
SENTENCE = "The harbour master kept a ledger of every ship that passed the breakwater. "
WAIT = 120   # s: generous, for a loaded machine
# The k3 container's sampled reply to "Once" runs all its tokens at this seed (no early end).
LONG = {"prompt": "Once", "max_tokens": 1500, "temperature": 1.0, "seed": 0}


@dataclass(frozen=True)
class EngineCall:
    name: str
    thread: str
    frames: frozenset[str]   # "module.function" of each frame on the calling thread's stack


class Recording:
    """The engine, each call noted (once `start()`ed: construction is allowed any thread)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.calls: list[EngineCall] = []
        self._on = False

    def start(self) -> None:
        self._on = True

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if not callable(value):
            return value

        def noted(*args: Any, **kwargs: Any) -> Any:
            if self._on:
                self.calls.append(EngineCall(name, threading.current_thread().name, _stack()))
            return value(*args, **kwargs)
        return noted


def _stack() -> frozenset[str]:
    frames, frame = set(), sys._getframe(2)
    while frame is not None:
        frames.add(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")
        frame = frame.f_back
    return frozenset(frames)


@dataclass
class Served:
    service: Service
    engine: Recording
    port: int
    log: list[str]

    def mark(self) -> int:
        return len(self.engine.calls)

    def calls_since(self, mark: int, *, within: str) -> list[EngineCall]:
        """The calls since `mark`, after checking that some were made by `within` (a
        "module.function" on the stack) and that every one came from the worker."""
        calls = self.engine.calls[mark:]
        assert any(within in c.frames for c in calls), \
            f"no engine call within {within}: {sorted({c.name for c in calls})}"
        assert {c.thread for c in calls} == {self.service.worker.name}, \
            sorted({(c.name, c.thread) for c in calls if c.thread != self.service.worker.name})
        return calls


@contextmanager
def recorded(lib_path, container, tmp_path, model_id: str = "real",
             **options: Any) -> Iterator[Served]:
    """A service on the real engine, its prefix cache and reply memory on (settling, a chore's
    snapshots), the engine's own tokenizer (errands), served over HTTP."""
    lib = load_library(str(lib_path))
    engine = Engine(lib, container, EngineConfig())
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path))
    log: list[str] = []
    service = None
    try:
        recording = Recording(engine)
        service = Service(recording, lib, resolve_chat_format(engine, container), ServiceOptions(  # type: ignore[arg-type]
            model_id=model_id, prefix_cache=cache, snapshot_policy=SnapshotPolicy(), prefill_chunk=64,
            reply_memory=ReplyMemory(), thinking=False, tokenizer=None, log=log.append, **options))
        recording.start()
        with serving(service) as srv:
            yield Served(service, recording, srv.port, log)
    finally:
        if service is not None:
            service.close()
        engine.close()
        cache.close()


@pytest.fixture(scope="module")
def served(lib_path, k3_container, tmp_path_factory) -> Iterator[Served]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", "10")   # read by waste_open: 100 tokens a second at most
        with recorded(lib_path, k3_container, tmp_path_factory.mktemp("worker")) as s:
            yield s


def chat(content: str, **fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}], **GREEDY, **fields}


def streamed_text(raw: bytes) -> str:
    events = [e for e in sse_data(raw) if isinstance(e, dict) and e.get("choices")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def answered(resp) -> dict:
    assert resp.status == 200, resp.body
    return resp.json()


def decoding(port: int, body: dict, path: str = CHAT):
    """A streamed request, read until its first generated piece: (socket, bytes so far)."""
    stream = post_open(port, {**body, "stream": True}, path)
    got = b""
    while not re.search(rb'"(content|text)": ?"[^"]', got):
        data = stream.recv(65536)
        assert data, got
        got += data
    return stream, got


def wait_for_line(log: list[str], pattern: str, since: int = 0) -> None:
    deadline = time.monotonic() + WAIT
    while not any(re.search(pattern, line) for line in log[since:]):
        assert time.monotonic() < deadline, f"no {pattern!r} in {log[since:][-5:]}"
        time.sleep(0.01)


# -- each kind of work, on the real engine --------------------------------------------------

def test_a_streamed_chat_and_its_blocking_twin_run_on_the_worker_and_agree(served):
    mark = served.mark()
    body = chat("Tell me about tides.", max_tokens=12)
    text = streamed_text(read_all(post_open(served.port, {**body, "stream": True})))
    blocking = answered(call(served.port, "POST", CHAT, body, timeout=WAIT))
    wait_idle(served.port)
    assert text and blocking["choices"][0]["message"]["content"] == text
    served.calls_since(mark, within="generation.produce")


def test_a_blocking_completion_runs_on_the_worker(served):
    mark = served.mark()
    reply = answered(call(served.port, "POST", COMPLETIONS,
                          {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
                          timeout=WAIT))
    wait_idle(served.port)
    assert reply["choices"][0]["text"] and 0 < reply["usage"]["completion_tokens"] <= 8
    served.calls_since(mark, within="generation.produce")


def test_settling_after_a_reply_runs_on_the_worker(served):
    mark = served.mark()
    # Cut by max_tokens: the next turn's history holds closing markup the model never wrote,
    # so the state that holds it is built in idle time.
    answered(call(served.port, "POST", CHAT, chat("Name a port.", max_tokens=3), timeout=WAIT))
    wait_idle(served.port)
    calls = served.calls_since(mark, within="settle._build")
    assert any(c.name in ("eval", "load_state") for c in calls if "settle._build" in c.frames)


def test_warming_runs_on_the_worker(served):
    mark = served.mark()
    progress: list[tuple[int, int]] = []
    request = parse_body(chat("On lighthouses: " + SENTENCE * 4))
    held, before = warm(served.service, request, lambda done, total: progress.append((done, total)),
                        lambda: False)
    assert 0 <= before < held and progress[-1][0] == held
    served.calls_since(mark, within="warming.prefill")


def test_a_tokenizing_errand_while_a_reply_holds_the_engine_runs_on_the_worker(served):
    stream, got = decoding(served.port, LONG, COMPLETIONS)
    mark = served.mark()
    try:
        counted = answered(call(served.port, "POST", "/v1/messages/count_tokens",
                                {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
                                timeout=WAIT))
        assert counted["input_tokens"] > 0
        assert stream.recv(65536), "the reply stopped"   # it goes on meanwhile
    finally:
        stream.close()
    wait_idle(served.port)
    calls = served.calls_since(mark, within="queue.run_errands")
    assert any(c.name == "tokenize" and "queue.run_errands" in c.frames for c in calls)


def test_a_chore_preempted_by_a_person_steps_aside_on_the_worker_and_both_answer_as_alone(served):
    chore = chat("Tell me a long story about ships.", max_tokens=60, priority=1)
    person = chat("Tides?", max_tokens=4)
    chore_alone = answered(call(served.port, "POST", CHAT, chore, timeout=WAIT))
    person_alone = answered(call(served.port, "POST", CHAT, person, timeout=WAIT))
    wait_idle(served.port)
    mark, lines = served.mark(), len(served.log)
    stream, got = decoding(served.port, chore)
    person_reply = answered(call(served.port, "POST", CHAT, person, timeout=WAIT))
    chore_text = streamed_text(read_all(stream, got))
    wait_idle(served.port)
    wait_for_line(served.log, r"chore preempted at position \d+", lines)
    assert chore_text == chore_alone["choices"][0]["message"]["content"]
    assert person_reply["choices"][0]["message"] == person_alone["choices"][0]["message"]
    calls = served.calls_since(mark, within="preempt.step_aside")
    # The person's reply ran on the worker nested inside the chore's step aside.
    assert any("worker.away" in c.frames and c.name in ("eval", "generate") for c in calls)


def test_a_detached_job_goes_idle_then_steps_aside_for_a_request_on_the_worker(served):
    mark, lines = served.mark(), len(served.log)
    # Not the errand test's body: an identical request would attach to that job, now ended.
    stream, got = decoding(served.port, {**LONG, "max_tokens": 1400}, COMPLETIONS)   # 14 s
    job = re.search(rb"X-Serve-Job: (\S+)", got, re.IGNORECASE)
    assert job, got
    stream.close()
    wait_for_line(served.log, r"client left: its work goes on", lines)
    other = answered(call(served.port, "POST", CHAT, chat("Tides?", max_tokens=4), timeout=WAIT))
    assert other["choices"][0]["message"]["content"]
    wait_idle(served.port)
    served.calls_since(mark, within="generation.produce")
    left = answered(call(served.port, "GET", f"/v1/jobs/{job.group(1).decode()}"))
    # It stepped aside at its next engine call: far short of its 1,400 tokens.
    assert left["status"] == "incomplete" and left["output"]["deltas"] < 1000, left


def test_at_shutdown_the_running_work_ends_and_the_worker_stops(lib_path, k3_container, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", "10")
    with recorded(lib_path, k3_container, tmp_path, "stopping") as s:
        mark = s.mark()
        stream, got = decoding(s.port, LONG, COMPLETIONS)
        s.service.stop()
        raw = read_all(stream, got)
        assert s.service.wait_idle(WAIT)
        s.service.close()
        assert s.service.worker.name == "engine-stopping"
        assert not any(t.name == s.service.worker.name for t in threading.enumerate())
        with pytest.raises(ApiError) as refused:
            s.service.worker.call(lambda: None)
        assert (refused.value.status, refused.value.code) == (503, "server_shutting_down")
        assert raw.count(b"data: {") < 1000   # cut at its next token, not run to its end
        s.calls_since(mark, within="generation.produce")


# -- the worker alone ------------------------------------------------------------------------

class Halt(BaseException):
    """Not an Exception: the worker must hand it back all the same."""


def test_the_worker_raises_in_the_caller_what_the_work_raised_and_lives_on():
    worker = EngineWorker("engine-unit", shutting_down)
    try:
        for error in (ValueError("bad"), Halt()):
            def fail(error: BaseException = error) -> None:
                raise error
            with pytest.raises(type(error)):
                worker.call(fail)
        assert worker.call(lambda: threading.current_thread().name) == "engine-unit"
    finally:
        worker.stop(WAIT)


def test_a_call_from_the_worker_runs_at_once_and_a_call_after_stop_is_the_shutdown_503():
    worker = EngineWorker("engine-unit", shutting_down)
    assert worker.call(lambda: worker.call(lambda: threading.current_thread().name)) \
        == "engine-unit"
    worker.stop(WAIT)
    with pytest.raises(ApiError) as refused:
        worker.call(lambda: 1)
    assert refused.value.status == 503 and refused.value.code == "server_shutting_down"


def test_away_runs_on_the_thread_that_asked_while_the_worker_runs_another_callers_work():
    worker = EngineWorker("engine-unit", shutting_down)
    handed, done = threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def other() -> None:   # handed to the worker while the first caller's work waits away
        handed.wait(WAIT)
        seen["other"] = worker.call(lambda: threading.current_thread().name)
        done.set()

    def meanwhile() -> str:
        handed.set()
        assert done.wait(WAIT), "the worker did not run the other work meanwhile"
        return threading.current_thread().name

    def chore() -> tuple[str, str]:
        away = worker.away(meanwhile)
        return away, threading.current_thread().name

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert worker.call(chore) == (threading.current_thread().name, "engine-unit")
        assert seen["other"] == "engine-unit"
    finally:
        thread.join(WAIT)
        worker.stop(WAIT)


def test_two_chores_stepped_aside_on_the_worker_get_the_engine_back_innermost_first():
    """Chore A steps aside for person 1; chore B (its person never served yet) goes before A
    and steps aside for person 2, nested on the worker above A. After person 2, A's person
    was served less recently than B's, but A's frames lie under B's on the one thread: B must
    have the engine back first, or the worker would wait for B while the line waits for A."""
    queue, worker = EngineQueue(8), EngineWorker("engine-unit", shutting_down)
    ran: list[tuple[str, str]] = []   # (what ran, on which thread)
    people = {name: threading.Event() for name in ("person 1", "person 2")}
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def request(name: str, work: str, owner: str) -> None:
        def chore(turn) -> None:
            ran.append((name, threading.current_thread().name))
            wait_until(turn.preempt_due, f"{name}: no person waits")
            worker.away(lambda: turn.step_aside(Waiter()))
            ran.append((f"{name} resumed", threading.current_thread().name))

        def person() -> None:
            ran.append((name, threading.current_thread().name))
            people[name].wait(WAIT)

        def run() -> None:
            try:
                with queue.turn(Waiter(), work, owner=owner) as turn:
                    worker.call(lambda: chore(turn) if work == BACKGROUND else person())
            except BaseException as e:  # noqa: BLE001 - the test's thread reports it
                errors.append(e)
        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
        wait_until(lambda: any(what == name for what, _ in ran) or len(queue) > 0,
                   f"{name} neither ran nor waits")

    try:
        request("chore A", BACKGROUND, "a")
        wait_until(lambda: len(ran) == 1, "chore A did not start")
        request("person 1", INTERACTIVE, "p")
        wait_until(lambda: len(ran) == 2, "person 1 did not run while chore A stepped aside")
        request("chore B", BACKGROUND, "b")
        wait_until(lambda: len(queue) == 2, "chore B is not in line behind person 1")
        people["person 1"].set()
        wait_until(lambda: len(ran) == 3, "chore B did not start")
        request("person 2", INTERACTIVE, "p")
        wait_until(lambda: len(ran) == 4, "person 2 did not run while chore B stepped aside")
        people["person 2"].set()
        for thread in threads:
            thread.join(WAIT)
        assert not any(t.is_alive() for t in threads), f"stuck after {ran}"
        assert not errors
        assert [what for what, _ in ran] == ["chore A", "person 1", "chore B", "person 2",
                                             "chore B resumed", "chore A resumed"]
        assert {thread for _, thread in ran} == {"engine-unit"}
        assert queue.preemptions == 2
    finally:
        for event in people.values():
            event.set()
        queue.close()
        worker.stop(WAIT)
