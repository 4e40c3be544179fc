"""HTTP for the service: routing, auth, body limits, JSON bodies and SSE framing.

One thread per connection (ThreadingHTTPServer); generations serialize on the
engine lock inside the service, so /health and /v1/models still answer while
a reply is being written.
"""
from __future__ import annotations

import errno
import hmac
import io
import json
import queue
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from . import anthropic, api, metrics, responses
from .api import ApiError
from .engine_queue import RETRY_AFTER_SECONDS, ClientGone
from .logprobs import chat_logprobs, completion_logprobs, text_length
from .page import CONTENT_TYPE as PAGE_TYPE, chat_page
from .response_store import ResponseStore
from .service import Service

MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds for a whole request's headers and body, idle time included
MAX_ACCEPT_BACKOFF = 1.0        # seconds between accept attempts while descriptors are exhausted
# accept() failures that persist while the listening socket stays readable
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 50_000  # objects and arrays in one body ('{' and '[' bytes)
MAX_JSON_ITEMS = 1_000_000     # members and elements in one body (',' bytes)
SEND_GAP = 0.01  # seconds between two sends of one stream, at most (see _SocketWriter)
MODELS_PREFIX = "/v1/models/"
RESPONSES_PREFIX = "/v1/responses/"
MESSAGES = "/v1/messages"
ROUTES = {"/health": "GET", "/v1/models": "GET",
          "/v1/chat/completions": "POST", "/v1/completions": "POST",
          "/": "GET", "/metrics": "GET",
          MESSAGES: "POST", MESSAGES + "/count_tokens": "POST", "/v1/responses": "POST"}
PREFIX_ROUTES = {MODELS_PREFIX: "GET", RESPONSES_PREFIX: "GET, DELETE"}
OPEN_PATHS = ("/health", "/")  # no API key: they hold no data (the page asks for the key itself)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: a burst of connects must not wait for SYN retries

    def __init__(self, address: tuple[str, int], service: Service, *, api_key: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None, socket_timeout: float = 30.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.service = service
        self.api_key = api_key
        self.log = log
        self.socket_timeout = socket_timeout  # bounds each send to a client that stopped reading
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self._count = threading.Condition()
        self._connections = 0  # open, each with its thread
        self._requests = 0     # being answered
        self._backoff = 0.0
        self.responses = ResponseStore()
        super().__init__(address, Handler)
        # Behind a router, every reply says which host wrote it (docs/serving-a-team.md).
        self.host_id = f"{socket.gethostname()}:{self.port}"

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
        body = json.dumps(api.error_body(f"the server has {self.max_connections} connections open; "
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

    def request_started(self) -> None:
        with self._count:
            self._requests += 1

    def request_finished(self) -> None:
        with self._count:
            self._requests -= 1
            self._count.notify_all()

    def wait_requests(self, timeout: float) -> bool:
        """Wait until no request is being answered (cut streams send their last events)."""
        with self._count:
            return self._count.wait_for(lambda: self._requests == 0, timeout)


def endpoint_label(path: str) -> str:
    """The endpoint a path counts under in /metrics: a route, never a client's arbitrary path."""
    if path in ROUTES:
        return path
    if path.startswith(RESPONSES_PREFIX):
        return RESPONSES_PREFIX + "{id}"
    return MODELS_PREFIX + "{model}" if path.startswith(MODELS_PREFIX) else "other"


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion.

    One iterator per open level, so the walk costs memory in the depth, not
    in the number of values.
    """
    deepest, stack = 0, [iter([value])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (dict, list)):
                stack.append(iter(item.values() if isinstance(item, dict) else item))
                deepest = max(deepest, len(stack) - 1)
                break
        else:
            stack.pop()
    return deepest


def check_json_size(raw: bytes | bytearray) -> None:
    """Refuse, before parsing, a body whose values would cost far more memory than its bytes.

    A 64 MB body of tiny objects parses into gigabytes of Python values. The
    counts are of raw bytes, so braces and commas inside strings count too: a
    body refused for them is text far too long for any context anyway.
    """
    containers, items = raw.count(b"{") + raw.count(b"["), raw.count(b",")
    if containers > MAX_JSON_CONTAINERS or items > MAX_JSON_ITEMS:
        raise ApiError(413, f"request body has more than {MAX_JSON_CONTAINERS} objects and arrays "
                            f"or more than {MAX_JSON_ITEMS} values", code="request_too_large")


def decode_body(raw: bytes | bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8", code="invalid_body") from None


def parse_json_text(text: str) -> dict:
    try:
        value = json.loads(text)
    except RecursionError:  # Python's parser recurses once per nesting level
        raise ApiError(400, f"JSON is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_body") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_body") from None
    if not isinstance(value, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ApiError(400, f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_body")
    return value


_JSON = json.JSONEncoder(ensure_ascii=False)  # built once: json.dumps builds one per call


def sse_event(payload: Any) -> bytes:
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
_HOLE = {"\u0000hole": 0}


def sse_encoder(chunk: Callable[[Any], dict]) -> Callable[[Any], bytes]:
    """`part -> sse_event(chunk(part))`, byte for byte, encoding only the part per call.

    A stream's chunks differ only in one value (a chat delta, a completion's
    text), and this runs once per token.
    """
    head, tail = sse_event(chunk(_HOLE)).split(_JSON.encode(_HOLE).encode())
    return lambda part: head + _JSON.encode(part).encode() + tail


def sse_named_event(payload: dict) -> bytes:
    """An event of the Anthropic and Responses streams: its `type` is the SSE event name."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


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
        self.timeout = self.server.socket_timeout
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

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")  # _send leaves the body out

    def _dispatch(self, method: str) -> None:
        # For the request's log line; the sinks update them as the reply goes out.
        self._started = time.monotonic()
        self.status = 0
        self.tokens = 0
        self.request_id = api.new_id("req")
        self.connection.settimeout(self.timeout)  # sends are bounded per send, not by the deadline
        self._body_read = False
        path = self.path.split("?", 1)[0]
        self.server.request_started()
        # Anthropic's clients read errors in Anthropic's shape; every other path is OpenAI's.
        self._shape = anthropic.error_body if path.startswith(MESSAGES) else ApiError.body
        try:
            self._route(method, path)
        except ClientGone:
            self.status = 499  # nginx's code for a client that left before its answer
            self.close_connection = True
        except ApiError as e:
            self._send_json(e.status, self.error_body(e), e.headers)
        except Exception as e:  # anything unexpected is the server's fault, and must not kill it
            self._send_json(500, self.error_body(e))
        finally:
            self.server.request_finished()
            self._log(method, path)
            self.server.service.metrics.request(endpoint_label(path), self.status)

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

    def _route(self, method: str, path: str) -> None:
        allowed = ROUTES.get(path) or next(
            (methods for prefix, methods in PREFIX_ROUTES.items() if path.startswith(prefix)), None)
        if path not in OPEN_PATHS:
            self._check_auth()  # before the 404, so that endpoints cannot be enumerated
        if allowed is None:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")
        if method == "HEAD" and "GET" in allowed.split(", "):
            method = "GET"
        if method not in allowed.split(", "):
            raise ApiError(405, f"{path} accepts {allowed} only", code="method_not_allowed")
        warming = self.server.service.warming
        if path == "/health":
            # 503 while warming: load balancers send nothing to a server that is not ready.
            self._send_json(503 if warming else 200,
                            {**(warming or {"status": "ok"}), **self.server.service.activity().as_json()})
        elif path == "/":
            page, policy = chat_page()
            self._send(200, PAGE_TYPE, page, {"Content-Security-Policy": policy,
                                              "X-Content-Type-Options": "nosniff",
                                              "Referrer-Policy": "no-referrer",
                                              "Cache-Control": "no-cache"})
        elif path == "/metrics":
            self._send(200, metrics.CONTENT_TYPE, self.server.service.metrics.render())
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self.server.service.model()]})
        elif path.startswith(MODELS_PREFIX):
            self._get_model(path[len(MODELS_PREFIX):])
        elif warming:
            raise ApiError(503, "the server is warming its prefix cache (--warm); try again later",
                           code="warming", kind="server_error")
        elif path == "/v1/chat/completions":
            self._chat(api.parse_chat_request(self._read_json()))
        elif path == MESSAGES:
            self._dialect(anthropic.Exchange(anthropic.parse_request(self._read_json()),
                                             self.server.service.options.model_id))
        elif path == MESSAGES + "/count_tokens":
            self._count_tokens(anthropic.parse_request(self._read_json(), counting=True))
        elif path == "/v1/responses":
            self._dialect(responses.Exchange(self._read_json(), self.server.responses,
                                             self.server.service.options.model_id))
        elif path.startswith(RESPONSES_PREFIX):
            self._stored_response(method, path[len(RESPONSES_PREFIX):])
        else:
            self._complete(api.parse_completion_request(self._read_json()))

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

    def _get_model(self, model_id: str) -> None:
        model = self.server.service.model()
        if model_id != model["id"]:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                           code="model_not_found")
        self._send_json(200, model)

    # -- request bodies -----------------------------------------------------------------

    def _read_json(self) -> dict:
        # Decoded apart so that the raw body is freed before parsing starts: a large body
        # then costs its text and its parsed values, not the bytes as well.
        body = self._read_body()
        check_json_size(body)
        text = decode_body(body)
        del body
        return parse_json_text(text)

    def _read_body(self) -> bytes:
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

    # -- generation ---------------------------------------------------------------------

    def _chat(self, req: api.ChatRequest) -> None:
        rid, created, model = api.new_id("chatcmpl"), api.now(), self.server.service.options.model_id
        self._generate(
            req, self.server.service.chat,
            body=lambda reply: api.chat_completion(rid, created, model, reply.message,
                                                   reply.finish_reason, reply.usage, reply.logprobs),
            stream=dict(chunk=lambda delta: api.chat_chunk(rid, created, model, delta),
                        with_logprobs=lambda delta, entries: api.chat_chunk(
                            rid, created, model, delta, logprobs=chat_logprobs(entries)),
                        final=lambda finish: api.chat_chunk(rid, created, model, {}, finish),
                        usage=lambda usage: api.usage_chunk(rid, created, model,
                                                            "chat.completion.chunk", usage),
                        first={"role": "assistant", "content": ""}))

    def _complete(self, req: api.CompletionRequest) -> None:
        rid, created, model = api.new_id("cmpl"), api.now(), self.server.service.options.model_id
        offset = [0]   # text_offset continues from chunk to chunk

        def with_logprobs(delta: dict, entries: list) -> dict:
            logprobs = completion_logprobs(entries, offset[0])
            offset[0] += sum(text_length(e) for e in entries)
            return api.text_completion(rid, created, model, delta["text"], None, logprobs=logprobs)
        self._generate(
            req, self.server.service.complete,
            body=lambda reply: api.text_completion(rid, created, model, reply.text,
                                                   reply.finish_reason, reply.usage, reply.logprobs),
            stream=dict(chunk=lambda text: api.text_completion(rid, created, model, text, None),
                        with_logprobs=with_logprobs,
                        part=lambda delta: delta["text"],
                        final=lambda finish: api.text_completion(rid, created, model, "", finish),
                        usage=lambda usage: api.usage_chunk(rid, created, model, "text_completion",
                                                            usage)))

    def _generate(self, req: Any, run: Callable[[Any, Any], Any], *, body: Callable[[Any], dict],
                  stream: dict[str, Any]) -> None:
        """Run a request blocking (one JSON body) or streaming (the sink's chunk builders)."""
        req.request_id = self.request_id
        if not req.stream:
            reply = run(req, _BlockingSink(self))
            self.tokens = reply.usage.completion_tokens
            if reply.client_gone:
                self.status = 499
            else:
                self._send_json(200, body(reply))
            return
        if not req.include_usage:
            stream["usage"] = None
        sink = _StreamSink(self, **stream)
        sink.run(lambda: run(req, sink))

    def _dialect(self, exchange: Any) -> None:
        """Anthropic Messages and OpenAI Responses: a chat generation, translated by `exchange`."""
        if exchange.translation.left_out and self.server.log is not None:
            self.server.log(f"{self.path.split('?', 1)[0]}: tools left out (the server cannot "
                            f"run them): {', '.join(exchange.translation.left_out)}")
        exchange.request.request_id = self.request_id
        _DialectSink(self, exchange).run(
            lambda sink: self.server.service.chat(exchange.request, sink))

    def _count_tokens(self, translation: Any) -> None:
        translation.request.request_id = self.request_id
        try:
            count = self.server.service.count_chat(translation.request, _BlockingSink(self))
        except ApiError as e:
            raise translation.error(e) from None
        self._send_json(200, {"input_tokens": count})

    def _stored_response(self, method: str, response_id: str) -> None:
        store = self.server.responses
        stored = store.get(response_id)
        if stored is None or (method == "DELETE" and not store.delete(response_id)):
            raise ApiError(404, f"no stored response with id {response_id!r}",
                           param="response_id", code="not_found")
        self._send_json(200, stored.response if method == "GET" else
                        {"id": response_id, "object": "response.deleted", "deleted": True})

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

    def _log(self, method: str, path: str) -> None:
        if self.server.log is not None:
            ms = (time.monotonic() - self._started) * 1000.0
            self.server.log(f"{self.address_string()} {method} {path} {self.status} "
                            f"tokens={self.tokens} {ms:.0f}ms id={self.request_id}")


class _BlockingSink:
    """A blocking reply sends nothing until the end, but still notices a vanished client."""

    def __init__(self, handler: Handler):
        self._handler = handler

    def start(self) -> None:
        pass

    def emit(self, delta: dict) -> None:
        pass

    def progress(self, done: int, total: int) -> None:
        pass

    def queued(self, ahead: int) -> None:
        pass

    def gone(self) -> bool:
        return self._handler.client_gone()


class _SocketWriter(threading.Thread):
    """Sends one stream's bytes from its own thread, at most one send per SEND_GAP.

    The engine thread only queues.  A model slower than one token per SEND_GAP
    (every real one) gets each token sent the moment it exists; a faster one
    has its tokens gathered into one send per SEND_GAP instead of paying a
    socket round trip per token, for at most SEND_GAP of added latency.
    """

    def __init__(self, wfile: Any, chunked: bool):
        super().__init__(name="sse-writer", daemon=True)
        self._wfile = wfile
        self._chunked = chunked
        self._queue: "queue.SimpleQueue[Optional[bytes]]" = queue.SimpleQueue()
        self.failed = False  # the client went away mid-stream

    def put(self, data: bytes) -> None:
        self._queue.put(data)

    def close(self) -> None:
        """Send everything queued so far, then stop."""
        self._queue.put(None)
        self.join()

    def run(self) -> None:
        done, last_send = False, 0.0
        while not done:
            batch = [self._queue.get()]
            pause = last_send + SEND_GAP - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # tokens are coming faster than anyone reads them
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            data = b"".join(item for item in batch if item is not None)
            if self._chunked:
                data = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"0\r\n\r\n" if done else b"")
            if data and not self.failed:
                try:
                    self._wfile.write(data)
                except OSError:
                    self.failed = True
                last_send = time.monotonic()


def open_event_stream(h: Handler) -> _SocketWriter:
    """Send the headers of an SSE reply; its bytes then go through the returned writer."""
    h.status = 200
    h.close_connection = True  # the stream ends when the connection does
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.send_header("Cache-Control", "no-cache")
    h.send_header("Connection", "close")
    # Chunked for HTTP/1.1, so that a stream cut by a dying server is told apart from a finished
    # one, also through a proxy: only a finished stream ends with the last chunk.
    chunked = h.request_version == "HTTP/1.1"
    if chunked:
        h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    writer = _SocketWriter(h.wfile, chunked)
    writer.start()
    return writer


class _StreamSink:
    """Server-sent events: headers and the first chunk once generation starts, a chunk per delta."""

    def __init__(self, handler: Handler, *, chunk: Callable[[Any], dict],
                 final: Callable[[str], dict], usage: Optional[Callable[[Any], dict]],
                 with_logprobs: Callable[[dict, list], dict],
                 first: Optional[dict] = None, part: Callable[[dict], Any] = lambda delta: delta):
        self._handler = handler
        self._encode = sse_encoder(chunk)  # part -> the SSE event of its chunk
        self._part = part          # the service's delta -> what varies in the chunk
        self._final = final        # finish_reason -> the closing chunk
        self._usage = usage        # usage -> the usage chunk, when the client asked for one
        self._with_logprobs = with_logprobs  # (delta, logprob entries) -> its whole chunk
        self._first = first
        self._writer: Optional[_SocketWriter] = None

    def start(self) -> None:
        self._open()
        if self._first is not None:
            self.emit(self._first)

    def _open(self) -> None:
        if self._writer is None:  # else already open: the request waited in line
            self._writer = open_event_stream(self._handler)

    def queued(self, ahead: int) -> None:
        # The stream opens while the request waits, so the client learns its place in line.
        self._open()
        self._writer.put(f": queue {ahead}\n\n".encode())

    def emit(self, delta: dict) -> None:
        if "logprobs" in delta:  # serve/logprobs.py: the entries go beside the delta, not in it
            delta = dict(delta)
            self._writer.put(sse_event(self._with_logprobs(delta, delta.pop("logprobs"))))
            return
        self._writer.put(self._encode(self._part(delta)))

    def progress(self, done: int, total: int) -> None:
        # An SSE comment: every client ignores it, and it keeps proxies from timing out.
        self._writer.put(f": prefill {done}/{total}\n\n".encode())

    def gone(self) -> bool:
        return (self._writer is not None and self._writer.failed) or self._handler.client_gone()

    def run(self, generate: Callable[[], Any]) -> None:
        """Runs the generation; errors before the first byte are ordinary HTTP errors."""
        try:
            reply = generate()
        except ClientGone:
            if self._writer is not None:
                self._writer.close()
            raise
        except Exception as e:
            if self._writer is None:
                raise
            self._close_stream([self._handler.error_body(e)])
            return
        self._handler.tokens = reply.usage.completion_tokens
        if reply.client_gone:
            self._handler.status = 499
            self._writer.close()
            return
        events = [self._final(reply.finish_reason)]
        if self._usage is not None:
            events.append(self._usage(reply.usage))
        self._close_stream(events)

    def _close_stream(self, events: list[dict]) -> None:
        for event in events:
            self._writer.put(sse_event(event))
        self._writer.put(SSE_DONE)
        self._writer.close()


class _DialectSink:
    """Runs one Anthropic or Responses generation: named SSE events, or one body at the end.

    The exchange turns the service's deltas into its dialect's events; a
    blocking reply feeds it too, so both modes build the same blocks.
    """

    def __init__(self, handler: Handler, exchange: Any):
        self._handler = handler
        self._exchange = exchange
        self._stream = exchange.request.stream
        self._writer: Optional[_SocketWriter] = None

    def start(self) -> None:
        if self._stream and self._writer is None:
            self._writer = open_event_stream(self._handler)
            self._send(self._exchange.opening())

    def emit(self, delta: dict) -> None:
        self._send(self._exchange.delta(delta))

    def progress(self, done: int, total: int) -> None:
        self._keepalive(f": prefill {done}/{total}\n\n")

    def queued(self, ahead: int) -> None:
        # While the request waits for the engine, the stream is already open and says so.
        self.start()
        self._keepalive(f": queue {ahead}\n\n")

    def _keepalive(self, comment: str) -> None:
        """A comment for people and proxies, and the dialect's own keepalive (Anthropic's ping)."""
        if self._writer is not None:
            self._writer.put(comment.encode())
            self._send(self._exchange.progress())

    def gone(self) -> bool:
        return (self._writer is not None and self._writer.failed) or self._handler.client_gone()

    def _fail(self, error: Exception) -> None:
        """An error after the stream started: the dialect's failure events end it."""
        public = self._exchange.error(self._handler.public_error(error))
        self._send(self._exchange.failed(public))
        self._writer.close()

    def _send(self, events: list[dict]) -> None:
        if self._writer is not None:
            self._writer.put(b"".join(sse_named_event(event) for event in events))

    def run(self, generate: Callable[["_DialectSink"], Any]) -> None:
        """Errors before the stream starts are ordinary HTTP errors, in the dialect's names."""
        try:
            reply = generate(self)
        except ClientGone:
            if self._writer is not None:
                self._writer.close()
            raise
        except ApiError as e:
            if self._writer is None:
                raise self._exchange.error(e) from None
            self._fail(e)
            return
        except Exception as e:
            if self._writer is None:
                raise
            self._fail(e)
            return
        self._handler.tokens = reply.usage.completion_tokens
        if reply.client_gone:
            self._handler.status = 499
        if self._writer is not None:
            if not reply.client_gone:
                self._send(self._exchange.closing(reply))
            self._writer.close()
        elif not reply.client_gone:
            self._handler._send_json(200, self._exchange.body(reply))
