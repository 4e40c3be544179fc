"""The one thread that calls an engine: every piece of work on it is handed to this thread.

Why one thread: a `waste_ctx` is not thread-safe (docs/engine.md), and the
engine queue (serve/engine/queue.py) only says *who* may use the engine next;
with one thread owning the context the engine's calls need no lock, and the
state they leave (an image queue, a half-evaluated prompt, a sampler's
position) is only ever seen by the code that made it. It is the shape of
llama.cpp's server: one loop owns the model, and work goes in through a queue.

The queue's logic is unchanged by it but for one rule (below). A request
still waits in line on its own thread (that waiting touches its client:
`queued(ahead)` notices, `should_stop()` probes), and once the line gives it
the engine it hands the *body* that calls the engine to `call(fn)`, and blocks
until the worker has run it: the result comes back, or the exception (BaseException included) is raised again in the
caller. From the worker itself, `call(fn)` runs `fn` at once.

A chore steps aside for a person in the middle of its body, deep in the
worker's stack (serve/service/preempt.py). So stepping aside is `away(fn)`:
`fn` (waiting in line for the engine again) runs on the thread that handed the
worker the chore, and meanwhile the worker keeps running the bodies handed to
it by whoever holds the engine now, nested above the chore's frames; it
returns to the chore once `fn` has returned. Nested bodies end in the reverse
order they began, so the line never gives the engine back to a chore that has
another stepped aside above it on this stack (EngineQueue's `_aside`).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class Call(Generic[T]):
    """One piece of work for another thread, and how it ended."""

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.done = False
        self.result: Optional[T] = None
        self.error: Optional[BaseException] = None
        self.away: Optional[Call] = None   # what the worker asks the caller to run meanwhile

    def do(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the thread that asked
            self.error = e

    def outcome(self) -> T:
        error, self.error = self.error, None   # the caller's frames must not stay in a cycle
        if error is not None:
            raise error
        return self.result  # type: ignore[return-value]


class EngineWorker:
    """One engine's thread. `call` hands it work; `stop` ends it once the work handed is done."""

    def __init__(self, name: str, stopped: Callable[[], BaseException]):
        """`stopped()`: what a call after stop raises (the queue's shutdown 503)."""
        self._stopped_error = stopped
        self._cond = threading.Condition()
        self._tasks: deque[Call] = deque()
        self._stack: list[Call] = []   # the tasks the worker is inside of, innermost last
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, args=(self._idle_until_stop,),
                                        name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker and return what it returns (or raise what it raises). The
        caller must hold the engine (its turn in the line), or be the worker. Raises
        `stopped()` once the worker is stopped."""
        if self.on_worker():
            return fn()
        task: Call[T] = Call(fn)
        with self._cond:
            if self._stopped:
                raise self._stopped_error()
            self._tasks.append(task)
            self._cond.notify_all()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: task.done or task.away is not None)
                if task.done:
                    return task.outcome()
                away = task.away
            assert away is not None   # what it was woken for
            away.do()   # outside the lock: the worker serves others meanwhile
            with self._cond:
                task.away, away.done = None, True
                self._cond.notify_all()

    def away(self, fn: Callable[[], T]) -> T:
        """Called on the worker inside a task: run `fn` on the thread that handed the task,
        running the tasks handed meanwhile, and return once `fn` has. Elsewhere: `fn()`."""
        if not (self.on_worker() and self._stack):
            return fn()
        waiting: Call[T] = Call(fn)
        with self._cond:
            self._stack[-1].away = waiting
            self._cond.notify_all()
        self._serve(lambda: waiting.done)
        return waiting.outcome()

    def _idle_until_stop(self) -> bool:
        return self._stopped and not self._tasks

    def _serve(self, until: Callable[[], bool]) -> None:
        """Run the tasks handed, in order, until `until()` (asked under the lock)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: until() or bool(self._tasks))
                if until():
                    return
                task = self._tasks.popleft()
            self._stack.append(task)
            try:
                task.do()
            finally:
                self._stack.pop()
                with self._cond:
                    task.done = True
                    self._cond.notify_all()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Take no more work; return once the work handed before is done (or `timeout`)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if not self.on_worker():
            self._thread.join(timeout)
