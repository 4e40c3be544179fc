"""Server-sent events: the framing, and the writer thread that owns a stream's socket.

Once a stream opens, every byte of it goes through its `EventWriter`: the
thread that makes the stream's events sends them itself only when the socket
takes them at once, and otherwise queues them for the writer's thread, so a
slow client never stalls it, and bytes never go out of order. It also keeps the
clock of the stream's heartbeat: after `heartbeat` seconds without a sign of
life it asks for one, so a prefill chunk that lasts minutes (a call the engine
thread cannot leave) never leaves the client in silence long enough to give up.
"""
from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
from typing import IO, Any, Callable, Optional

# Seconds of silence before a stream's heartbeat: well under the 300 s after which Claude Code
# and Codex give up on a stream, and rare enough to cost nothing.
DEFAULT_HEARTBEAT = 10.0
SSE_DONE = b"data: [DONE]\n\n"

_JSON = json.JSONEncoder(ensure_ascii=False)
# JSONEncoder.encode builds its C encoder anew on each call, which costs twice the encoding of
# a token's event; this one is built once (no circular check: a payload is a tree of plain
# values), and gives the same text.
_ENCODE = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _JSON.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, True
) if json.encoder.c_make_encoder is not None else None  # type: ignore[attr-defined]
# Stands where the varying part of a chunk goes, to cut the chunk's encoding in two.
_PLACEHOLDER = {"\u0000placeholder": 0}


def json_text(payload: Any) -> str:
    """`json.dumps(payload, ensure_ascii=False)`, at the cost of the encoding alone."""
    if _ENCODE is None or isinstance(payload, str):
        return _JSON.encode(payload)
    return "".join(_ENCODE(payload, 0))


def sse_event(payload: Any) -> bytes:
    return b"data: " + json_text(payload).encode() + b"\n\n"


def sse_named(events: list[dict]) -> bytes:
    """Events of the Anthropic and Responses streams: each one's `type` is its SSE event name."""
    return b"".join(b"event: " + event["type"].encode() + b"\n" + sse_event(event) for event in events)


def sse_comment(text: str) -> bytes:
    """A line every client ignores: for people reading the stream, and for proxies' timeouts."""
    return f": {text}\n\n".encode()


def sse_encoder(chunk: Callable[[Any], dict]) -> Callable[[Any], bytes]:
    """`part -> sse_event(chunk(part))`, byte for byte, encoding only the part per call.

    A stream's chunks differ only in one value (a chat delta, a completion's
    text), and this runs once per token.
    """
    head, tail = sse_event(chunk(_PLACEHOLDER)).split(json_text(_PLACEHOLDER).encode())
    return lambda part: head + json_text(part).encode() + tail


class EventWriter(threading.Thread):
    """Sends one stream's bytes, each event the moment it is queued, never blocking the caller.

    An event put while nothing is being sent is sent at once by the caller's
    thread, with a send that cannot block (no hand-off to another thread, which
    costs more than the send itself on a fast model). Whatever cannot go out so
    (a send already running, a socket buffer full because the client reads
    slower than the model writes) waits for this writer's own thread, which
    sends all that waits in one system call: the events stay apart, their bytes
    unchanged, and a lone event is never held back to wait for company.

    Bytes are queued as signs of life (events a client counts) or not (comments,
    which some clients drop before their idle timers see them). After
    `heartbeat` seconds without a sign of life sent, `on_silence()` is called,
    from this thread, to queue one. When a send fails (the client went away),
    `on_failed()` is called, once.
    """

    def __init__(self, wfile: IO[bytes] | io.BufferedIOBase, chunked: bool = False, *,
                 sock: Optional[socket.socket] = None, heartbeat: float = 0.0,
                 on_silence: Optional[Callable[[], None]] = None,
                 on_failed: Optional[Callable[[], None]] = None):
        """`sock`: the socket under `wfile`. With a timeout set, its descriptor does not block,
        and the caller's thread sends at once; without one, every send is this thread's."""
        super().__init__(name="sse-writer", daemon=True)
        self._wfile = wfile
        self._fd = sock.fileno() if sock is not None and not os.get_blocking(sock.fileno()) else -1
        # HTTP/1.1 chunked framing: only a finished stream ends with the last chunk, so one
        # cut by a dying server is told apart from a finished one, through a proxy too.
        self._chunked = chunked
        self._heartbeat = heartbeat if on_silence is not None else 0.0   # 0: no heartbeat
        self._on_silence = on_silence or (lambda: None)
        self._on_failed = on_failed or (lambda: None)
        self._cond = threading.Condition()
        self._waiting: list[bytes] = []   # framed bytes not sent yet, in order
        self._sending = False             # a thread is sending: the others only queue
        self._closing = False
        self._alive_at = time.monotonic()  # when the last sign of life was queued to go
        self.failed = False  # the client went away mid-stream

    def put(self, data: bytes, alive: bool = True) -> None:
        """Send bytes, or queue them; `alive`: clients count them as a sign of life (not a
        comment)."""
        if not data:
            return
        framed = b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data
        with self._cond:
            if alive:
                self._alive_at = time.monotonic()
            if self._sending or self._waiting or self._closing or self.failed or self._fd < 0:
                if not self.failed:
                    self._waiting.append(framed)
                    self._cond.notify()
                return
            self._sending = True
        try:
            sent = os.write(self._fd, framed)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = len(framed)
            self._fail()
        with self._cond:
            self._sending = False
            if sent < len(framed):
                self._waiting.insert(0, framed[sent:])   # before anything queued meanwhile
            if self._waiting or self._closing:   # the writer waits for this send to end
                self._cond.notify()

    def close(self) -> None:
        """Send everything queued so far, then stop; once stopped, closing again does nothing."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self.join()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (self._sending or not self._waiting):
                    left = self._silence_left()
                    if left == 0.0:
                        break
                    self._cond.wait(left)
                if not self._waiting and not self._closing:
                    # A heartbeat is due. Queued, not sent from here: it goes out after
                    # whatever events were queued before it, so the stream's events stay in order.
                    self._alive_at = time.monotonic()   # even when nothing is queued: no busy loop
                    heartbeat = True
                else:
                    heartbeat = False
                    while self._sending:   # the caller's send ends at once: it cannot block
                        self._cond.wait()
                    data, self._waiting = b"".join(self._waiting), []
                    done = self._closing
                    self._sending = True
            if heartbeat:
                self._on_silence()
                continue
            if done and self._chunked:
                data += b"0\r\n\r\n"
            if data and not self.failed:
                try:
                    self._wfile.write(data)
                except OSError:
                    self._fail()
            with self._cond:
                self._sending = False
                if done and not self._waiting:
                    return

    def _fail(self) -> None:
        if not self.failed:
            self.failed = True
            self._on_failed()

    def _silence_left(self) -> Optional[float]:
        """Seconds until the next heartbeat is due; None (wait for bytes) when there is none."""
        if not self._heartbeat or self.failed:
            return None
        return max(0.0, self._alive_at + self._heartbeat - time.monotonic())
