"""One request as it runs: the one object the service and its generation loop speak to.

A `Run` holds
- cancellation: shutdown (`cut`), an explicit stop (`stopped`: the reply ends
  as a normal finish with what was said so far), or nobody following it any
  more (`detached_for`: its readers all left; serve/service/detach.py decides
  what such work may still do). A caller with no job reads its client's state
  through a `client_gone` probe instead;
- the engine turn (serve/engine/queue.py's `Turn`), once the request holds it;
- the request's events, and the logprobs waiting for the answer text they
  belong to (serve/service/logprobs.py).

The thread running the request only appends its events to the Run's log and
never calls out. The log is append-only: any number of readers follow it,
each from a position of its own (`read`), so a client that comes back gets
everything said so far at once, and a reader that stops reading blocks no one.
A caller with no thread of its own (a test, a benchmark) gives an observer
instead, a `ReplySink` that hears each event as it happens.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from serve.core.reply import Delta
from serve.engine.queue import Turn
from serve.service.logprobs import LogprobLedger
from serve.service.reasoning_budget import ReasoningBudget
from serve.service.replies import ReplySink


# -- the events, in the order a request makes them --------------------------------------

@dataclass(frozen=True)
class Event:
    at: float   # time.monotonic() when it happened: the taker may see it later

    def to(self, observer: ReplySink) -> None:
        """Tell `observer` of it, through the ReplySink method it stands for."""
        raise NotImplementedError


@dataclass(frozen=True)
class Accepted(Event):
    thinking: bool

    def to(self, observer: ReplySink) -> None:
        observer.accepted(self.thinking)


@dataclass(frozen=True)
class Queued(Event):
    ahead: int

    def to(self, observer: ReplySink) -> None:
        observer.queued(self.ahead)


@dataclass(frozen=True)
class Fetching(Event):
    positions: int

    def to(self, observer: ReplySink) -> None:
        observer.fetching(self.positions)


@dataclass(frozen=True)
class Started(Event):
    def to(self, observer: ReplySink) -> None:
        observer.start()


@dataclass(frozen=True)
class Prefilling(Event):
    prompt_tokens: int
    cached_tokens: int

    def to(self, observer: ReplySink) -> None:
        observer.prefilling(self.prompt_tokens, self.cached_tokens)


@dataclass(frozen=True)
class Progress(Event):
    done: int
    total: int
    seconds_per_position: Optional[float] = None   # the measured prefill rate, as it stands

    def to(self, observer: ReplySink) -> None:
        observer.progress(self.done, self.total)


@dataclass(frozen=True)
class Emitted(Event):
    delta: Delta

    def to(self, observer: ReplySink) -> None:
        observer.emit(self.delta)


def _never() -> bool:
    return False


class Run:
    def __init__(self, stopping: threading.Event, client_gone: Callable[[], bool] = _never,
                 observer: Optional[ReplySink] = None):
        self._stopping = stopping
        self._client_gone = client_gone
        self._observer = observer
        self._log: list[Event] = []             # every event made, in order; only appended to
        self._ended = False                     # the call is over: no event follows
        self._cond = threading.Condition()
        self._waiting = 0                       # readers in read(), waiting for an event
        # The readers following the log now, each with its client's hangup probe.
        self._readers: dict[int, Callable[[], bool]] = {}
        self._next_reader = 0
        self._unfollowed_at: Optional[float] = None   # when the last of them left
        self.cut = False                        # gone() said yes because of shutdown
        self.stopped = False                    # stopped on purpose: a normal finish
        self.turn: Optional[Turn] = None        # the hold on the engine, once the request has it
        self.logprobs: Optional[LogprobLedger] = None   # when the request asks for logprobs
        # A chat reply that thinks: its budget, and answer_now() for any thread
        self.reasoning: Optional[ReasoningBudget] = None

    # -- cancellation ---------------------------------------------------------------------

    def gone(self) -> bool:
        """Is there a reason to stop at the next token or prefill chunk? Shutdown, a stop,
        or nobody following the run (serve/service/detach.py says whether it goes on)."""
        if self._stopping.is_set():
            self.cut = True
            return True
        if self.stopped or self._unfollowed_at is not None or self._client_gone():
            return True
        readers = list(self._readers.values())
        if readers and all(hung_up() for hung_up in readers):
            # Each reader's client has closed its socket: the readers will see it at their
            # next look, and the work need not wait for them to count as unfollowed.
            with self._cond:
                if self._unfollowed_at is None:
                    self._unfollowed_at = time.monotonic()
            return True
        return False

    def followed(self) -> bool:
        """Does a reader follow the log whose client is still there?"""
        return any(not hung_up() for hung_up in list(self._readers.values()))

    def stop(self) -> None:
        """End the reply at the next token or prefill chunk, as a normal finish."""
        self.stopped = True

    def detached_for(self) -> Optional[float]:
        """Seconds since the last reader left, or None while one follows (or none ever did)."""
        left = self._unfollowed_at
        return None if left is None else time.monotonic() - left

    def follow(self, hung_up: Callable[[], bool] = _never) -> int:
        """A reader starts following the log (a client, or a background response's keeper);
        `hung_up()` asks whether its client has closed its end (serve/core/hangup.py), once per
        token, so the work learns it at once. Returns the reader's number for unfollow."""
        with self._cond:
            reader, self._next_reader = self._next_reader, self._next_reader + 1
            self._readers[reader] = hung_up
            self._unfollowed_at = None
            return reader

    def unfollow(self, reader: int) -> None:
        """A reader stops following: its client left, or it has everything."""
        with self._cond:
            self._readers.pop(reader, None)
            if not self._readers and not self._ended and self._unfollowed_at is None:
                self._unfollowed_at = time.monotonic()

    # -- events, from the thread running the request --------------------------------------

    def accepted(self, thinking: bool) -> None:
        self._post(Accepted(time.monotonic(), thinking))

    def queued(self, ahead: int) -> None:
        self._post(Queued(time.monotonic(), ahead))

    def fetching(self, positions: int) -> None:
        self._post(Fetching(time.monotonic(), positions))

    def start(self) -> None:
        self._post(Started(time.monotonic()))

    def prefilling(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._post(Prefilling(time.monotonic(), prompt_tokens, cached_tokens))

    def progress(self, done: int, total: int, seconds_per_position: Optional[float] = None) -> None:
        self._post(Progress(time.monotonic(), done, total, seconds_per_position))

    def emit(self, delta: Delta) -> None:
        if self.logprobs is not None:
            delta = self.logprobs.attach(delta)
        self._post(Emitted(time.monotonic(), delta))

    def _post(self, event: Event) -> None:
        if self._observer is not None:
            event.to(self._observer)
            return
        with self._cond:
            self._log.append(event)
            if self._waiting:   # a reader that is busy finds the event at its next read
                self._cond.notify_all()

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
            self._unfollowed_at = None
            self._cond.notify_all()
