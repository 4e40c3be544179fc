"""Errands (serve/engine/queue.py): a short engine call for a thread that does not hold the
engine runs at once when it is free, else between the holder's engine calls, and never
while anything else uses the engine."""
from __future__ import annotations

import threading

import pytest

from serve.core.errors import ApiError
from serve.engine.queue import EngineQueue

WAIT = 30   # seconds: generous, for a busy machine


class Quiet:
    def queued(self, ahead: int) -> None: ...

    def should_stop(self) -> bool:
        return False


def in_thread(work) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    return thread, out


def test_an_errand_runs_at_once_when_the_engine_is_free():
    queue = EngineQueue(4)
    assert queue.errand(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        queue.errand(lambda: 1 / 0)
    assert queue.wait_idle(0)


def test_an_errand_waits_for_the_holders_next_call_between_engine_calls():
    queue = EngineQueue(4)
    holder = threading.current_thread()
    ran_by: list = []
    with queue.turn(Quiet()):
        thread, out = in_thread(lambda: queue.errand(lambda: ran_by.append(threading.current_thread()) or 7))
        thread.join(0.3)
        assert thread.is_alive() and not ran_by   # the holder is "in an engine call"
        deadline = threading.Event()
        while not ran_by and not deadline.wait(0.01):
            queue.run_errands()                    # between its chunks
        thread.join(WAIT)
    assert out == [7] and ran_by == [holder]


def test_a_request_waits_while_an_errand_has_the_engine():
    queue = EngineQueue(4)
    inside, release = threading.Event(), threading.Event()
    errand, _ = in_thread(lambda: queue.errand(lambda: inside.set() or release.wait(WAIT)))
    assert inside.wait(WAIT)
    got: list = []

    def request() -> None:
        with queue.turn(Quiet()):
            got.append("engine")
    thread = threading.Thread(target=request)
    thread.start()
    thread.join(0.3)
    assert not got
    release.set()
    errand.join(WAIT)
    thread.join(WAIT)
    assert got == ["engine"]


def test_a_waiting_errand_gets_the_shutdown_503():
    queue = EngineQueue(4)
    with queue.turn(Quiet()):
        failed: list = []

        def errand() -> None:
            try:
                queue.errand(lambda: 1)
            except ApiError as e:
                failed.append(e.status)
        thread = threading.Thread(target=errand)
        thread.start()
        thread.join(0.2)
        queue.close()
        thread.join(WAIT)
    assert failed == [503]
