"""HTTP for the service: routing, auth, body limits, JSON bodies and SSE framing.

One thread per connection (ThreadingHTTPServer); generations serialize on the
engine lock inside the service, so /health and /v1/models still answer while
a reply is being written.
"""
from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from . import api
from .api import ApiError
from .logprobs import chat_logprobs, completion_logprobs, text_length
from .service import Service

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
SEND_GAP = 0.01  # seconds between two sends of one stream, at most (see _SocketWriter)
MODELS_PREFIX = "/v1/models/"
ROUTES = {"/health": "GET", "/v1/models": "GET",
          "/v1/chat/completions": "POST", "/v1/completions": "POST"}


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: Service, *, api_key: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None, socket_timeout: float = 30.0):
        self.service = service
        self.api_key = api_key
        self.log = log
        self.socket_timeout = socket_timeout  # bounds a client that declares more body than it sends
        super().__init__(address, Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8", code="invalid_body") from None
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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "serve"
    server: Server

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout
        super().setup()
        # Asked once per generated token, so registered once per connection; poll,
        # because select() cannot watch a descriptor numbered 1024 or above.
        self._hangup = select.poll()
        self._hangup.register(self.connection, select.POLLIN | select.POLLHUP | select.POLLERR)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request is written by _log instead

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

    def _dispatch(self, method: str) -> None:
        # For the request's log line; the sinks update them as the reply goes out.
        self._started = time.monotonic()
        self.status = 0
        self.tokens = 0
        self._body_read = False
        path = self.path.split("?", 1)[0]
        try:
            self._route(method, path)
        except ApiError as e:
            self._send_json(e.status, e.body())
        except Exception as e:  # anything unexpected is the server's fault, and must not kill it
            self._send_json(500, api.error_body(f"internal error: {e}", "server_error"))
        finally:
            self._log(method, path)

    def _route(self, method: str, path: str) -> None:
        allowed = "GET" if path.startswith(MODELS_PREFIX) else ROUTES.get(path)
        if allowed is None:
            raise ApiError(404, f"no such endpoint: {path}", code="not_found")
        if path != "/health":
            self._check_auth()
        if method != allowed:
            raise ApiError(405, f"{path} accepts {allowed} only", code="method_not_allowed")
        warming = self.server.service.warming
        if path == "/health":
            # 503 while warming: load balancers send nothing to a server that is not ready.
            self._send_json(503 if warming else 200, warming or {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self.server.service.model()]})
        elif path.startswith(MODELS_PREFIX):
            self._get_model(path[len(MODELS_PREFIX):])
        elif warming:
            raise ApiError(503, "the server is warming its prefix cache (--warm); try again later",
                           code="warming", kind="server_error")
        elif path == "/v1/chat/completions":
            self._chat(api.parse_chat_request(self._read_json()))
        else:
            self._complete(api.parse_completion_request(self._read_json()))

    def _check_auth(self) -> None:
        key = self.server.api_key
        if not key:
            return
        given = self.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
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
        return parse_json_object(self._read_body())

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
        chunks, got = [], 0
        try:
            while got < length:
                chunk = self.rfile.read(min(length - got, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except (socket.timeout, OSError):
            pass
        if got < length:
            raise ApiError(400, f"request body ended after {got} of {length} declared bytes",
                           code="incomplete_body")
        self.close_connection = asked_to_close
        return b"".join(chunks)

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
        if not req.stream:
            reply = run(req, _BlockingSink(self))
            self.tokens = reply.usage.completion_tokens
            if not reply.client_gone:
                self._send_json(200, body(reply))
            return
        if not req.include_usage:
            stream["usage"] = None
        sink = _StreamSink(self, **stream)
        sink.run(lambda: run(req, sink))

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

    def _send_json(self, status: int, payload: Any) -> None:
        self._discard_body()
        body = json.dumps(payload, ensure_ascii=False).encode()
        self.status = status
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True  # the client is gone; nothing left to tell it

    def client_gone(self) -> bool:
        """Non-blocking: has the peer closed its end? (readable, yet nothing to read)."""
        try:
            return bool(self._hangup.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _log(self, method: str, path: str) -> None:
        if self.server.log is not None:
            ms = (time.monotonic() - self._started) * 1000.0
            self.server.log(f"{self.address_string()} {method} {path} {self.status} "
                            f"tokens={self.tokens} {ms:.0f}ms")


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

    def gone(self) -> bool:
        return self._handler.client_gone()


class _SocketWriter(threading.Thread):
    """Sends one stream's bytes from its own thread, at most one send per SEND_GAP.

    The engine thread only queues.  A model slower than one token per SEND_GAP
    (every real one) gets each token sent the moment it exists; a faster one
    has its tokens gathered into one send per SEND_GAP instead of paying a
    socket round trip per token, for at most SEND_GAP of added latency.
    """

    def __init__(self, wfile: Any):
        super().__init__(name="sse-writer", daemon=True)
        self._wfile = wfile
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
            if data and not self.failed:
                try:
                    self._wfile.write(data)
                except OSError:
                    self.failed = True
                last_send = time.monotonic()


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
        h = self._handler
        h.status = 200
        h.close_connection = True  # the stream ends when the connection does
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        self._writer = _SocketWriter(h.wfile)
        self._writer.start()
        if self._first is not None:
            self.emit(self._first)

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
        except Exception as e:
            if self._writer is None:
                raise
            error = e.body() if isinstance(e, ApiError) else api.error_body(str(e), "server_error")
            self._close_stream([error])
            return
        self._handler.tokens = reply.usage.completion_tokens
        if reply.client_gone:
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
