"""Has a connected socket's peer closed its end? The one question about a client that the
thread running a request asks, at each prefill chunk and, while it generates, at most once
a millisecond (serve/service/generation.py, ASK_EVERY_S).

It lives below HTTP so that thread reads the kernel's word on the socket and
runs no HTTP code (docs/architecture.md, "The seams").
"""
from __future__ import annotations

import select
import socket
import threading

_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class Hangup:
    """Non-blocking: called, it says whether the peer has closed its end.

    A hangup flag says so even when unread bytes (say a pipelined request) are
    waiting; without one, readable yet nothing to read does.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        # Asked up to a thousand times a second, so registered once per connection; poll,
        # because select() cannot watch a descriptor numbered 1024 or above.
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | _HANGUP)
        # Asked by the job's thread and by the reader's: a poll object takes one at a time.
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        try:
            with self._lock:
                events = self._poll.poll(0)
            if not events:
                return False
            return bool(events[0][1] & _HANGUP) or self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True
