"""HTTP for the service: each request from its request line to its log line (connections:
serve/http/connections.py; routes: serve/http/routes.py; endpoints: serve/http/endpoints.py).

One thread per connection (ThreadingHTTPServer); generations serialize on the
engine queue inside the service, so /health and /v1/models still answer while
a reply is being written. What a generation sends goes through its exchange
(the wire format) and its sink (serve/http/sinks.py); this module speaks HTTP only.
"""
from __future__ import annotations

import json
import socket
import io
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional

from serve.core.hangup import Hangup
from serve.core.ids import new_id
from serve.core.errors import ApiError
from serve.engine.queue import ClientLeft
from serve.http import heap, request_line
from serve.http.answering import Ongoing
from serve.http.background import Keepers
from serve.http.auth import ANYONE, Keys, credential_digest, unauthorized
from serve.http.connections import DEFAULT_MAX_CONNECTIONS, ConnectionServer
from serve.http.json_body import parse_body
from serve.http.request_body import DeadlineReader, declared_length, has_body, read_exactly
from serve.http.request_line import ASTERISK, MAX_LINE, ROUTED_METHODS, SERVER_METHODS, origin_form
from serve.http.routes import allowed, endpoint_label, find_route, nearest_route, needs_key
from serve.dialects.sse import DEFAULT_HEARTBEAT, EventWriter
from serve.service.background_records import Records
from serve.service.facade import Service
from serve.service.models import Models

DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds for a whole request's headers and body, idle time included


class Server(ConnectionServer):
    """The service's HTTP server: its handler, key and timeouts."""

    def __init__(self, address: tuple[str, int], service: Service | Models, *,
                 api_key: Optional[str] = None, keys: Optional[Keys] = None,
                 metrics_open: bool = False,
                 log: Optional[Callable[[str], None]] = None, socket_timeout: float = 30.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 heartbeat: float = DEFAULT_HEARTBEAT, records: Optional[Records] = None):
        # Several models (serve/service/models.py) or one; `service` is the main model's,
        # which counts HTTP requests and keeps stored responses for all of them.
        self.models = service if isinstance(service, Models) else Models([service])
        self.service = self.models.main
        self.background = Keepers(records)   # background responses (serve/http/background.py)
        self.keys = keys or Keys(api_key)   # who may ask, and who asks (serve/http/auth.py)
        self.metrics_open = metrics_open     # /metrics answers without a key (--metrics-open)
        self.heartbeat = heartbeat  # seconds a stream may stay silent (serve/dialects/sse.py)
        self.socket_timeout = socket_timeout  # bounds each send to a client that stopped reading
        self.request_timeout = request_timeout
        self._unread: set[tuple[str, str]] = set()   # (endpoint, field) already named in the log
        self._unread_lock = threading.Lock()
        heap.map_large_blocks()   # what a large body held goes back once it is freed
        super().__init__(address, Handler, log=log, max_connections=max_connections)
        # Behind a router, every reply says which host wrote it (docs/serving-a-team.md).
        self.host_id = f"{socket.gethostname()}:{self.port}"
        self._logged: set[str] = set()
        self._logged_lock = threading.Lock()

    def log_line(self, line: str) -> None:
        """A line in the log, when there is one."""
        if self.log is not None:
            self.log(line)

    def log_once(self, key: str, line: str) -> None:
        """A log line said once per server, for what would otherwise repeat on every request."""
        with self._logged_lock:
            if key in self._logged or self.log is None:
                return
            self._logged.add(key)
        self.log(line)


    def note_unread(self, endpoint: str, fields: list[str]) -> None:
        """Name in the log, once per endpoint and field, body fields the server does not read."""
        if self.log is None:
            return
        with self._unread_lock:
            new = [f for f in fields if (endpoint, f) not in self._unread]
            self._unread.update((endpoint, f) for f in new)
        if new:
            self.log(f"{endpoint}: request fields this server does not read, ignored (named "
                     f"once): {', '.join(new)}")


class Handler(BaseHTTPRequestHandler):
    """A connection's requests, one at a time, each answered once, logged once, counted once.

    A request goes through, in this order:

    1. `handle_one_request` reads the request line within the request's deadline
       (`deadline`: the idle wait, the headers and the body share it). No line: the
       connection ends, and there is nothing to answer.
    2. `server.answering()` takes the in-flight count that shutdown waits for, around
       everything that follows; it is taken and given back there and nowhere else.
    3. `_answer` opens the request's record (`current`: its id, clock, status) and
       `_parse` has the standard library read the line and headers; what it refuses
       comes to `send_error`, which keeps it to be raised. The method must be one the
       routes answer and the target one of RFC 9112's forms, made a path
       (serve/http/request_line.py); `OPTIONS *` is answered here.
    4. `_route` finds the route (serve/http/routes.py), checks the API key and the
       method (the key's person: `current.principal`, serve/http/auth.py), and calls its
       endpoint (serve/http/endpoints.py), which reads the body (`read_json`) and answers
       with `send` or `send_json`, or runs a generation through
       serve/http/job_start.py's `generate`: the job starts, and its sink
       (serve/http/sinks.py) writes through `open_stream`, down to the socket;
       nothing below calls back up into the endpoints.
    5. Whatever is raised becomes an error response in the shape of the route's API
       (`current.shape`), or ends a stream already open; then, always, one log line,
       one count in /metrics, and the heap trimmed after a large body.

    Attributes it sets besides BaseHTTPRequestHandler's own (command, path, headers,
    request_version, close_connection, ...): `timeout`, `rfile` (reads that keep the deadline),
    `deadline`, `current`, `_refused` (the standard library's refusal while it parses) and
    `_hangup` (serve/core/hangup.py: has the client closed its end?).
    """
    protocol_version = "HTTP/1.1"
    server_version = "serve"
    disable_nagle_algorithm = True   # a stream's small events: Nagle would hold each one back
    server: Server

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout  # type: ignore[misc]  # per server, not per class
        super().setup()
        self.deadline = 0.0
        self.current = Ongoing("-")
        self._refused: Optional[ApiError] = None
        self.rfile.close()  # the plain socket file, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, lambda: self.deadline))
        self._hangup = Hangup(self.connection)

    @property
    def request_id(self) -> str:
        return self.current.request_id

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.server.request_timeout
        try:
            self.raw_requestline = self.rfile.readline(MAX_LINE + 1)
            while self.raw_requestline in (b"\r\n", b"\n"):  # RFC 9112 2.2: ignored before a request
                self.raw_requestline = self.rfile.readline(MAX_LINE + 1)
        except TimeoutError:
            self.raw_requestline = b""   # an idle connection's time is up: nothing was asked
        if not self.raw_requestline:
            self.close_connection = True
            return
        with self.server.answering():
            self._answer()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request is written by _log instead

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        # Called by the standard library's parse_request, which then returns False.
        self._refused = request_line.refusal(code, message)

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        super().send_response(code, message)
        self.send_header("X-Request-Id", self.request_id)
        self.send_header("X-Serve-Host", self.server.host_id)

    # -- a request ----------------------------------------------------------------------

    def _answer(self) -> None:
        self.current = Ongoing(new_id("req"))
        try:
            self._route(self._parse())
        except ClientLeft:
            self.current.status = 499  # nginx's code for a client that left before its answer
            self.close_connection = True
        except Exception as e:  # anything unexpected is the server's fault, and must not kill it
            if self.current.streaming:
                # Its sink has ended the stream; a second response inside it would corrupt it.
                self.public_error(e)   # logged
                self.close_connection = True
            elif isinstance(e, ApiError):
                self.send_json(e.status, self.error_body(e), e.headers)
            else:
                self.send_json(500, self.error_body(e))
        finally:
            self._log()
            self._count()   # a stream, or a client that left: nothing was sent to count before
            if self.current.body_bytes >= heap.TRIM_AFTER_BYTES:
                heap.give_back()   # what its text and values held, once they are gone

    def _parse(self) -> str:
        """The request's path (or "*"), its line and headers read; the ApiError refusing them."""
        self._refused = None
        try:
            if len(self.raw_requestline) > MAX_LINE:
                self.command, self.requestline = "", ""
                raise request_line.refusal(414, None)
            try:
                parsed = self.parse_request()
            except TimeoutError:
                raise ApiError(408, f"the request was not received within "
                                    f"{self.server.request_timeout:g} seconds",
                               code="request_timeout") from None
            except ConnectionError:
                raise ClientLeft() from None
            if not parsed:
                raise self._refused or request_line.refusal(400, "Bad request syntax")
        except ApiError:
            # A line refused before its version was taken is answered in this server's (with a
            # status line: HTTP/0.9's replies have none), and what follows it is not read.
            self.request_version, self.close_connection = self.protocol_version, True
            raise
        finally:
            self.connection.settimeout(self.timeout)  # sends are bounded per send, not by the deadline
            if self.command:   # the line was read, whether or not its headers were: for the log
                self.current.path = self.path.split("?", 1)[0]
        routed = self.command in ROUTED_METHODS
        if routed:   # else a 501 whatever its target (CONNECT's is a host, no path)
            self.path = origin_form(self.path)
        path = self.current.path = self.path.split("?", 1)[0]
        self.current.endpoint = endpoint_label(path)
        # Clients read errors in the shape of the API they called (a path under one is its).
        self.current.shape = nearest_route(path).errors
        if not routed:
            raise request_line.unsupported(self.command)
        return path

    def _route(self, path: str) -> None:
        method = self.command
        if path == ASTERISK:
            if method != "OPTIONS":
                raise ApiError(400, "the request target * is for OPTIONS only",
                               code="invalid_request_line")
            # RFC 9110 9.3.7: about the server as a whole; no content, so Content-Length: 0.
            return self.send(200, "text/plain", b"", {"Allow": ", ".join(SERVER_METHODS)})
        route = find_route(path)
        # The key before the 404, so that endpoints cannot be enumerated.
        principal = self.server.keys.principal(self.headers)
        if principal is None and needs_key(route, self.server.metrics_open):
            self.close_connection = True  # the body, if any, is left unread
            raise unauthorized()
        self.current.principal = principal or ANYONE
        if route is None:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")
        if method == "HEAD" and "GET" in route.methods:
            method = "GET"
        if method not in route.methods:
            raise ApiError(405, f"{path} accepts {', '.join(route.methods)} only",
                           code="method_not_allowed", headers={"Allow": allowed(route)})
        route.answer(self, method, route.match(path) or "")   # it matched: a str

    def error_body(self, error: Exception) -> dict:
        """The body of `public_error(error)`, in the shape of the path's API."""
        return self.current.shape(self.public_error(error))

    def public_error(self, error: Exception) -> ApiError:
        """A client error as it is; a server error generic, its details only in the log."""
        if isinstance(error, ApiError) and error.status < 500:
            return error
        if isinstance(error, ApiError):
            return ApiError(error.status, f"{error.message} (request id {self.request_id})",
                            error.param, error.code, error.kind, error.headers)
        self.server.error_log(f"{self.request_id} internal error: {type(error).__name__}: {error}")
        return ApiError(500, f"internal error (request id {self.request_id})", kind="server_error")

    @property
    def owner(self) -> str:
        """Who may reach what the request starts (a job, a background response): its person,
        and the credentials it sent (told apart even where no keys are set)."""
        return f"{self.current.principal.namespace}\n{credential_digest(self.headers)}"

    @property
    def client_left(self) -> Hangup:
        """Has the client closed its end? Read by the thread running its request."""
        return self._hangup

    # -- the connection, for sinks (serve/http/sinks.py's Connection) -------------------------

    def open_stream(self, content_type: str, on_silence: Callable[[], None],
                    on_failed: Callable[[], None]) -> EventWriter:
        self.current.status = 200
        self.current.streaming = True
        self.close_connection = True  # the stream ends when the connection does
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        for name, value in self.current.reply_headers.items():
            self.send_header(name, value)
        chunked = self.request_version == "HTTP/1.1"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        writer = EventWriter(self.wfile, chunked, sock=self.connection, heartbeat=self.server.heartbeat,
                             on_silence=on_silence, on_failed=on_failed)
        writer.start()
        return writer

    # -- the body -----------------------------------------------------------------------

    def read_json(self) -> dict:
        """The body; its `model` is noted (the body itself is not kept: it may be tens of
        megabytes)."""
        body = parse_body(self._read_body())
        named = body.get("model")
        self.current.named_model = named if isinstance(named, str) else None
        return body

    def _read_body(self) -> bytearray:
        # Any refusal here leaves unread bytes on the connection, so it is closed;
        # a body read whole leaves it as the client asked (HTTP/1.0, Connection: close).
        self.current.body_read = True
        asked_to_close, self.close_connection = self.close_connection, True
        self.current.body_bytes = length = declared_length(self.headers)
        body = read_exactly(self.rfile, length, self.server.request_timeout)
        self.connection.settimeout(self.timeout)
        self.close_connection = asked_to_close
        return body

    def _discard_body(self) -> None:
        """Read and drop a body no endpoint read (an early error, a GET that came with one),
        so the next request on the connection is parsed from where it starts."""
        if self.current.body_read or self.close_connection or not has_body(self.headers):
            return
        try:
            self._read_body()
        except ApiError:
            pass  # a body whose end cannot be found, or too large: _read_body closes the connection

    # -- the response -------------------------------------------------------------------

    def send_json(self, status: int, payload: Any, headers: Optional[dict[str, str]] = None) -> None:
        self.send(status, "application/json", json.dumps(payload, ensure_ascii=False).encode(),
                  headers)

    def send(self, status: int, content_type: str, body: bytes,
             headers: Optional[dict[str, str]] = None) -> None:
        self._discard_body()
        self.current.status = status
        self._count()   # before the client has its answer, so that a scrape after it counts it
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":  # HEAD gets the GET's headers, and no body
                self.wfile.write(body)
        except OSError:
            self.close_connection = True  # the client is gone; nothing left to tell it

    def _count(self) -> None:
        if not self.current.counted:
            self.current.counted = True
            self.server.service.metrics.request(self.current.endpoint, self.current.status)

    def _log(self) -> None:
        if self.server.log is not None:
            ms = (time.monotonic() - self.current.started) * 1000.0
            # A line refused before its method was read is logged as it came (its first 200).
            what = (f"{self.command} {self.current.path}" if self.command
                    else repr(self.requestline[:200]))
            self.server.log(f"{self.address_string()} {what} {self.current.status} "
                            f"tokens={self.current.tokens} {ms:.0f}ms id={self.request_id}"
                            + (f" ({self.current.timing})" if self.current.timing else "")
                            + self.current.answered_by + self.current.who)
