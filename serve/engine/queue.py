"""The line for the engine: the person first, people in turn; bounded, closable.

The engine runs one thing at a time, and this is the only way to it. A plain
lock hands it to whichever waiting thread the scheduler wakes first, so under
load a request could wait without bound; here each request takes a ticket and
the engine goes to the oldest interactive one, and only when none waits to the
oldest background one (a chore: serve/core/work_classes.py). The line has a fixed
length: beyond it a request is refused at once (503 with Retry-After) instead
of waiting for hours behind a slow model.

Within a class the engine goes in turn between people (a ticket's `owner`, the
sender's namespace: serve/http/auth.py): the oldest waiting request of the
person served least recently goes first, so one person's three parallel
requests cannot put a colleague behind all three. Each time the engine goes to
someone else in its class, that person is then served more recently than this
one; so a request that is its person's oldest waits for at most one request of
each other person in its class (P - 1 with P people waiting), and none waits
without bound. With one person (no keys, or one key) the order is arrival.
Beyond `max_per_owner` requests waiting, a person is refused at once (429 with
Retry-After) while everyone else keeps their places.

A chore holding the engine asks, before each engine call, whether a person
waits (Turn.preempt_due); if so it saves its state and steps aside
(Turn.step_aside, serve/service/preempt.py), back in line at its old place among
the chores. Chores cannot starve: one that has waited `starve_after` seconds
goes ahead of the people for one engine step (then steps aside again), so a
chore gets at least one step every `starve_after` seconds however busy people
keep the engine.

Work that only spares later requests time (settling a reply's snapshot,
--warm) takes an idle turn instead: it gets the engine only when nobody holds
it or waits for it, and it is told to yield as soon as a request arrives, which
it does at its next chunk. A request whose client left mid-prefill becomes such
work where it stands (Turn.to_idle): its prefill goes on for the client's retry
while nobody waits, and yields like any idle-time work.

A short engine call for a thread that does not hold the engine (tokenizing a
request before it joins the line, when serve's own tokenizer is not the
engine's) is an errand: it runs at once when the engine is free, else the
holder runs it between its engine calls (at its next prefill chunk, or from
waste_generate's token callback), so it never waits behind a whole reply. So
an errand may only tokenize: the engines' tokenizers read nothing a generation
in progress writes (docs/engine.md).

The line decides who has the engine, on the waiting threads; it calls nothing
of the engine. The engine's one thread (serve/engine/worker.py) runs the body
of whoever holds it, and the errands: the holder's, and those run at once.
"""
from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, TypeVar

from serve.core.work_classes import BACKGROUND, CLASSES, INTERACTIVE
from serve.core.errors import ApiError
from serve.engine.worker import Call

T = TypeVar("T")

RETRY_AFTER_SECONDS = 5
POLL_SECONDS = 0.25  # how often a waiting request asks whether its client is still there
STARVE_AFTER_SECONDS = 300.0   # a chore waiting this long runs one step ahead of people


class Waiter(Protocol):
    def queued(self, ahead: int) -> None: ...

    def should_stop(self) -> bool: ...


class ClientLeft(Exception):
    """The client left while its request waited in line."""


class LostTurn(Exception):
    """A chore that stepped aside could not get the engine back (its client left, or the
    server is shutting down): the engine is another request's now, and nothing on the way
    out may touch it (no reset). `cause` is what waiting raised."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, code="server_overloaded", kind="server_error",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def too_many_waiting(waiting: int) -> ApiError:
    return ApiError(429, f"{waiting} of your requests are already waiting for the engine; "
                         "try again when one is answered", code="rate_limit_exceeded",
                    kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_shutting_down",
                    kind="server_error")


@dataclass
class _Ticket:
    work: str             # INTERACTIVE or BACKGROUND
    seq: int              # arrival order
    since: float = 0.0    # when it began waiting (this time)
    chores_at: float = 0.0   # the queue's chore clock then
    owner: str = ""       # whose request it is: people are served in turn (_order)


@dataclass
class ClassCounts:
    """What one class of work did with the engine, since start."""
    waits: int = 0              # times a request of the class was handed the engine
    wait_seconds: float = 0.0   # time it spent waiting for those
    engine_seconds: float = 0.0  # time it held the engine (idle-time work not counted)


class Turn:
    """A request's hold on the engine, as its holder may change it."""

    def __init__(self, queue: "EngineQueue", ticket: _Ticket):
        self._queue = queue
        self.ticket = ticket
        self.idle = False    # the request's client left: its work now runs as idle-time work
        self.holding = False  # it holds the engine (not while stepped aside)
        self.behind_chores = 0.0   # seconds it waited while chores held the engine

    @property
    def work(self) -> str:
        return self.ticket.work

    def to_idle(self) -> None:
        """Nobody waits on this work any more: it no longer counts as a request holding the
        engine, and it yields as soon as a request waits (requested())."""
        q = self._queue
        with q._cond:
            if not self.idle:
                q._release(self.ticket)
                self.idle, q._idle = True, True
                q._cond.notify_all()

    def reclaim(self) -> None:
        """Someone waits on this work again (its client came back): it holds the engine as a
        request once more, and no longer yields to requests that arrive later."""
        q = self._queue
        with q._cond:
            if self.idle and q._holder is None:
                self.idle, q._idle = False, False
                q._holder, q._held_since = self.ticket, time.monotonic()

    def requested(self) -> bool:
        """A request waits for the engine, or the line is closed."""
        return self._queue._requested()

    def preempt_due(self) -> bool:
        """Asked by a chore before each engine call: should it step aside now? Yes when a
        person waits, but for the one step a chore that waited too long is owed."""
        q = self._queue
        with q._cond:
            if not (q.classes and self.work == BACKGROUND and self.holding and not self.idle):
                return False
            if q._owed:
                q._owed = False
                return False
            return any(t.work == INTERACTIVE for t in q._line)

    def step_aside(self, waiter: Waiter) -> None:
        """Let go of the engine and wait for it again at this ticket's place in line (the
        caller saved its state first). Raises LostTurn when it cannot have it again."""
        q = self._queue
        with q._cond:
            q._release(self.ticket)
            q.preemptions += 1
            self.holding = False
            q._aside.append(self.ticket)
            q._enter(self.ticket)
        try:
            q._wait_for(self, waiter)
        except Exception as e:
            raise LostTurn(e) from e
        finally:
            with q._cond:
                q._aside.remove(self.ticket)
                q._cond.notify_all()   # the chore stepped aside below it may have it next
        with q._cond:
            q._owed = False   # the owed step is the one its caller runs on return


class EngineQueue:
    def __init__(self, max_waiting: int, *, classes: bool = True,
                 starve_after: float = STARVE_AFTER_SECONDS,
                 max_per_owner: Optional[int] = None):
        """`classes`: False serves every request in arrival order (and preempts none);
        `max_per_owner`: the requests one person may have waiting (None: no bound but the
        line's)."""
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self.max_per_owner = max_per_owner
        self.classes = classes
        self.starve_after = starve_after
        self._cond = threading.Condition()
        self._line: list[_Ticket] = []
        self._holder: Optional[_Ticket] = None   # the request that holds the engine
        self._held_since = 0.0
        self._idle = False    # idle-time work holds it
        self._closed = False
        self._errands: list[Call] = []
        self._errand_running = False   # an errand has the free engine to itself
        self._owed = False    # the holder is a starved chore owed one step
        # Chores stepped aside, in order: each one's body is nested on the engine's one thread
        # above the one before (worker.py), so only the last may have the engine back.
        self._aside: list[_Ticket] = []
        self._seq = itertools.count()
        self._served: dict[str, int] = {}   # owner -> when it last took the engine (a count)
        self._serves = itertools.count()
        self.counts = {work: ClassCounts() for work in CLASSES}
        self.owner_counts: dict[tuple[str, str], ClassCounts] = {}   # by (owner, class)
        self.preemptions = 0  # chores that stepped aside for a person

    def __len__(self) -> int:
        """Requests waiting (not counting the one that holds the engine)."""
        return len(self._line)

    @property
    def busy(self) -> bool:
        """A request holds the engine."""
        return self._holder is not None

    @property
    def idle_work(self) -> bool:
        """Idle-time work holds the engine (settling, warming, a prefill whose client left)."""
        return self._idle

    def waiting(self) -> dict[str, tuple[int, float]]:
        """Per class: (requests waiting, the longest wait so far in seconds)."""
        now = time.monotonic()
        with self._cond:
            return {work: (sum(1 for t in self._line if t.work == work),
                           max((now - t.since for t in self._line if t.work == work), default=0.0))
                    for work in CLASSES}

    def holder(self) -> Optional[str]:
        """The class of the request holding the engine, or None."""
        holder = self._holder
        return None if holder is None else holder.work

    def snapshot_counts(self) -> dict[str, ClassCounts]:
        """ClassCounts per class, the running hold included."""
        return self._copied(self.counts, lambda t: t.work)

    def snapshot_owner_counts(self) -> dict[tuple[str, str], ClassCounts]:
        """ClassCounts per (owner, class), the running hold included."""
        return self._copied(self.owner_counts, lambda t: (t.owner, t.work))

    def _copied(self, counts: dict, key: Callable[[_Ticket], object]) -> dict:
        with self._cond:
            out = {k: ClassCounts(c.waits, c.wait_seconds, c.engine_seconds)
                   for k, c in counts.items()}
            if self._holder is not None and key(self._holder) in out:
                out[key(self._holder)].engine_seconds += time.monotonic() - self._held_since
            return out

    def _counted(self, ticket: _Ticket) -> tuple[ClassCounts, ClassCounts]:
        """The counts a ticket adds to: its class's, and its owner's in that class."""
        mine = self.owner_counts.setdefault((ticket.owner, ticket.work), ClassCounts())
        return self.counts[ticket.work], mine

    @contextmanager
    def turn(self, waiter: Waiter, work: str = INTERACTIVE,
             meanwhile: Optional[Callable[[], None]] = None, owner: str = "") -> Iterator[Turn]:
        """Waits for the engine in line (the person first) and holds it for the block.

        While waiting, `waiter.queued(ahead)` hears the number of requests in
        front (the running one included; 0 behind idle-time work) each time it changes. Raises the 503s
        of a full line or of shutdown, or ClientLeft. `meanwhile()` runs on this thread once
        the request is in line: work it can do without the engine (finding its snapshot),
        done while those ahead use it. The request keeps its place, and should it come first
        meanwhile the engine waits for it: a few seconds idle, where a request that came later
        taking its turn could hold the engine for hours on K3. `owner`: whose request it
        is, for the turns people take, and the 429 of one who has too many waiting.
        """
        with self._cond:
            if self._closed:
                raise shutting_down()
            if (self._holder or self._line) and len(self._line) >= self.max_waiting:
                raise overloaded(f"{len(self._line)} requests are already waiting for the engine; "
                                 "try again later")
            mine = sum(1 for t in self._line if t.owner == owner)
            if (self._holder or self._line) and self.max_per_owner is not None \
                    and mine >= self.max_per_owner:
                raise too_many_waiting(mine)
            held = Turn(self, _Ticket(work, next(self._seq), owner=owner))
            self._enter(held.ticket)
        self._wait_for(held, waiter, meanwhile)
        try:
            yield held
        finally:
            with self._cond:
                if held.idle:
                    self._idle = False
                elif held.holding:
                    self._release(held.ticket)
                self._cond.notify_all()

    def _enter(self, ticket: _Ticket) -> None:
        """Into the line. Under _cond."""
        ticket.since, ticket.chores_at = time.monotonic(), self._chore_clock()
        self._line.append(ticket)
        self._cond.notify_all()   # idle-time work waiting for the engine gives up its turn

    def _release(self, ticket: _Ticket) -> None:
        """The holder lets go. Under _cond."""
        if self._holder is ticket:
            for counts in self._counted(ticket):
                counts.engine_seconds += time.monotonic() - self._held_since
            self._holder, self._owed = None, False
            self._cond.notify_all()

    def _chore_clock(self) -> float:
        """Seconds chores have held the engine since start, the running hold included."""
        held = self.counts[BACKGROUND].engine_seconds
        if self._holder is not None and self._holder.work == BACKGROUND:
            held += time.monotonic() - self._held_since
        return held

    def _wait_for(self, held: Turn, waiter: Waiter,
                  meanwhile: Optional[Callable[[], None]] = None) -> None:
        try:
            if meanwhile is not None:
                meanwhile()
            self._wait(held.ticket, waiter)
        except BaseException:
            with self._cond:
                if held.ticket in self._line:
                    self._line.remove(held.ticket)
                    self._cond.notify_all()  # those behind it moved up
            raise
        held.holding = True
        with self._cond:
            held.behind_chores += self._chore_clock() - held.ticket.chores_at

    def _wait(self, ticket: _Ticket, waiter: Waiter) -> None:
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
            if waiter.should_stop():
                raise ClientLeft()
            if ahead != told:
                waiter.queued(ahead)
                told = ahead

    def _order(self, now: float) -> list[_Ticket]:
        """The line in the order it is served. Under _cond."""
        if not self.classes:
            return sorted(self._line, key=lambda t: t.seq)

        def rank(t: _Ticket) -> tuple[int, int, int]:
            # Within a class: the person served least recently (never: -1), then arrival.
            turn = self._served.get(t.owner, -1)
            if t.work == INTERACTIVE:
                return 1, turn, t.seq
            return (0 if now - t.since >= self.starve_after else 2), turn, t.seq
        return sorted(self._line, key=rank)

    def _take(self, ticket: _Ticket) -> Optional[int]:
        """None once `ticket` holds the engine, else the requests in front of it (the running
        one included; 0 while idle-time work finishes its chunk). Under _cond."""
        if self._closed:
            raise shutting_down()
        now = time.monotonic()
        order = self._order(now)   # O(line log line), and the line is bounded
        buried = self._aside[:-1]
        first = next((t for t in order if t not in buried), None)
        if not (self._holder or self._idle or self._errand_running) and first is ticket:
            self._line.remove(ticket)
            self._holder, self._held_since = ticket, now
            self._served[ticket.owner] = next(self._serves)
            for counts in self._counted(ticket):
                counts.waits += 1
                counts.wait_seconds += now - ticket.since
            # A starved chore taking the engine from waiting people is owed one step.
            self._owed = (self.classes and ticket.work == BACKGROUND
                          and any(t.work == INTERACTIVE for t in self._line))
            return None
        return order.index(ticket) + int(self._holder is not None)

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
            return not (self._holder or self._idle or self._errand_running
                        or (patient and self._line))

        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._line and not patient) or free())
            granted = not (self._closed or self._line)
            if granted:
                self._idle = True
        if not granted:
            yield None
            return
        def yield_now() -> bool:
            self.run_errands()   # asked between chunks: a moment the engine is free
            return self._requested()

        try:
            yield yield_now
        finally:
            with self._cond:
                self._idle = False
                self._cond.notify_all()

    def _requested(self) -> bool:
        return bool(self._line) or self._closed

    # -- errands --------------------------------------------------------------

    def errand(self, work: Callable[[], T]) -> T:
        """Run `work`, a short engine call, for a thread that does not hold the engine: at
        once when the engine is free, else between the holder's engine calls (run_errands).
        Raises what `work` raises, or the shutdown 503."""
        errand: Call[T] = Call(work)
        with self._cond:
            self._errands.append(errand)
            self._cond.notify_all()
            while not errand.done:
                if errand in self._errands and (self._closed or not (
                        self._holder or self._idle or self._errand_running)):
                    self._errands.remove(errand)
                    if self._closed:
                        raise shutting_down()
                    self._errand_running = True
                    break
                self._cond.wait(POLL_SECONDS)
        if not errand.done:
            try:
                errand.do()
            finally:
                with self._cond:
                    self._errand_running = False
                    self._cond.notify_all()
        return errand.outcome()

    def run_errands(self) -> None:
        """Called by the engine's holder between its engine calls, or from the token callback
        (errands only tokenize): run the errands waiting."""
        if not self._errands:   # asked up to once a millisecond: most often none, and no lock
            return
        with self._cond:
            if not self._errands:
                return
            pending, self._errands = self._errands, []
        for errand in pending:
            errand.do()
        with self._cond:
            for errand in pending:
                errand.done = True
            self._cond.notify_all()

    def close(self) -> None:
        """Admit no one again: waiting requests and later arrivals get the shutdown 503."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until neither a request nor idle-time work holds the engine (after close(),
        it is then free for good). True when it is."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._holder or self._idle or self._errand_running), timeout)
