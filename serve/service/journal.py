"""One request as it runs: the one object the service and its generation loop speak to.

A `Journal` holds
- cancellation: shutdown (`cut`), an explicit stop (`stopped`: the reply ends
  as a normal finish with what was said so far), or nobody following it any
  more (`detached_for`: its readers all left; serve/service/detach.py decides
  what such work may still do). A caller with no job reads its client's state
  through a `client_left` probe instead;
- the engine turn (serve/engine/queue.py's `Turn`), once the request holds it;
- the request's events, and the logprobs waiting for the answer text they
  belong to (serve/service/logprobs.py).

The thread running the request only appends its events to the Journal's log and
never calls out. The log is append-only: any number of readers follow it,
each from a position of its own (`read`), so a client that comes back gets
everything said so far at once, and a reader that stops reading blocks no one.
A caller with no thread of its own (a test, a benchmark) gives a `Listener`
instead, which takes each event as it is made.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from serve.core.reply import Delta, joined
from serve.engine.queue import Turn
from serve.service.logprobs import LogprobLedger
from serve.service.reasoning_budget import ReasoningBudget


# -- the events, in the order a request makes them: each defined here once --------------
# The thread running the request makes them (`Journal.post`); every reader (the sinks in
# serve/http/sinks.py, a background response's keeper, a job's description, a Listener)
# dispatches on these types.

@dataclass(frozen=True)
class Event:
    # time.monotonic() when it happened: the taker may see it later
    at: float = field(default_factory=time.monotonic, kw_only=True)


@dataclass(frozen=True)
class Accepted(Event):
    """The request passed its checks and will wait for the engine."""
    thinking: bool   # its reply opens in the think channel


@dataclass(frozen=True)
class Queued(Event):
    """It waits for the engine behind `ahead` others (the running one included); made again
    when that number changes."""
    ahead: int


@dataclass(frozen=True)
class Fetching(Event):
    """Before it waits, it copies a snapshot of `positions` positions from the team's shared
    tier (seconds, or minutes on a slow share, for a long conversation)."""
    positions: int


@dataclass(frozen=True)
class Started(Event):
    """It holds the engine and generation begins; errors after this are mid-reply."""


@dataclass(frozen=True)
class Prefilling(Event):
    """Prefill begins, once, before its first chunk: `cached_tokens` of the prompt's
    `prompt_tokens` positions were restored from a snapshot."""
    prompt_tokens: int
    cached_tokens: int
    seconds_per_position: Optional[float] = None   # the prefill rate earlier requests measured


@dataclass(frozen=True)
class Progress(Event):
    """Prefill has evaluated `done` of `total` prompt positions."""
    done: int
    total: int
    seconds_per_position: Optional[float] = None   # the measured prefill rate, as it stands


@dataclass(frozen=True)
class Emitted(Event):
    """One piece of output (a completion's text is its `content`)."""
    delta: Delta


def gathered(events: list[Event]) -> list[Event]:
    """`events` with each run of `Emitted` said in as few deltas as say the same (a reader
    that takes the log in batches sends a batch's tokens as one event, not one each), at the
    time of the run's first."""
    out: list[Event] = []
    run: list[Emitted] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.extend(Emitted(delta, at=run[0].at) for delta in joined([e.delta for e in run]))
        run.clear()

    for event in events:
        if isinstance(event, Emitted):
            run.append(event)
        else:
            flush()
            out.append(event)
    flush()
    return out


class Listener(Protocol):
    """A caller with no thread of its own (a test, a benchmark): takes each event as it is
    made, on the thread making it, and says when its client left."""

    def take(self, event: Event) -> None: ...

    def client_left(self) -> bool: ...


def _never() -> bool:
    return False


class Journal:
    def __init__(self, stopping: threading.Event, client_left: Callable[[], bool] = _never,
                 listener: Optional[Listener] = None):
        self._stopping = stopping
        self._client_left = client_left
        self._listener = listener
        self._log: list[Event] = []             # every event made, in order; only appended to
        self._ended = False                     # the call is over: no event follows
        # post() takes the lock itself, once per token: Condition's own `with` is a Python call.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0                       # readers in read(), waiting for an event
        # The readers following the log now, each with its client's hangup probe.
        self._readers: dict[int, Callable[[], bool]] = {}
        self._next_reader = 0
        self._left_at: Optional[float] = None   # when the last of them left
        self.cut = False                        # should_stop() said yes because of shutdown
        self.stopped = False                    # stopped on purpose: a normal finish
        self.turn: Optional[Turn] = None        # the hold on the engine, once the request has it
        self.logprobs: Optional[LogprobLedger] = None   # when the request asks for logprobs
        # A chat reply that thinks: its budget, and answer_now() for any thread
        self.reasoning: Optional[ReasoningBudget] = None

    # -- cancellation ---------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Is there a reason to stop at the next token or prefill chunk? Shutdown, a stop,
        or nobody following the run (serve/service/detach.py says whether it goes on)."""
        if self._stopping.is_set():
            self.cut = True
            return True
        if self.stopped or self._left_at is not None or self._client_left():
            return True
        # Asked up to once a millisecond: a plain loop, no generator, on the engine's thread.
        readers = tuple(self._readers.values())
        if not readers:
            return False
        for client_left in readers:
            if not client_left():
                return False
        # Each reader's client has closed its socket: the readers will see it at their
        # next look, and the work need not wait for them to count as detached.
        with self._cond:
            if self._left_at is None:
                self._left_at = time.monotonic()
        return True

    def followed(self) -> bool:
        """Does a reader follow the log whose client is still there?"""
        return any(not client_left() for client_left in list(self._readers.values()))

    def stop(self) -> None:
        """End the reply at the next token or prefill chunk, as a normal finish."""
        self.stopped = True

    def detached_for(self) -> Optional[float]:
        """Seconds since the last reader left, or None while one follows (or none ever did)."""
        left = self._left_at
        return None if left is None else time.monotonic() - left

    def follow(self, client_left: Callable[[], bool] = _never) -> int:
        """A reader starts following the log (a client, or a background response's keeper);
        `client_left()` asks whether its client has closed its end (serve/core/hangup.py), at each
        prefill chunk and at most once a millisecond of tokens, so the work learns it at once.
        Returns the reader's number for unfollow."""
        with self._cond:
            reader, self._next_reader = self._next_reader, self._next_reader + 1
            self._readers[reader] = client_left
            self._left_at = None
            return reader

    def unfollow(self, reader: int) -> None:
        """A reader stops following: its client left, or it has everything."""
        with self._cond:
            self._readers.pop(reader, None)
            if not self._readers and not self._ended and self._left_at is None:
                self._left_at = time.monotonic()

    # -- events, from the thread running the request --------------------------------------

    def post(self, event: Event) -> None:
        """Append an event to the log (or hand it to the listener), for every reader."""
        if self._listener is not None:
            self._listener.take(event)
            return
        with self._lock:
            self._log.append(event)
            if self._waiting:   # a reader that is busy finds the event at its next read
                self._cond.notify_all()

    def emit(self, delta: Delta) -> None:
        """A reply reader's output (serve/service/reply_reader.py's Emit), with the logprobs
        of its text attached."""
        if self.logprobs is not None:
            delta = self.logprobs.attach(delta)
        self.post(Emitted(delta))

    def queued(self, ahead: int) -> None:
        """The engine queue's Waiter (serve/engine/queue.py, which knows no events)."""
        self.post(Queued(ahead))

    # -- events, to readers ---------------------------------------------------------------

    def read(self, position: int, timeout: Optional[float] = None) -> tuple[list[Event], bool]:
        """The events from `position` on, waiting up to `timeout` seconds (None: for ever) for
        one if there are none yet; and whether more may follow."""
        with self._cond:
            if position >= len(self._log) and not self._ended:
                self._waiting += 1
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting -= 1
            return self._log[position:], not self._ended

    @property
    def size(self) -> int:
        """Events in the log so far."""
        return len(self._log)

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self) -> None:
        """The call returned (or raised): no event follows, and readers stop waiting."""
        with self._cond:
            self._ended = True
            self._left_at = None
            self._cond.notify_all()
