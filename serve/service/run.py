"""One request as it runs: the one object the service and its generation loop speak to.

A `Run` holds
- cancellation: the client left or the server is shutting down (`cut` then
  tells the two apart). The client's side says it left through `leave()` (a
  write failed) or a `client_gone` probe that reads the socket's state and no
  more (serve/core/hangup.py);
- the engine turn (serve/engine/queue.py's `Turn`), once the request holds it;
- the request's events, and the logprobs waiting for the answer text they
  belong to (serve/service/logprobs.py).

The thread running the request only hands its events to the Run and never
calls out: the caller's own thread takes them (`take`), as they come or once
the call returns. A caller with no thread of its own (a test, a benchmark)
gives an observer instead, a `ReplySink` that hears each event as it happens.
"""
from __future__ import annotations

import threading
import time
from collections import deque
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
        self._left = threading.Event()          # the client's side said it left
        self._observer = observer
        self._events: deque[Event] = deque()    # made, not yet taken
        self._ended = False                     # the call is over: no event follows
        self._cond = threading.Condition()
        self.cut = False                        # gone() said yes because of shutdown
        self.turn: Optional[Turn] = None        # the hold on the engine, once the request has it
        self.logprobs: Optional[LogprobLedger] = None   # when the request asks for logprobs
        # A chat reply that thinks: its budget, and answer_now() for any thread
        self.reasoning: Optional[ReasoningBudget] = None

    # -- cancellation ---------------------------------------------------------------------

    def gone(self) -> bool:
        """Stop at the next token or prefill chunk: the client left, or shutdown began."""
        if self._stopping.is_set():
            self.cut = True
            return True
        return self._left.is_set() or self._client_gone()

    def leave(self) -> None:
        """From the client's side: the client is gone (say a write to it failed)."""
        self._left.set()

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
            self._events.append(event)
            self._cond.notify()

    # -- events, to the caller's thread -----------------------------------------------------

    def take(self) -> tuple[list[Event], bool]:
        """Waits for events or the end; returns the events made since the last take, in
        order, and whether more may follow."""
        with self._cond:
            while not self._events and not self._ended:
                self._cond.wait()
            events = list(self._events)
            self._events.clear()
            return events, not self._ended

    def end(self) -> None:
        """The caller's call returned (or raised): no event follows, and `take` stops waiting."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
