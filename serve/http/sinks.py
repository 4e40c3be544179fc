"""The sink of every generation request: the service's output, through an exchange, to the client.

A streamed reply opens its event stream as soon as the request is accepted or
waits in line, and from then on every byte goes through the stream's writer;
a blocking reply sends one body at the end. Both feed the exchange the same
deltas. The exchange's opening events wait until the prompt's size is known,
so they can say it, unless a heartbeat is due first. The sink knows the
connection only through `Connection`: it never writes a response itself, and
tells the handler what to log.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Optional, Protocol

from serve.core.reply import Delta
from serve.core.errors import ApiError
from serve.engine.queue import ClientGone
from serve.dialects.exchange import R, Exchange
from serve.service.replies import ReplyStart
from serve.dialects.sse import EventWriter, sse_comment


class Connection(Protocol):
    def open_stream(self, on_silence: Callable[[], None]) -> EventWriter:
        """Send an event stream's headers; its bytes then go through the returned writer,
        which calls `on_silence` from its own thread when the stream needs a heartbeat."""

    def client_gone(self) -> bool:
        """Non-blocking: has the client closed its end?"""

    def public_error(self, error: Exception) -> ApiError:
        """What the client may be told of an error."""


@dataclass(frozen=True)
class Answer:
    """What the handler sends and logs once a generation is over."""
    status: int                    # for the log (a stream has sent its own already)
    tokens: int = 0
    body: Optional[dict] = None    # a blocking reply's body, still to send
    timing: str = ""               # for the log: where the time went (ExchangeSink._timing)


class ExchangeSink(Generic[R]):
    def __init__(self, connection: Connection, exchange: Exchange[R]):
        self._connection = connection
        self._exchange: Exchange[R] = exchange
        self._stream = exchange.request.stream
        self._writer: Optional[EventWriter] = None
        # The exchange's events are made and queued under one lock: the engine thread's
        # and the writer's heartbeats share its state (sequence numbers, the open block).
        self._lock = threading.Lock()
        self._start = ReplyStart()
        self._opened = False     # the exchange's opening events are queued
        self._ended = False      # so are its last ones: no heartbeat may follow
        # For the log line: when the request got the engine and its first token came.
        self._began = time.monotonic()
        self._engine_at: Optional[float] = None
        self._first_at: Optional[float] = None

    # -- the service's ReplySink --------------------------------------------------------

    def accepted(self, thinking: bool) -> None:
        self._start = replace(self._start, thinking=thinking)

    def queued(self, ahead: int) -> None:
        # While the request waits for the engine, the stream is already open and says so.
        if self._stream:
            self._open()
            self._comment(f"queue {ahead}")

    def start(self) -> None:
        self._engine_at = time.monotonic()
        if self._stream:
            self._open()

    def prefilling(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._start = replace(self._start, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        self._events(lambda: b"")   # the opening, now that it can say the prompt's size

    def progress(self, done: int, total: int) -> None:
        self._comment(f"prefill {done}/{total}")

    def emit(self, delta: Delta) -> None:
        if self._first_at is None:
            self._first_at = time.monotonic()
        self._events(lambda: self._exchange.delta(delta))

    def gone(self) -> bool:
        return (self._writer is not None and self._writer.failed) or self._connection.client_gone()

    # -- running it ----------------------------------------------------------------------

    def run(self, generate: Callable[["ExchangeSink[R]"], R]) -> Answer:
        """Runs the generation. Errors before the stream opens are ordinary HTTP errors, in
        the format's field names; after, the format's failure events end the stream."""
        try:
            return self._run(generate)
        finally:
            self._close()   # however the run ends, the writer thread ends too

    def _run(self, generate: Callable[["ExchangeSink[R]"], R]) -> Answer:
        try:
            reply = generate(self)
        except ApiError as e:
            if self._writer is None:
                raise self._exchange.error(e) from None
            return self._fail(e)
        except ClientGone:
            raise
        except Exception as e:
            if self._writer is None:
                raise
            return self._fail(e)
        tokens = reply.usage.completion_tokens
        if reply.client_gone:
            return Answer(499, tokens, timing=self._timing())
        self._exchange.keep(reply)
        if self._writer is None:
            return Answer(200, tokens, self._exchange.body(reply), self._timing())
        self._events(lambda: self._exchange.closing(reply), last=True)
        return Answer(200, tokens, timing=self._timing())

    def _timing(self) -> str:
        """Where a generation's time went: waiting for the engine, the prompt's positions (those
        restored from a snapshot are not prefilled), and its first token."""
        def ms(at: Optional[float]) -> str:
            return "-" if at is None else f"{(at - self._began) * 1000:.0f}ms"
        return (f"engine at {ms(self._engine_at)}, prompt {self._start.prompt_tokens} "
                f"({self._start.cached_tokens} restored), first token at {ms(self._first_at)}")

    def _open(self) -> None:
        if self._writer is None:  # else already open: the request waited in line
            self._writer = self._connection.open_stream(self._heartbeat)

    def _events(self, make: Callable[[], bytes], last: bool = False) -> None:
        """The exchange's bytes from `make()`, queued after its opening events; nothing after
        its `last` ones. A blocking reply sends nothing, but `make()` still runs: its body
        may be built from the deltas."""
        with self._lock:
            if self._writer is None:
                make()
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
        (the request waits in line), then the format's heartbeat."""
        self._events(lambda: self._exchange.heartbeat(self._start))

    def _comment(self, text: str) -> None:
        """For people reading the stream, and proxies: not a sign of life every client counts."""
        if self._writer is not None:
            self._writer.put(sse_comment(text), alive=False)

    def _fail(self, error: Exception) -> Answer:
        """An error after the stream opened: the format's failure events end it (the writer
        is closed by run() even when those events cannot be built)."""
        public = self._exchange.error(self._connection.public_error(error))
        self._events(lambda: self._exchange.failed(public), last=True)
        return Answer(200)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
