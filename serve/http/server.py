"""HTTP for the service: routes, auth, request bodies and responses (connections: serve/http/connections.py).

One thread per connection (ThreadingHTTPServer); generations serialize on the
engine queue inside the service, so /health and /v1/models still answer while
a reply is being written. What a generation sends goes through its exchange
(the wire format) and its sink (serve/http/sinks.py); this module speaks HTTP only.
"""
from __future__ import annotations

import hmac
import io
import json
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl

from serve.dialects import anthropic

from serve.core import api

from serve.http import heap

from serve.service import metrics

from serve.dialects import openai

from serve.dialects import responses
from serve.core.api import ApiError
from serve.http.connections import DEFAULT_MAX_CONNECTIONS, ConnectionServer
from serve.engine.queue import ClientGone
from serve.dialects.exchange import R, Exchange
from serve.dialects.input_items import listing
from serve.http.json_body import MAX_BODY_BYTES, parse_body
from serve.http.page import CONTENT_TYPE as PAGE_TYPE, chat_page
from serve.service.response_store import Stored
from serve.service.facade import Service
from serve.service.replies import ChatReply, CompletionReply
from serve.service.models import Models
from serve.http.sinks import Answer, BlockingSink, ExchangeSink
from serve.dialects.sse import DEFAULT_HEARTBEAT, EventWriter

DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds for a whole request's headers and body, idle time included
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class Server(ConnectionServer):
    """The service's HTTP server: its handler, key and timeouts."""

    def __init__(self, address: tuple[str, int], service: Service | Models, *,
                 api_key: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None, socket_timeout: float = 30.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 heartbeat: float = DEFAULT_HEARTBEAT):
        # Several models (serve/service/models.py) or one; `service` is the main model's,
        # which counts HTTP requests and keeps stored responses for all of them.
        self.models = service if isinstance(service, Models) else Models([service])
        self.service = self.models.main
        self.api_key = api_key
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


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the request's deadline.

    A per-read timeout lets a client that trickles a byte at a time hold its
    thread forever (slowloris); this bounds the whole request instead.
    """

    def __init__(self, handler: "Handler"):
        super().__init__()
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took longer than its deadline")
        self._handler.connection.settimeout(left)
        return self._handler.connection.recv_into(buffer)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "serve"
    server: Server

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout  # type: ignore[misc]  # per server, not per class
        super().setup()
        self.deadline = 0.0
        self.request_id = "-"
        self.rfile.close()  # the plain socket file, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self))
        # Asked once per generated token, so registered once per connection; poll,
        # because select() cannot watch a descriptor numbered 1024 or above.
        self._hangup = select.poll()
        self._hangup.register(self.connection, select.POLLIN | _HANGUP)

    def handle_one_request(self) -> None:
        # Headers and body, and the idle wait before them, share one deadline.
        self.deadline = time.monotonic() + self.server.request_timeout
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request is written by _log instead

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        super().send_response(code, message)
        self.send_header("X-Request-Id", self.request_id)
        self.send_header("X-Serve-Host", self.server.host_id)

    # -- dispatch -----------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        # For the request's log line.
        self._started = time.monotonic()
        self.status = 0
        self.tokens = 0
        self.request_id = api.new_id("req")
        self.connection.settimeout(self.timeout)  # sends are bounded per send, not by the deadline
        self._body_read = False
        self._named_model: Optional[str] = None   # the body's `model`
        self._answered_by = ""
        self._body_bytes = 0
        self.streaming = False   # an event stream's headers have gone out
        self._reply_headers: dict[str, str] = {}   # what a generation's reply carries
        path = self.path.split("?", 1)[0]
        self._counted = False
        self._endpoint = endpoint_label(path)
        self.server.request_started()
        route = find_route(path)
        # Clients read errors in the shape of the API they called (a path under one is its).
        self._shape = (route or nearest_route(path)).errors
        try:
            self._route(route, method, path)
        except ClientGone:
            self.status = 499  # nginx's code for a client that left before its answer
            self.close_connection = True
        except Exception as e:  # anything unexpected is the server's fault, and must not kill it
            if self.streaming:
                # Its sink has ended the stream; a second response inside it would corrupt it.
                self.public_error(e)   # logged
                self.close_connection = True
            elif isinstance(e, ApiError):
                self._send_json(e.status, self.error_body(e), e.headers)
            else:
                self._send_json(500, self.error_body(e))
        finally:
            self.server.request_finished()
            self._log(method, path)
            self._count()   # a stream, or a client that left: nothing was sent to count before
            if self._body_bytes >= heap.TRIM_AFTER_BYTES:
                heap.give_back()   # what its text and values held, once they are gone

    def error_body(self, error: Exception) -> dict:
        """The body of `public_error(error)`, in the shape of the path's dialect."""
        return self._shape(self.public_error(error))

    def public_error(self, error: Exception) -> ApiError:
        """A client error as it is; a server error generic, its details only in the log."""
        if isinstance(error, ApiError) and error.status < 500:
            return error
        if isinstance(error, ApiError):
            return ApiError(error.status, f"{error.message} (request id {self.request_id})",
                            error.param, error.code, error.kind, error.headers)
        self.server.error_log(f"{self.request_id} internal error: {type(error).__name__}: {error}")
        return ApiError(500, f"internal error (request id {self.request_id})", kind="server_error")

    def _route(self, route: Optional["Route"], method: str, path: str) -> None:
        if route is None or not route.open:
            self._check_auth()  # before the 404, so that endpoints cannot be enumerated
        if route is None:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")
        if method == "HEAD" and "GET" in route.methods:
            method = "GET"
        if method not in route.methods:
            raise ApiError(405, f"{path} accepts {', '.join(route.methods)} only",
                           code="method_not_allowed")
        route.answer(self, method, route.match(path) or "")   # it matched: a str

    def _check_auth(self) -> None:
        key = self.server.api_key
        if not key:
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        bearer = hmac.compare_digest(given.strip().encode(), key.encode()) and scheme.lower() == "bearer"
        # Anthropic's clients send the key as x-api-key.
        anthropic_key = self.headers.get("x-api-key", "").strip().encode()
        if not (bearer or hmac.compare_digest(anthropic_key, key.encode())):
            self.close_connection = True  # the body, if any, is left unread
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    # -- the endpoints: (method, the path after the route's own) ------------------------

    def _health(self, method: str, rest: str) -> None:
        # A warm is idle-time work and requests are served meanwhile, so the answer is 200; its
        # "warming" member tells a router to send this host no new conversations until it is done.
        self._send_json(200, self.server.models.health())

    def _page(self, method: str, rest: str) -> None:
        page, policy = chat_page()
        self._send(200, PAGE_TYPE, page, {"Content-Security-Policy": policy,
                                          "X-Content-Type-Options": "nosniff",
                                          "Referrer-Policy": "no-referrer",
                                          "Cache-Control": "no-cache"})

    def _metrics(self, method: str, rest: str) -> None:
        self._send(200, metrics.CONTENT_TYPE, self.server.models.render_metrics())

    def _models(self, method: str, rest: str) -> None:
        self._send_json(200, {"object": "list", "data": self.server.models.listing()})

    def _model(self, method: str, model_id: str) -> None:
        service = self.server.models.named(model_id)
        if service is None:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                           code="model_not_found")
        self._send_json(200, service.model())

    # Each exchange is made naming the main model; _generate names the one that answers. The
    # body is not held past its parsing: it may be tens of megabytes.

    def _chat(self, method: str, rest: str) -> None:
        main = self.server.service.options.model_id
        self._generate(openai.ChatExchange(self._read_json(), main), _chat_on)

    def _complete(self, method: str, rest: str) -> None:
        main = self.server.service.options.model_id
        self._generate(openai.CompletionExchange(self._read_json(), main), _complete_on)

    def _messages(self, method: str, rest: str) -> None:
        exchange = anthropic.Exchange(self._read_json(), self.server.service.options.model_id)
        if exchange.billing is not None:
            self.server.log_once("billing", f"/v1/messages: {exchange.billing} is Claude Code's "
                                 "billing header, which changes on every request: it is left out "
                                 "of the prompt (logged once)")
        self._generate(exchange, _chat_on)

    def _responses(self, method: str, rest: str) -> None:
        service = self.server.service
        exchange = responses.Exchange(self._read_json(), service.responses, service.options.model_id)
        # The id the reply is stored under, for a router to remember this host by: the
        # response's next turn and its retrieval find it only here (docs/serving-a-team.md).
        self._generate(exchange, _chat_on,
                       {"X-Serve-Response-Id": exchange.id} if exchange.stored else {})

    def _count_tokens(self, method: str, rest: str) -> None:
        translation = anthropic.parse_request(self._read_json(), counting=True)
        translation.request.request_id = self.request_id
        service = self.server.models.pick(self._named_model, translation.request)
        try:
            count = service.count_chat(translation.request, BlockingSink(self))
        except ApiError as e:
            raise translation.error(e) from None
        self._send_json(200, {"input_tokens": count})

    def _stored_response(self, method: str, response_id: str) -> None:
        store = self.server.service.responses
        stored = self._stored(response_id)
        if method == "DELETE" and not store.delete(response_id):
            raise _not_stored(response_id)
        self._send_json(200, stored.response if method == "GET" else
                        {"id": response_id, "object": "response.deleted", "deleted": True})

    def _input_items(self, method: str, response_id: str) -> None:
        items = self._stored(response_id).input_items
        self._send_json(200, listing(items, dict(parse_qsl(self.path.partition("?")[2],
                                                           keep_blank_values=True))))

    def _cancel(self, method: str, response_id: str) -> None:
        self._stored(response_id)
        # As OpenAI answers for a response not made with background: true, the only kind
        # there is here (background is refused at creation).
        raise ApiError(400, "Cannot cancel a synchronous response: only responses created with "
                            "background: true can be cancelled, and this server runs none")

    def _stored(self, response_id: str) -> Stored:
        stored = self.server.service.responses.get(response_id)
        if stored is None:
            raise _not_stored(response_id)
        return stored

    def _generate(self, exchange: Exchange[R], run: Callable[[Service], Callable[[Any, Any], R]],
                  headers: Optional[dict[str, str]] = None) -> None:
        """One generation: blocking (one JSON body) or streamed, as the exchange's request says,
        by the model the body and its request pick; `headers` go with the reply, not with an
        error in its place."""
        self._reply_headers = headers or {}
        if exchange.left_out and self.server.log is not None:
            self.server.log(f"{self.path.split('?', 1)[0]}: tools left out (the server cannot "
                            f"run them): {', '.join(exchange.left_out)}")
        self.server.note_unread(self.path.split('?', 1)[0], exchange.ignored)
        exchange.request.request_id = self.request_id
        service = self.server.models.pick(self._named_model, exchange.request)
        exchange.model = service.options.model_id
        if len(self.server.models.services) > 1:
            self._answered_by = f" model={exchange.model}"   # for the log line
        answer: Answer = ExchangeSink(self, exchange).run(
            lambda sink: run(service)(exchange.request, sink))
        self.tokens = answer.tokens
        if answer.body is not None:
            self._send_json(answer.status, answer.body, self._reply_headers)
        else:
            self.status = answer.status

    # -- the connection, for sinks (serve/http/sinks.py's Connection) -------------------------

    def open_stream(self, on_silence: Callable[[], None]) -> EventWriter:
        self.status = 200
        self.streaming = True
        self.close_connection = True  # the stream ends when the connection does
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        for name, value in self._reply_headers.items():
            self.send_header(name, value)
        chunked = self.request_version == "HTTP/1.1"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        writer = EventWriter(self.wfile, chunked, heartbeat=self.server.heartbeat,
                             on_silence=on_silence)
        writer.start()
        return writer

    def client_gone(self) -> bool:
        """Non-blocking: has the peer closed its end?

        A hangup flag says so even when unread bytes (say a pipelined request)
        are waiting; without one, readable yet nothing to read does.
        """
        try:
            events = self._hangup.poll(0)
            if not events:
                return False
            return bool(events[0][1] & _HANGUP) or self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # -- request bodies -----------------------------------------------------------------

    def _read_json(self) -> dict:
        body = parse_body(self._read_body())
        named = body.get("model")
        self._named_model = named if isinstance(named, str) else None   # which model answers
        return body

    def _read_body(self) -> bytearray:
        # Any refusal here leaves unread bytes on the connection, so it is closed;
        # a body read whole leaves it as the client asked (HTTP/1.0, Connection: close).
        self._body_read = True
        asked_to_close, self.close_connection = self.close_connection, True
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(411, "chunked request bodies are not accepted; send Content-Length",
                           code="length_required")
        declared = self.headers.get_all("Content-Length") or []
        if not declared:
            raise ApiError(411, "a request body needs a Content-Length", code="length_required")
        # Digits only, and one value: int() would also take "+5" or "1_0", and a
        # proxy that reads such a header differently would see another request boundary.
        if len(declared) > 1 or not (declared[0].isascii() and declared[0].isdigit()):
            raise ApiError(400, "Content-Length is not a valid length", code="invalid_body")
        length = int(declared[0])
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MB",
                           code="request_too_large")
        self._body_bytes = length
        body, got = bytearray(length), 0  # read in place: no second copy of a large body
        with memoryview(body) as view:
            try:
                while got < length:
                    n = self.rfile.readinto(view[got:got + (1 << 20)])
                    if not n:
                        break
                    got += n
            except TimeoutError:
                raise ApiError(408, f"the request was not received within "
                                    f"{self.server.request_timeout:g} seconds",
                               code="request_timeout") from None
            except OSError:
                pass
        if got < length:
            raise ApiError(400, f"request body ended after {got} of {length} declared bytes",
                           code="incomplete_body")
        self.connection.settimeout(self.timeout)
        self.close_connection = asked_to_close
        return body

    # -- output -------------------------------------------------------------------------

    def _discard_body(self) -> None:
        """Read and drop a body no handler read (an early error, a GET that came with one),
        so the next request on the connection is parsed from where it starts."""
        if self._body_read or self.close_connection:
            return
        if self.headers.get("Content-Length") is None and not self.headers.get("Transfer-Encoding"):
            return  # no body
        try:
            self._read_body()
        except ApiError:
            pass  # a body whose end cannot be found, or too large: _read_body closes the connection

    def _send_json(self, status: int, payload: Any, headers: Optional[dict[str, str]] = None) -> None:
        self._send(status, "application/json", json.dumps(payload, ensure_ascii=False).encode(),
                   headers)

    def _send(self, status: int, content_type: str, body: bytes,
              headers: Optional[dict[str, str]] = None) -> None:
        self._discard_body()
        self.status = status
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
        if not self._counted:
            self._counted = True
            self.server.service.metrics.request(self._endpoint, self.status)

    def _log(self, method: str, path: str) -> None:
        if self.server.log is not None:
            ms = (time.monotonic() - self._started) * 1000.0
            self.server.log(f"{self.address_string()} {method} {path} {self.status} "
                            f"tokens={self.tokens} {ms:.0f}ms id={self.request_id}"
                            f"{self._answered_by}")



# Every method a client may send comes to _dispatch, which answers 404 or 405 as the routes say.
for _method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"):  # HEAD: _send omits the body
    setattr(Handler, f"do_{_method}", lambda self, method=_method: self._dispatch(method))


def _chat_on(service: Service) -> Callable[[Any, Any], ChatReply]:
    return service.chat


def _complete_on(service: Service) -> Callable[[Any, Any], CompletionReply]:
    return service.complete


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id {response_id!r}", param="response_id",
                    code="not_found")


# ---- routes -------------------------------------------------------------------------------

ID = "{id}"


@dataclass(frozen=True)
class Route:
    path: str                                 # the whole path, ID standing for one segment;
    methods: tuple[str, ...]                  # with `prefix`, how paths begin
    answer: Callable[[Handler, str, str], None]   # (handler, method, what match() found)
    prefix: bool = False
    open: bool = False                        # no API key: it holds no data (the page asks for one)
    errors: Callable[[ApiError], dict] = ApiError.body   # the error shape its clients read
    label: str = ""                           # its endpoint in /metrics, when not the path

    def match(self, path: str) -> Optional[str]:
        """None if `path` is not this route's; else the ID segment, the path after a
        prefix, or "" for a plain path."""
        head, has_id, tail = self.path.partition(ID)
        if not has_id:
            if path == self.path:
                return ""
            return path[len(self.path):] if self.prefix and path.startswith(self.path) else None
        segment = path[len(head):len(path) - len(tail)]   # "" when head and tail overlap
        if path.startswith(head) and path.endswith(tail) and segment and "/" not in segment:
            return segment
        return None


MESSAGES = "/v1/messages"
ROUTES = (
    Route("/health", ("GET",), Handler._health, open=True),
    Route("/", ("GET",), Handler._page, open=True),
    Route("/metrics", ("GET",), Handler._metrics),
    Route("/v1/models", ("GET",), Handler._models),
    Route("/v1/models/", ("GET",), Handler._model, prefix=True, label="/v1/models/{model}"),
    Route("/v1/chat/completions", ("POST",), Handler._chat),
    Route("/v1/completions", ("POST",), Handler._complete),
    Route(MESSAGES, ("POST",), Handler._messages, errors=anthropic.error_body),
    Route(MESSAGES + "/count_tokens", ("POST",), Handler._count_tokens, errors=anthropic.error_body),
    Route("/v1/responses", ("POST",), Handler._responses),
    Route(f"/v1/responses/{ID}", ("GET", "DELETE"), Handler._stored_response),
    Route(f"/v1/responses/{ID}/input_items", ("GET",), Handler._input_items),
    Route(f"/v1/responses/{ID}/cancel", ("POST",), Handler._cancel),
)


def find_route(path: str) -> Optional[Route]:
    return next((r for r in ROUTES if r.match(path) is not None), None)


def nearest_route(path: str) -> Route:
    """The route whose path begins this one most closely ("/" begins every path)."""
    return max((r for r in ROUTES if path.startswith(r.path)), key=lambda r: len(r.path))


def endpoint_label(path: str) -> str:
    """The endpoint a path counts under in /metrics: a route, never a client's arbitrary path."""
    route = find_route(path)
    return "other" if route is None else route.label or route.path
