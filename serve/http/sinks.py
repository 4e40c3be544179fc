"""The sink of every generation request: a job's events, through an exchange, to the client.

The job runs on its own thread (serve/service/jobs.py) and only appends its
events to its journal. The sink follows that log on the handler's thread,
from the first event, whether the job is new or one this request attached to:
a client that comes back gets everything said so far at once, then the rest
as it comes, taken at most every GATHER seconds. So only this thread makes the
exchange's bytes, and nothing here ever waits for the engine.

A streamed reply opens its event stream as soon as the request is accepted or
waits in line, and from then on every byte goes through the stream's writer;
a blocking reply sends one body at the end. Both feed the exchange the same
deltas, into the one accumulation its stream and its body come from (a
blocking reply's are encoded as nothing). The exchange's opening events wait
until the prompt's size is known, so they can say it, unless a heartbeat is
due first. While it follows, the sink watches its client: a client that closed
its end, or a send that failed, stops the following (the job goes on by serve/service/detach.py's rule). The
sink knows the connection only through `Connection`: it never writes a
response itself, and tells the handler what to log.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Optional, Protocol

from serve.core.errors import ApiError
from serve.engine.queue import ClientLeft
from serve.dialects.exchange import R, Exchange
from serve.service.replies import ReplyStart
from serve.service.eta import PrefillState, advance
from serve.service.jobs import Job
from serve.service.journal import (Accepted, Emitted, Event, Fetching, Prefilling, Progress,
                                   Queued, Started, gathered)
from serve.dialects.sse import EventWriter
from serve.http.progress import prefill_comment


class Connection(Protocol):
    def open_stream(self, content_type: str, on_silence: Callable[[], None],
                    on_failed: Callable[[], None]) -> EventWriter:
        """Send a stream's headers (`content_type`: its framing's); its bytes then go through
        the returned writer,
        which calls, from its own thread, `on_silence` when the stream needs a heartbeat
        and `on_failed` when a send fails."""

    def public_error(self, error: Exception) -> ApiError:
        """What the client may be told of an error."""


@dataclass(frozen=True)
class Answer:
    """What the handler sends and logs once a generation is over."""
    status: int                    # for the log (a stream has sent its own already)
    tokens: int = 0
    body: Optional[dict] = None    # a blocking reply's body, still to send
    timing: str = ""               # for the log: where the time went (ExchangeSink._timing)


FOLLOW_POLL = 0.25   # seconds between two looks at the client while the job is silent
# Seconds a reader lets the log gather before it takes it again. At a fast model's thousand
# tokens a second, taking each token as it comes costs a thread hand-off, an event and a
# send per token, on the GIL the engine's thread needs for its own token callback; taken
# every few milliseconds, a batch's tokens go out as one event (journal.gathered). A slow
# model's tokens still go out one by one, the moment each comes: the reader waits only
# after it has just taken something.
GATHER = 0.005


class ExchangeSink(Generic[R]):
    def __init__(self, connection: Connection, exchange: Exchange[R], job: Job[R], reader: int,
                 client_left: Callable[[], bool]):
        self._connection = connection
        self._job: Job[R] = job
        self._reader = reader   # this sink's number among the job's readers
        self._client_left = client_left
        self._exchange: Exchange[R] = exchange
        self._stream = exchange.request.stream
        self._writer: Optional[EventWriter] = None
        self._failed = threading.Event()   # a send to the client failed
        # The exchange's events are made and queued under one lock: the sink's own and the
        # writer's heartbeats share its state (sequence numbers, the open block).
        self._lock = threading.Lock()
        self._start = ReplyStart()
        self._prefill: Optional[PrefillState] = None   # while the prompt is evaluated
        self._opened = False     # the exchange's opening events are queued
        self._ended = False      # so are its last ones: no heartbeat may follow
        # For the log line: when the request got the engine and its first token came.
        self._began = time.monotonic()
        self._engine_at: Optional[float] = None
        self._first_at: Optional[float] = None

    # -- the job's events, on the handler's thread --------------------------------------

    def _take(self, event: Event) -> None:
        # Replaced whole, never changed: the writer's heartbeat reads it from its own thread.
        self._prefill = advance(self._prefill, event)
        if isinstance(event, Accepted):
            self._start = replace(self._start, thinking=event.thinking)
        elif isinstance(event, Queued):
            # While the request waits for the engine, the stream is already open and says so.
            if self._stream:
                self._open()
                self._comment(f"queue {event.ahead}")
        elif isinstance(event, Fetching):
            # A copy from the shared tier can outlast a client's wait for its first byte.
            if self._stream:
                self._open()
                self._comment(f"fetching a snapshot of {event.positions} positions")
        elif isinstance(event, Started):
            self._engine_at = max(event.at, self._began)
            if self._stream:
                self._open()
        elif isinstance(event, Prefilling):
            self._start = replace(self._start, prompt_tokens=event.prompt_tokens,
                                  cached_tokens=event.cached_tokens)
            self._events(lambda: b"")   # the opening, now that it can say the prompt's size
        elif isinstance(event, Progress) and self._prefill is not None:
            self._comment(prefill_comment(self._prefill))
        elif isinstance(event, Emitted):
            if self._first_at is None:
                self._first_at = max(event.at, self._began)
            delta = event.delta
            if self._writer is None:   # a blocking reply: the delta goes into its body only
                self._exchange.delta(delta)
            else:
                self._events(lambda: self._exchange.delta(delta))

    def _follow(self) -> R:
        """Take the job's events until it ends, then its reply (or what it raised). Raises
        ClientLeft, and stops following, once the client has left."""
        journal, position = self._job.journal, 0
        taken_at = 0.0
        try:
            while True:
                wait = taken_at + GATHER - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                events, more = journal.read(position, FOLLOW_POLL)
                position += len(events)
                if events:
                    taken_at = time.monotonic()
                for event in gathered(events):
                    self._take(event)
                # Asked before the end counts as delivered, too: a client that left just before
                # it must find the job still undelivered when it comes back.
                if self._failed.is_set() or self._client_left():
                    raise ClientLeft()
                if not more:   # read under the log's lock: nothing follows what it gave
                    break
        except ClientLeft:
            journal.unfollow(self._reader)   # the job goes on by serve/service/detach.py's rule
            raise
        except BaseException:
            # This side broke, not the client: what the job says can reach no one this way.
            self._job.stop()
            journal.unfollow(self._reader)
            raise
        self._job.delivered = True
        journal.unfollow(self._reader)
        return self._job.result()

    # -- following it --------------------------------------------------------------------

    def follow(self) -> Answer:
        """Follows the job to its end. Errors before the stream opens are ordinary HTTP errors,
        in the format's field names; after, the format's failure events end the stream."""
        try:
            return self._answer()
        finally:
            self._close()   # however it ends, the writer thread ends too

    def _answer(self) -> Answer:
        try:
            reply = self._follow()
        except ApiError as e:
            if self._writer is None:
                raise self._exchange.error(e) from None
            return self._fail(e)
        except ClientLeft:
            raise
        except Exception as e:
            if self._writer is None:
                raise
            return self._fail(e)
        tokens = reply.usage.completion_tokens
        timing = self._timing(reply.usage.waste)
        if reply.client_left:
            return Answer(499, tokens, timing=timing)
        self._exchange.keep(reply)
        if self._writer is None:
            return Answer(200, tokens, self._exchange.body(reply), timing)
        self._events(lambda: self._exchange.closing(reply), last=True)
        return Answer(200, tokens, timing=timing)

    def _timing(self, waste: dict) -> str:
        """Where a generation's time went: waiting for the engine, the prompt's positions (those
        restored from a snapshot are not prefilled), its first token, and reading experts from
        disk (most of a cold first request's time)."""
        def ms(at: Optional[float]) -> str:
            return "-" if at is None else f"{(at - self._began) * 1000:.0f}ms"
        read = waste.get("bytes_read", 0)
        return (f"engine at {ms(self._engine_at)}, prompt {self._start.prompt_tokens} "
                f"({self._start.cached_tokens} restored), first token at {ms(self._first_at)}"
                + (f", experts read {read / 1e6:.1f} MB in {waste.get('io_ms', 0):.0f}ms"
                   if read else ""))

    def _open(self) -> None:
        if self._writer is None:  # else already open: the request waited in line
            self._writer = self._connection.open_stream(self._exchange.framing.content_type,
                                                        self._heartbeat, self._failed.set)

    def _events(self, make: Callable[[], bytes], last: bool = False) -> None:
        """The exchange's bytes from `make()`, queued after its opening events; nothing after
        its `last` ones, and nothing at all for a blocking reply."""
        with self._lock:
            if self._writer is None:
                return
            if self._ended:
                return
            if not self._opened:
                self._opened = True
                self._writer.put(self._exchange.opening(self._start))
            self._writer.put(make())
            self._ended = last

    def _heartbeat(self) -> None:
        """From the writer's thread, after a silence: the opening if it has not gone out
        (the request waits in line), then the format's heartbeat; in prefill, the progress
        comment with it, in the same bytes (serve/http/progress.py)."""
        def beat() -> bytes:
            state = self._prefill
            note = b"" if state is None else self._exchange.framing.comment(prefill_comment(state))
            return note + self._exchange.heartbeat(self._start)
        self._events(beat)

    def _comment(self, text: str) -> None:
        """For people reading the stream, and proxies: not a sign of life every client counts
        (and nothing in a framing with no comments: its writer skips empty bytes)."""
        if self._writer is not None:
            self._writer.put(self._exchange.framing.comment(text), alive=False)

    def _fail(self, error: Exception) -> Answer:
        """An error after the stream opened: the format's failure events end it (the writer
        is closed by follow() even when those events cannot be built)."""
        public = self._exchange.error(self._connection.public_error(error))
        self._events(lambda: self._exchange.failed(public), last=True)
        return Answer(200)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
