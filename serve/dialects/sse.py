"""Server-sent events: the framing, and the writer thread that owns a stream's socket.

Once a stream opens, every byte of it goes through its `EventWriter`: the
thread that makes the stream's events only queues, so a slow client never
stalls them, and the writer is the one place that sends. It also keeps the
clock of the stream's heartbeat: after `heartbeat` seconds without a sign of
life it asks for one, so a prefill chunk that lasts minutes (a call the engine
thread cannot leave) never leaves the client in silence long enough to give up.
"""
from __future__ import annotations

import io
import json
import queue
import threading
import time
from typing import IO, Any, Callable, Optional

SEND_GAP = 0.01  # seconds between two sends of one stream, at most (see EventWriter)
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
    """Sends one stream's bytes from its own thread, at most one send per SEND_GAP.

    A model slower than one token per SEND_GAP (every real one) gets each token
    sent the moment it exists; a faster one has its tokens gathered into one
    send per SEND_GAP instead of paying a socket round trip per token, for at
    most SEND_GAP of added latency.

    Bytes are queued as signs of life (events a client counts) or not (comments,
    which some clients drop before their idle timers see them). After
    `heartbeat` seconds without a sign of life sent, `on_silence()` is called,
    from this thread, to queue one. When a send fails (the client went away),
    `on_failed()` is called, once, from this thread.
    """

    def __init__(self, wfile: IO[bytes] | io.BufferedIOBase, chunked: bool = False, *, heartbeat: float = 0.0,
                 on_silence: Optional[Callable[[], None]] = None,
                 on_failed: Optional[Callable[[], None]] = None):
        super().__init__(name="sse-writer", daemon=True)
        self._wfile = wfile
        # HTTP/1.1 chunked framing: only a finished stream ends with the last chunk, so one
        # cut by a dying server is told apart from a finished one, through a proxy too.
        self._chunked = chunked
        self._heartbeat = heartbeat if on_silence is not None else 0.0   # 0: no heartbeat
        self._on_silence = on_silence or (lambda: None)
        self._on_failed = on_failed or (lambda: None)
        self._queue: "queue.SimpleQueue[Optional[tuple[bytes, bool]]]" = queue.SimpleQueue()
        self.failed = False  # the client went away mid-stream

    def put(self, data: bytes, alive: bool = True) -> None:
        """Queue bytes to send; `alive`: clients count them as a sign of life (not a comment)."""
        if data:
            self._queue.put((data, alive))

    def close(self) -> None:
        """Send everything queued so far, then stop; once stopped, closing again does nothing."""
        self._queue.put(None)
        self.join()

    def run(self) -> None:
        done, last_send, alive_at = False, 0.0, time.monotonic()
        while not done:
            try:
                batch = [self._queue.get(timeout=self._silence_left(alive_at))]
            except queue.Empty:
                # Queued, not sent from here: the heartbeat goes out after whatever events
                # were queued before it, so the stream's events stay in order.
                self._on_silence()
                alive_at = time.monotonic()   # even when nothing was queued: no busy loop
                continue
            pause = last_send + SEND_GAP - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # tokens are coming faster than anyone reads them
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            items = [item for item in batch if item is not None]
            data = b"".join(data for data, _ in items)
            if self._chunked:
                data = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"0\r\n\r\n" if done else b"")
            if data and not self.failed:
                try:
                    self._wfile.write(data)
                except OSError:
                    self.failed = True
                    self._on_failed()
                last_send = time.monotonic()
                if any(alive for _, alive in items):
                    alive_at = last_send

    def _silence_left(self, alive_at: float) -> Optional[float]:
        """Seconds until the next heartbeat is due; None (wait for bytes) when there is none."""
        if not self._heartbeat or self.failed:
            return None
        return max(0.0, alive_at + self._heartbeat - time.monotonic())
