"""Connections for an HTTP server: a bounded number, accepted gently, counted for shutdown.

A server at its connection limit answers a new connection with a 503 without
starting a thread for it; when accept() fails for want of descriptors it backs
off instead of spinning a core; and it counts the requests being answered, so
shutdown can wait for cut streams to send their last events.
"""
from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Iterator, Optional

from serve.core.errors import error_body
from serve.engine.queue import RETRY_AFTER_SECONDS

DEFAULT_MAX_CONNECTIONS = 64
MAX_ACCEPT_BACKOFF = 1.0        # seconds between accept attempts while descriptors are exhausted
# accept() failures that persist while the listening socket stays readable
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ConnectionServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: a burst of connects must not wait for SYN retries

    def __init__(self, address: tuple[str, int], handler: type, *,
                 log: Optional[Callable[[str], None]] = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.log = log
        self.max_connections = max_connections
        self._count = threading.Condition()
        self._connections = 0  # open, each with its thread
        self._requests = 0     # being answered
        self._backoff = 0.0
        super().__init__(address, handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def error_log(self, line: str) -> None:
        """Failures are logged even with --quiet: the client was only told a request id."""
        (self.log or stderr_log)(line)

    # -- connections --------------------------------------------------------------------

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            accepted = super().get_request()
        except OSError as e:
            if e.errno in _RESOURCE_ERRORS:
                # The pending connection keeps the socket readable: retrying at once spins a core.
                if not self._backoff:
                    self.error_log(f"accept failed: {e.strerror}; backing off until it succeeds")
                self._backoff = min(MAX_ACCEPT_BACKOFF, max(0.01, self._backoff * 2))
                time.sleep(self._backoff)
            raise
        self._backoff = 0.0
        return accepted

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count:
            full = self._connections >= self.max_connections
            if not full:
                self._connections += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed_one()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed_one()

    def _closed_one(self) -> None:
        with self._count:
            self._connections -= 1

    def _refuse(self, request: socket.socket) -> None:
        """A 503 without a thread: written whole into the empty send buffer, then closed."""
        body = json.dumps(error_body(f"the server has {self.max_connections} connections open; "
                                     "try again later", "server_error",
                                     code="too_many_connections")).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_SECONDS}\r\n"
                "Connection: close\r\n\r\n")
        try:
            request.setblocking(False)
            request.send(head.encode() + body)
            request.shutdown(socket.SHUT_WR)
            while request.recv(65536):  # what the client sent, so closing does not reset
                pass
        except OSError:
            pass
        request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            # A client that resets or stalls is ordinary: one line, not a traceback.
            if self.log is not None:
                self.log(f"{client_address[0]} connection ended: {error.strerror or error}")
            return
        super().handle_error(request, client_address)

    # -- requests, for shutdown ---------------------------------------------------------

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Around each request from its request line to its log line: the one place the count
        that shutdown waits for is taken and given back."""
        with self._count:
            self._requests += 1
        try:
            yield
        finally:
            with self._count:
                self._requests -= 1
                self._count.notify_all()

    def wait_requests(self, timeout: float) -> bool:
        """Wait until no request is being answered (cut streams send their last events)."""
        with self._count:
            return self._count.wait_for(lambda: self._requests == 0, timeout)


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
