"""serve/engine/queue.py on its own: the line for the engine, and idle turns that yield to it."""
from __future__ import annotations

import threading
import time

import pytest

from serve.core.errors import ApiError
from serve.engine.queue import ClientLeft, EngineQueue

WAIT = 30   # seconds: generous, for a busy machine; nothing here should take more than a moment


class Waiter:
    """A request's sink as the queue sees it: told its place, and maybe gone."""

    def __init__(self) -> None:
        self.told: list[int] = []
        self.left = threading.Event()

    def queued(self, ahead: int) -> None:
        self.told.append(ahead)

    def should_stop(self) -> bool:
        return self.left.is_set()


def hold(queue: EngineQueue, waiter: Waiter, inside: threading.Event, release: threading.Event,
         order: list, name: str, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            with queue.turn(waiter):
                order.append(name)
                inside.set()
                release.wait(WAIT)
        except (ApiError, ClientLeft) as e:
            errors.append((name, e))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class Line:
    """Requests on one queue, held until `release` is set, recording who got the engine."""

    def __init__(self, max_waiting: int):
        self.queue = EngineQueue(max_waiting)
        self.order: list[str] = []
        self.errors: list = []
        self.release = threading.Event()

    def running(self) -> threading.Thread:
        """A request that holds the engine by the time this returns."""
        inside = threading.Event()
        thread = hold(self.queue, Waiter(), inside, self.release, self.order, "running", self.errors)
        assert inside.wait(WAIT)
        return thread

    def waiting(self, name: str, waiter: Waiter) -> threading.Thread:
        """A request that waits in line by the time this returns."""
        before = len(self.queue)
        thread = hold(self.queue, waiter, threading.Event(), self.release, self.order, name, self.errors)
        wait_until(lambda: len(self.queue) == before + 1, f"{name} did not join the line")
        return thread


def test_requests_get_the_engine_in_arrival_order_and_hear_their_place():
    queue, order, errors = EngineQueue(8), [], []
    release = threading.Event()
    first_in = threading.Event()
    first = hold(queue, Waiter(), first_in, release, order, "first", errors)
    assert first_in.wait(WAIT) and queue.busy and len(queue) == 0
    waiters = [Waiter() for _ in range(3)]
    threads = []
    for n, waiter in enumerate(waiters):
        threads.append(hold(queue, waiter, threading.Event(), release, order, f"w{n}", errors))
        wait_until(lambda: len(queue) == n + 1, "the request did not join the line")
    release.set()
    for thread in [first, *threads]:
        thread.join(WAIT)
    assert order == ["first", "w0", "w1", "w2"] and not errors
    # Each heard how many were ahead (the running one included), counting down.
    assert [w.told[0] for w in waiters] == [1, 2, 3]
    assert all(w.told == sorted(w.told, reverse=True) for w in waiters)
    assert not queue.busy and len(queue) == 0


def test_a_full_line_refuses_at_once_with_retry_after():
    line = Line(1)
    running, waiting = line.running(), line.waiting("waiting", Waiter())
    with pytest.raises(ApiError) as refused:
        with line.queue.turn(Waiter()):
            pass
    assert refused.value.status == 503 and refused.value.code == "server_overloaded"
    assert refused.value.headers["Retry-After"]
    line.release.set()
    running.join(WAIT)
    waiting.join(WAIT)
    assert line.order == ["running", "waiting"]


def test_a_waiter_whose_client_left_gives_up_its_place():
    line, leaving = Line(4), Waiter()
    running, gone = line.running(), line.waiting("gone", leaving)
    leaving.left.set()
    gone.join(WAIT)
    assert line.errors and line.errors[0][0] == "gone" and isinstance(line.errors[0][1], ClientLeft)
    assert len(line.queue) == 0
    line.release.set()
    running.join(WAIT)


def test_closing_refuses_the_waiting_and_the_later_and_waits_for_the_running():
    line = Line(4)
    running, waiting = line.running(), line.waiting("waiting", Waiter())
    line.queue.close()
    waiting.join(WAIT)
    assert [(name, e.code) for name, e in line.errors] == [("waiting", "server_shutting_down")]
    with pytest.raises(ApiError):
        with line.queue.turn(Waiter()):
            pass
    assert not line.queue.wait_idle(0.05)   # the running request still holds the engine
    line.release.set()
    running.join(WAIT)
    assert line.queue.wait_idle(WAIT)


def test_an_idle_turn_is_granted_only_when_nothing_holds_or_waits():
    queue = EngineQueue(4)
    with queue.idle_turn() as yield_now:
        assert yield_now is not None and not yield_now()
        assert not queue.busy   # idle-time work is not a request
    queue.close()
    with queue.idle_turn() as yield_now:
        assert yield_now is None


def test_an_idle_turn_never_runs_while_a_request_holds_or_waits():
    line = Line(4)
    running = line.running()
    granted: list = []

    def idle_work() -> None:
        with line.queue.idle_turn() as yield_now:
            granted.append(yield_now is not None)
            if yield_now is not None:
                line.order.append("idle")

    idle = threading.Thread(target=idle_work)
    idle.start()
    idle.join(0.2)
    assert idle.is_alive()   # it waits for the request to let go
    waiting = line.waiting("waiting", Waiter())
    line.release.set()
    for thread in (running, idle, waiting):
        thread.join(WAIT)
    # Either the engine came free with a request waiting (the idle work is dropped), or the
    # waiting request took it first and the idle work ran once it was over; never beside it.
    assert line.order == (["running", "waiting", "idle"] if granted == [True] else ["running", "waiting"])


def test_idle_work_is_told_to_yield_and_the_request_waits_for_its_chunk():
    queue, order, errors = EngineQueue(4), [], []
    chunks, asked, chunk_over = [], threading.Event(), threading.Event()

    def idle_work() -> None:
        with queue.idle_turn() as yield_now:
            asked.set()
            while not yield_now():   # one chunk at a time, until a request waits
                chunks.append(len(chunks))
                chunk_over.wait(WAIT)   # a chunk that lasts until the test has looked
            order.append("idle done")

    worker = threading.Thread(target=idle_work)
    worker.start()
    assert asked.wait(WAIT)
    wait_until(lambda: chunks, "the idle work never ran a chunk")
    waiter, no_wait = Waiter(), threading.Event()
    no_wait.set()   # the request lets go at once
    request = hold(queue, waiter, threading.Event(), no_wait, order, "request", errors)
    # Told 0 ahead while the chunk runs: its stream opens and beats (a chunk lasts minutes on K3).
    wait_until(lambda: waiter.told == [0], f"the waiting request was told {waiter.told}")
    chunk_over.set()
    worker.join(WAIT)
    request.join(WAIT)
    assert order[:2] == ["idle done", "request"] and not errors
    assert waiter.told == [0] and chunks == [0]


def test_a_second_idle_turn_that_gives_up_leaves_the_first_holding():
    line = Line(4)
    line.release.set()   # requests let go at once
    with line.queue.idle_turn() as first:
        second: list = []

        def second_idle_work() -> None:
            with line.queue.idle_turn() as yield_now:
                second.append(yield_now is not None)

        waiting_idle = threading.Thread(target=second_idle_work)
        waiting_idle.start()
        waiting_idle.join(0.2)
        assert waiting_idle.is_alive()   # one idle turn at a time
        request = line.waiting("request", Waiter())
        waiting_idle.join(WAIT)
        assert second == [False] and first()   # dropped for the request; the first told to yield
        request.join(0.2)
        assert line.order == []   # the first still holds the engine until it lets go
    request.join(WAIT)
    assert line.order == ["request"]


def test_a_request_whose_client_left_holds_on_as_idle_work_that_yields():
    queue, order, errors = EngineQueue(4), [], []
    demoted, done = threading.Event(), threading.Event()
    chunks: list[int] = []

    def abandoned() -> None:
        with queue.turn(Waiter()) as held:
            held.to_idle()          # its client left: the prefill goes on for nobody
            demoted.set()
            while not held.requested():
                chunks.append(len(chunks))
                time.sleep(0.002)
            order.append("abandoned stops")
        done.set()

    worker = threading.Thread(target=abandoned)
    worker.start()
    assert demoted.wait(WAIT)
    assert not queue.busy and queue.idle_work   # no request holds the engine, idle work does
    wait_until(lambda: chunks, "the abandoned work never ran a chunk")
    waiter, no_wait = Waiter(), threading.Event()
    no_wait.set()
    request = hold(queue, waiter, threading.Event(), no_wait, order, "request", errors)
    for thread in (worker, request):
        thread.join(WAIT)
    assert order == ["abandoned stops", "request"] and not errors and done.is_set()
    # Told once, "0 ahead": the abandoned work held the engine for its chunk (a stream beats).
    assert waiter.told == [0] and not queue.idle_work and not queue.busy


def test_patient_idle_work_waits_for_the_line_to_empty_instead_of_giving_up():
    line = Line(4)
    running = line.running()
    waiting = line.waiting("waiting", Waiter())
    got: list = []

    def warm() -> None:
        with line.queue.idle_turn(patient=True) as yield_now:
            got.append(yield_now is not None)
            line.order.append("warm")

    worker = threading.Thread(target=warm)
    worker.start()
    worker.join(0.2)
    assert worker.is_alive()
    line.release.set()
    for thread in (running, waiting, worker):
        thread.join(WAIT)
    assert got == [True] and line.order == ["running", "waiting", "warm"]
    line.queue.close()
    with line.queue.idle_turn(patient=True) as yield_now:
        assert yield_now is None   # shutdown: no more idle work


def meanwhile_turn(queue: EngineQueue, name: str, waiter: Waiter, order: list,
                   busy: threading.Event, done: threading.Event,
                   release: threading.Event) -> threading.Thread:
    """A request that, once in line, does work of its own (finding its snapshot) until `done`."""
    def meanwhile() -> None:
        busy.set()
        assert done.wait(WAIT)

    def run() -> None:
        with queue.turn(waiter, meanwhile=meanwhile):
            order.append(name)
            release.wait(WAIT)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_request_busy_in_line_keeps_its_place():
    # A is in line before B, working on its own; the engine comes free: B, which came later,
    # does not take A's turn (on K3 it would hold the engine for hours), A is served first.
    queue, order = EngineQueue(8), []
    first_release, release = threading.Event(), threading.Event()
    first_in = threading.Event()
    first = hold(queue, Waiter(), first_in, first_release, order, "running", [])
    assert first_in.wait(WAIT)
    busy, done = threading.Event(), threading.Event()
    a_waiter = Waiter()
    a = meanwhile_turn(queue, "a", a_waiter, order, busy, done, release)
    assert busy.wait(WAIT)
    b = hold(queue, Waiter(), threading.Event(), release, order, "b", [])
    wait_until(lambda: len(queue) == 2, "b did not join the line")
    first_release.set()
    time.sleep(0.3)   # the engine is free: a wrong line would hand it to b now
    assert order == ["running"] and a_waiter.told == []
    done.set()
    wait_until(lambda: order == ["running", "a"], "a was not served at its place")
    release.set()
    for thread in (first, a, b):
        thread.join(WAIT)
    assert order == ["running", "a", "b"]


def test_work_that_fails_in_line_leaves_the_line():
    queue = EngineQueue(8)

    def meanwhile() -> None:
        raise OSError("the share went away")

    with pytest.raises(OSError):
        with queue.turn(Waiter(), meanwhile=meanwhile):
            pass
    assert len(queue) == 0 and not queue.busy
    with queue.turn(Waiter()):   # the engine is free for the next
        assert queue.busy
