"""The line for the engine: first come, first served, bounded, and closable at shutdown.

The engine runs one thing at a time, and this is the only way to it. A plain
lock hands it to whichever waiting thread the scheduler wakes first, so under
load a request could wait without bound; here each request takes a ticket and
the engine goes to the oldest one. The line has a fixed length: beyond it a
request is refused at once (503 with Retry-After) instead of waiting for hours
behind a slow model.

Work that only spares later requests time (settling a reply's snapshot,
--warm) takes an idle turn instead: it gets the engine only when nobody holds
it or waits for it, and it is told to yield as soon as a request arrives, which
it does at its next chunk. A request whose client left mid-prefill becomes such
work where it stands (Turn.to_idle): its prefill goes on for the client's retry
while nobody waits, and yields like any idle-time work.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol

from serve.core.errors import ApiError

RETRY_AFTER_SECONDS = 5
POLL_SECONDS = 0.25  # how often a waiting request asks whether its client is still there


class Waiter(Protocol):
    def queued(self, ahead: int) -> None: ...

    def gone(self) -> bool: ...


class ClientGone(Exception):
    """The client went away while its request waited in line."""


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, code="server_overloaded", kind="server_error",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_shutting_down",
                    kind="server_error")


class Turn:
    """A request's hold on the engine, as its holder may change it."""

    def __init__(self, queue: "EngineQueue"):
        self._queue = queue
        self.idle = False    # the request's client left: its work now runs as idle-time work

    def to_idle(self) -> None:
        """Nobody waits on this work any more: it no longer counts as a request holding the
        engine, and it yields as soon as a request waits (requested())."""
        q = self._queue
        with q._cond:
            if not self.idle:
                self.idle, q._busy, q._idle = True, False, True
                q._cond.notify_all()

    def requested(self) -> bool:
        """A request waits for the engine, or the line is closed."""
        return self._queue._requested()


class EngineQueue:
    def __init__(self, max_waiting: int):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._line: deque[object] = deque()
        self._busy = False    # a request holds the engine
        self._idle = False    # idle-time work holds it
        self._closed = False

    def __len__(self) -> int:
        """Requests waiting (not counting the one that holds the engine)."""
        return len(self._line)

    @property
    def busy(self) -> bool:
        """A request holds the engine."""
        return self._busy

    @property
    def idle_work(self) -> bool:
        """Idle-time work holds the engine (settling, warming, a prefill whose client left)."""
        return self._idle

    @contextmanager
    def turn(self, waiter: Waiter) -> Iterator[Turn]:
        """Waits for the engine in arrival order and holds it for the block.

        While waiting, `waiter.queued(ahead)` hears the number of requests in
        front (the running one included; 0 behind idle-time work) each time it changes. Raises the 503s
        of a full line or of shutdown, or ClientGone.
        """
        ticket = object()
        with self._cond:
            if self._closed:
                raise shutting_down()
            if (self._busy or self._line) and len(self._line) >= self.max_waiting:
                raise overloaded(f"{len(self._line)} requests are already waiting for the engine; "
                                 "try again later")
            self._line.append(ticket)
            self._cond.notify_all()   # idle-time work waiting for the engine gives up its turn
        try:
            self._wait(ticket, waiter)
        except BaseException:
            with self._cond:
                if ticket in self._line:
                    self._line.remove(ticket)
                    self._cond.notify_all()  # those behind it moved up
            raise
        held = Turn(self)
        try:
            yield held
        finally:
            with self._cond:
                if held.idle:
                    self._idle = False
                else:
                    self._busy = False
                self._cond.notify_all()

    def _wait(self, ticket: object, waiter: Waiter) -> None:
        # Told even "0 ahead": idle-time work that holds the engine may run a chunk for
        # minutes on a slow model, and a stream waiting behind it must open and beat.
        told = -1
        while True:
            with self._cond:
                ahead = self._take(ticket)
                if ahead is not None and ahead == told:   # nothing new to tell: wait for a change
                    self._cond.wait(POLL_SECONDS)
                    ahead = self._take(ticket)
                if ahead is None:
                    return
            # Outside the lock: both may touch the client's socket.
            if waiter.gone():
                raise ClientGone()
            if ahead != told:
                waiter.queued(ahead)
                told = ahead

    def _take(self, ticket: object) -> Optional[int]:
        """None once `ticket` holds the engine, else the requests in front of it (the running
        one included; 0 while idle-time work finishes its chunk). Under _cond."""
        if self._closed:
            raise shutting_down()
        if not (self._busy or self._idle) and self._line[0] is ticket:
            self._line.popleft()
            self._busy = True
            return None
        return self._line.index(ticket) + int(self._busy)  # O(line), and the line is bounded

    @contextmanager
    def idle_turn(self, patient: bool = False) -> Iterator[Optional[Callable[[], bool]]]:
        """Holds the engine for idle-time work, which must never delay a request.

        Waits for whatever holds the engine to let go. Yields `yield_now()`, true
        as soon as a request waits or the line closes: the work then stops at its
        next chunk and lets go. Yields None instead, holding nothing, when the
        line is closed, or (unless `patient`) when a request is waiting: the work
        is then not done. Patient work waits for the line to empty instead.
        """
        def free() -> bool:
            return not (self._busy or self._idle or (patient and self._line))

        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._line and not patient) or free())
            granted = not (self._closed or self._line)
            if granted:
                self._idle = True
        if not granted:
            yield None
            return
        try:
            yield self._requested
        finally:
            with self._cond:
                self._idle = False
                self._cond.notify_all()

    def _requested(self) -> bool:
        return bool(self._line) or self._closed

    def close(self) -> None:
        """Admit no one again: waiting requests and later arrivals get the shutdown 503."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until neither a request nor idle-time work holds the engine (after close(),
        it is then free for good). True when it is."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._busy or self._idle), timeout)
