"""A scripted engine: `serve.engine.binding.Engine`'s interface with replies chosen by the test.

The tokenizer is deliberately simple but keeps the property the server relies
on: ordinary text never produces a special id, markup text does. Replies are
scripts of pieces; a piece spelled exactly like a special is that special's
token, anything else is one ordinary token with exactly that text.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import struct
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.formats.format_choice import resolve_chat_format
from serve.engine.binding import (Engine, EngineConfig, GenParams, GenResult, MemPlan, ModelInfo, Stats,
                          TokenInfo, WasteError, load_library)
from serve.http.server import Server
from serve.snapshots.cache import PrefixCache
from serve.tokenizer.tokenizer_choice import choose as choose_tokenizer
from serve.core.segment import Segment
from serve.service.facade import Service, ServiceOptions
from serve.service.image_positions import read_grid
from serve.snapshots.policy import Costs, SnapshotPolicy

K3_SPECIALS = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
               "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
               "<|kimi_image_placeholder|>"]
KIMI_LINEAR_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                        "<|im_system|>", "<|im_middle|>"]
SPECIAL_BASE = 1000   # specials live here; bytes are ids 0..255
PIECE_BASE = 2000     # multi-byte reply pieces get ids from here on
IMAGE_POSITIONS = 4   # what one scripted image expands to


def xtml_answer(*pieces: str, thinking: Sequence[str] = ()) -> list[str]:
    """A well-formed K3 reply as the model would emit it, split at the given pieces."""
    script = list(thinking)
    if thinking:
        script += ["<|close|>", "think", "<|sep|>"]
    script += ["<|open|>", "response", "<|sep|>"] if thinking else []
    return script + list(pieces) + ["<|close|>", "response", "<|sep|>",
                                    "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]


def xtml_tool_call(name: str, arguments: dict[str, str]) -> list[str]:
    """A response-channel reply (thinking off) that calls one tool with string arguments."""
    script = ["<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>",
              "<|open|>", f'call tool="{name}"', "<|sep|>"]
    for key, value in arguments.items():
        script += ["<|open|>", f'argument key="{key}" type="string"', "<|sep|>", value,
                   "<|close|>", "argument", "<|sep|>"]
    return script + ["<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>",
                     "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]


class ScriptedLibrary:
    """The Library surface the server uses, with a fixed image size."""

    def __init__(self, image_size: tuple[int, int] = (64, 48)):
        self.image_size = image_size
        self.measured: list[str] = []

    def version(self) -> str:
        return "0.0.0-scripted"

    def build_info(self) -> str:
        return "scripted engine for tests"

    def image_dimensions(self, path: str) -> tuple[int, int]:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                raise WasteError(-2, "WASTE_E_FORMAT", "bad image", "not a PNG", "waste_image_dimensions")
        self.measured.append(path)
        return self.image_size

    def plan_memory(self, path: str, ctx: int = 0) -> MemPlan:
        return MemPlan(1, 2, 3, 4, 10, 20, 0, 5)


class ScriptedEngine:
    """Plays back `replies` in order (the last one repeats), recording what it was asked."""

    def __init__(self, replies: Sequence[Sequence[str]] = (), ctx_max: int = 4096,
                 specials: Sequence[str] = K3_SPECIALS):
        self.info = ModelInfo(n_layers=4, n_experts=16, top_k=2, hidden=64, ctx_max=ctx_max,
                              params_total=1000, params_active=300, arch="scripted",
                              quant_summary="experts q8g32")
        self.specials = {text: SPECIAL_BASE + i for i, text in enumerate(specials)}
        self.longest_token = max(len(text.encode()) for text in specials)  # ordinary tokens are bytes
        self._by_id = {i: t.encode() for t, i in self.specials.items()}
        self._piece_ids: dict[bytes, int] = {}
        self.replies = [list(r) for r in replies] or [xtml_answer("hello")]
        self.segments: list = []          # every segment handed to tokenize_segments
        self.prompts: list[list[int]] = []
        self.params: list[GenParams] = []
        self.results: list[GenResult] = []
        self.resets = 0
        self.state: list[int] = []        # prompt ids evaluated (or restored) since the last reset
        self.images_added: list[str] = []
        # The image queue as the ABI describes it: consumed by the next eval or generate,
        # and not (the ABI does not say so) dropped by reset.
        self.queued: list[str] = []
        self.images_consumed: list[list[str]] = []  # what each eval or generate took
        self.active = 0
        self.max_active = 0
        # Called before each token with its index; a test can block here to pace generation.
        self.before_token: Optional[Callable[[int], None]] = None
        self.context_full_after: Optional[int] = None  # pretend the context fills after n tokens
        self.evals: list[int] = []        # the size of every prefill chunk evaluated
        self.calls: list[str] = []        # the engine calls that touch state or images, in order
        self.before_eval: Optional[Callable[[int], None]] = None  # called with the chunk's number
        self._stats = Stats(0, 0, 0, 0, 0.0, 0.0, True)
        self.evaluated = 0                # positions evaluated, as the binding counts them

    # -- tokenizer ------------------------------------------------------------

    def tokenize(self, text: str, *, markup: bool = False, add_bos: bool = False) -> list[int]:
        ids = [self.specials["[BOS]"]] if add_bos else []
        data = text
        while data:
            special = next((s for s in self.specials if markup and data.startswith(s)), None)
            if special:
                ids.append(self.specials[special])
                data = data[len(special):]
            else:
                ids.extend(data[0].encode())
                data = data[1:]
        return ids

    def tokenize_segments(self, segments) -> list[int]:
        ids: list[int] = []
        for segment in segments:
            self.segments.append(segment)
            ids.extend(self.tokenize(segment.text, markup=segment.markup))
        return ids

    def token_id(self, text: str) -> Optional[int]:
        return self.specials.get(text)

    def piece_id(self, piece: str) -> int:
        if piece in self.specials:
            return self.specials[piece]
        data = piece.encode()
        if len(data) == 1:
            return data[0]
        return self._piece_ids.setdefault(data, PIECE_BASE + len(self._piece_ids))

    def detokenize(self, ids: Sequence[int]) -> bytes:
        pieces = {v: k for k, v in self._piece_ids.items()}
        return b"".join(self._by_id.get(i) or pieces.get(i) or bytes([i]) for i in ids)

    # -- images ---------------------------------------------------------------

    def image_add(self, path: str) -> int:
        with open(path, "rb"):
            pass  # the file must still exist when the engine encodes it
        self.images_added.append(path)
        self.queued.append(path)
        self.calls.append("image_add")
        return IMAGE_POSITIONS

    def image_expand(self, ids: Sequence[int]) -> list[int]:
        pad = self.specials["<|media_pad|>"]
        return [x for i in ids for x in ([i] * IMAGE_POSITIONS if i == pad else [i])]

    def image_clear(self) -> None:
        self.queued = []
        self.calls.append("image_clear")

    def _consume_images(self) -> None:
        self.images_consumed.append(self.queued)
        self.queued = []

    # -- generation -----------------------------------------------------------

    def reset(self) -> None:
        self.resets += 1
        self.state = []

    def eval(self, tokens: Sequence[int]) -> list[float]:
        if self.before_eval is not None:
            self.before_eval(len(self.evals))
        self.evals.append(len(tokens))
        self.calls.append("eval")
        self._consume_images()
        self.state.extend(tokens)
        self.evaluated += len(tokens)
        return []

    def save_state(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.state, f)

    def load_state(self, path: str) -> None:
        self.calls.append("load_state")
        with open(path) as f:
            self.state = json.load(f)

    def generate(self, prompt: Sequence[int], params: GenParams,
                 on_token: Callable[[TokenInfo, bytes], Optional[bool]]) -> GenResult:
        self.calls.append("generate")
        self._consume_images()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            result = self._play(list(prompt), params, on_token)
        finally:
            self.active -= 1
        self.results.append(result)
        return result

    def _play(self, prompt: list[int], params: GenParams, on_token) -> GenResult:
        self.evaluated += len(prompt)
        prompt = self.state + prompt   # what a real engine's state would hold
        # Each token goes into the state before its callback; a cancelled generate
        # leaves none (serve's Engine resets it).
        self.state = list(prompt)
        self.prompts.append(prompt)
        self.params.append(params)
        script = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        room = self.info.ctx_max - len(prompt)
        if self.context_full_after is not None:
            room = min(room, self.context_full_after)
        n = 0
        for piece in script:
            if n >= params.max_tokens:
                break
            if n >= room:
                return GenResult(n, cancelled=False, context_full=True, detail="context full")
            if self.before_token is not None:
                self.before_token(n)
            token = self.piece_id(piece)
            info = TokenInfo(token_index=n, token=token, logprob=0.0, experts_hit=3, experts_missed=1,
                             bytes_read=4096, ms_total=1.0, ms_io=0.5)
            n += 1
            self._count(info)
            self.state.append(token)
            self.evaluated += 1
            if on_token(info, piece.encode()):
                self.state = []
                return GenResult(n, cancelled=True, context_full=False, detail=None)
            if token in params.stop_tokens or token == self.specials.get("[EOS]"):
                break
        return GenResult(n, cancelled=False, context_full=False, detail=None)

    def _count(self, info: TokenInfo) -> None:
        s = self._stats
        self._stats = Stats(s.tokens_generated + 1, s.experts_hit + info.experts_hit,
                            s.experts_missed + info.experts_missed, s.bytes_read + info.bytes_read,
                            s.sec_total + 0.001, s.sec_io + 0.0005, True)

    def stats(self) -> Stats:
        return self._stats

    def memory_used(self) -> MemPlan:
        return MemPlan(1, 2, 3, 4, 10, 20, 0, 5)

    def close(self) -> None:
        pass


class Fed:
    """What the engine is fed since its last reset: every eval and generate's prompt. With
    max_tokens 1 that is the whole prompt on both paths (serve's decoder never evaluates its
    last token)."""

    def __init__(self, engine: Any):
        self.ids: list[int] = []
        reset, evaluate, generate = engine.reset, engine.eval, engine.generate

        def on_reset() -> None:
            self.ids = []
            reset()

        def on_eval(tokens):
            self.ids += list(tokens)
            return evaluate(tokens)

        def on_generate(prompt, params, on_token):
            self.ids += list(prompt)
            return generate(prompt, params, on_token)

        engine.reset, engine.eval, engine.generate = on_reset, on_eval, on_generate


def held_engine(answer: list[str]) -> tuple[ScriptedEngine, threading.Event, threading.Event]:
    """An engine that stops before its first token until `release` is set: (engine, held,
    release), where `held` says the first request has the engine. For what is seen while a
    request holds it (a line behind it, /health, /metrics)."""
    engine = ScriptedEngine([answer])
    held, release = threading.Event(), threading.Event()

    def hold(index: int) -> None:
        if index == 0 and not held.is_set():
            held.set()
            release.wait(30)

    engine.before_token = hold
    return engine, held, release


# ---- running a server in-process ------------------------------------------------


def settling() -> bool:
    """Called by the engine: is this the settling of a reply? (It runs on the engine's worker,
    asked for by the settle thread: serve/service/settle.py.)"""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_build"
                                     and frame.f_code.co_filename.endswith("settle.py")):
        frame = frame.f_back
    return frame is not None


class SlowEnginePolicy(SnapshotPolicy):
    """The snapshot policy as it weighs on K3 (a prefilled position costs ten saves: every
    snapshot pays), whatever the engine under test measures. For the tests of what is
    reused, which would otherwise depend on this machine's speed; the policy's own tests
    measure (tests/snapshots/test_snapshot_policy.py)."""

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._costs = Costs(token_seconds=2.0, save_seconds=0.2, load_seconds=0.2,
                            snapshot_bytes=1e6)

    def _update(self, **measured: float) -> None:
        pass


class ScriptedTokenizer:
    """The scripted engine's tokenizer as serve's own (callable before the queue), recording
    each segment of text it is handed in the engine's `segments`."""

    def __init__(self, engine: ScriptedEngine):
        self.engine = engine
        self.specials = engine.specials

    def tokenize(self, text: str) -> list[int]:
        self.engine.segments.append(Segment(text, False))
        return self.engine.tokenize(text)

    def tokenize_markup(self, text: str) -> list[int]:
        self.engine.segments.append(Segment(text, True))
        return self.engine.tokenize(text, markup=True)

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self.engine.detokenize(ids)


def scripted_service(engine: Optional[ScriptedEngine] = None, library: Optional[ScriptedLibrary] = None,
                     model_dir: str = "/nonexistent", **options: Any) -> Service:
    engine = engine or ScriptedEngine()
    options.setdefault("model_id", "scripted")
    options.setdefault("snapshot_policy", SlowEnginePolicy())
    options.setdefault("eval_logits", False)   # a script has no logits: waste_generate plays it
    options.setdefault("tokenizer", ScriptedTokenizer(engine))
    options.setdefault("bos", [engine.specials["[BOS]"]])
    return Service(engine, library or ScriptedLibrary(), resolve_chat_format(engine, model_dir),
                   ServiceOptions(**options))


def waiting_in_line(service: Service, *ahead: int) -> Service:
    """The service, each of its chats first told to wait behind `ahead[0]`, then `ahead[1]`, ...
    others (as the engine queue tells a request's sink)."""
    chat = service.chat

    def waits_then_runs(req, sink):
        for n in ahead:
            sink.queued(n)
        return chat(req, sink)

    service.chat = waits_then_runs
    return service


@contextmanager
def real_service(lib_path, container, *, vision: bool = False, ctx: int = 0,
                 prefix_cache_for: Optional[Callable[[Any, Engine], PrefixCache]] = None,
                 **options: Any) -> Iterator[Service]:
    """The real engine on a container, closed afterwards. `prefix_cache_for(lib, engine)`
    makes a prefix cache that needs them (its identity, say)."""
    lib = load_library(str(lib_path))
    engine = Engine(lib, container, EngineConfig(vision=vision, ctx=ctx))
    service = None
    try:
        options.setdefault("model_id", "real")
        options.setdefault("snapshot_policy", SlowEnginePolicy())
        if "tokenizer" not in options:   # as the server chooses it at start
            chosen = choose_tokenizer(engine, container)
            options.update(tokenizer=chosen.tokenizer, bos=chosen.bos)
        if vision:   # as the server reads it at start
            options.setdefault("image_grid", read_grid(str(container)))
        if prefix_cache_for is not None:
            options["prefix_cache"] = prefix_cache_for(lib, engine)
        service = Service(engine, lib, resolve_chat_format(engine, container),
                          ServiceOptions(vision=vision, **options))
        yield service
    finally:
        if service is not None:
            service.close()   # deferred work stops before the engine closes
        engine.close()


@contextmanager
def real_server_with_cache(lib_path, container, cache_dir) -> Iterator[tuple[Service, Server]]:
    """The real engine served with a prefix cache in cache_dir, thinking off by default."""
    cache = PrefixCache(256 << 20, parent_dir=str(cache_dir))
    try:
        with real_service(lib_path, container, thinking=False, prefix_cache=cache) as service, \
                serving(service) as srv:
            yield service, srv
    finally:
        cache.close()


def tiny_png(width: int = 2, height: int = 2) -> bytes:
    """A valid RGB PNG, made here so the tests need no image library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\x00" + bytes([200, (y * 40) % 256, 30]) * width for y in range(height))
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@contextmanager
def serving(service: Service, **server_options: Any) -> Iterator[Server]:
    """The HTTP server on an ephemeral loopback port, always shut down afterwards."""
    server = Server(("127.0.0.1", 0), service, **server_options)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def engine() -> ScriptedEngine:
    """A scripted engine that thinks a little, then says hello (replies can be set per test)."""
    return ScriptedEngine([xtml_answer("Hel", "lo", thinking=["Let me ", "think."])])


@pytest.fixture
def server(engine: ScriptedEngine) -> Iterator[Server]:
    """The scripted service on `engine`, served."""
    with serving(scripted_service(engine)) as srv:
        yield srv


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def comments(self) -> list[str]:
        """The SSE comment lines (prefill progress), without their leading ': '."""
        return [block[2:] for block in self.body.decode().split("\n\n") if block.startswith(": ")]

    def events(self) -> list[Any]:
        """The SSE payloads in order; "[DONE]" stays a string. Comments are skipped, as clients do."""
        out = []
        for block in self.body.decode().split("\n\n"):
            if block and not block.startswith(":"):
                assert block.startswith("data: "), block
                data = block[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def named_events(self) -> list[tuple[str, Any]]:
        """(event name, payload) of a stream whose events have `event:` lines (Anthropic, Responses)."""
        out = []
        for block in self.body.decode().split("\n\n"):
            if block and not block.startswith(":"):
                name, data = block.split("\n")
                assert name.startswith("event: ") and data.startswith("data: "), block
                out.append((name[len("event: "):], json.loads(data[len("data: "):])))
        return out


def call(port: int, method: str, path: str, body: Any = None,
         headers: Optional[dict[str, str]] = None, timeout: float = 30) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=all_headers)
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def scrape(port: int, **headers: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    resp = call(port, "GET", "/metrics", headers=headers)
    assert resp.status == 200, resp.body
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return samples(resp.body.decode())


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(port: int, timeout: float = 180) -> dict:
    """Poll GET /health until the server says it is idle: no request, no queue, no idle-time
    work (settling, eviction, warming). What a test then inspects on disk stays put."""
    deadline = time.monotonic() + timeout
    while True:
        health = call(port, "GET", "/health").json()
        if health["idle"]:
            return health
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {health}"
        time.sleep(0.05)


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def assert_error(resp, status: int, param=None, code=None):
    assert resp.status == status, resp.body
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def raw_exchange(port: int, data: bytes, *, shut_write: bool = False) -> bytes:
    """Send raw bytes, return everything the server sends back before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


# ---- raw sockets, for requests left open while a test watches them ----------------


def post_open(port: int, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """A request sent on a raw socket (the server closes after replying); the test reads it."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    """Reads on until `marker` has arrived; returns all read so far, `got` included."""
    while marker not in got:
        data = s.recv(65536)
        assert data, f"closed before {marker!r}: {got[-300:]!r}"
        got += data
    return got


def read_all(s: socket.socket, got: bytes = b"") -> bytes:
    """Reads to the end and closes; returns the whole response, `got` included."""
    with s:
        while data := s.recv(65536):
            got += data
    return got


def dechunk(raw: bytes) -> bytes:
    """The body of a raw HTTP response, its chunked transfer coding undone when it has one."""
    head, body = raw.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def sse_data(raw: bytes) -> list:
    """The SSE payloads of a raw HTTP response, parsed; "[DONE]" stays a string."""
    body = dechunk(raw).decode()
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
            for b in body.split("\n\n") if b.startswith("data: ")]


def blocking_and_streamed(script: list[str], path: str, body: dict) -> tuple[bytes, bytes]:
    """The blocking body and the streamed one of `body` at `path`, each from a fresh server
    on `script`."""
    out = []
    for stream in (False, True):
        with serving(scripted_service(ScriptedEngine([script]))) as srv:
            reply = call(srv.server_address[1], "POST", path, {**body, "stream": stream})
        assert reply.status == 200, reply.body
        out.append(reply.body)
    return out[0], out[1]


def sse_events(body: bytes) -> list[dict]:
    """The JSON payloads of an SSE body `call` returned, without "[DONE]"."""
    return [json.loads(line[len(b"data: "):]) for line in body.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


# ---- streams on a clock ---------------------------------------------------------------


def timed_blocks(port: int, path: str, body: dict, timeout: float = 120
                 ) -> tuple[float, list[tuple[float, str]]]:
    """A streamed request over a real socket (HTTP/1.1, chunked): when it was sent, and every
    SSE block, comments included, with the time its last byte arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        sent = time.monotonic()
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        blocks: list[tuple[float, str]] = []
        pending = b""
        while data := resp.read1(65536):
            now = time.monotonic()
            *done, pending = (pending + data).split(b"\n\n")
            blocks += [(now, block.decode()) for block in done]
        return sent, blocks
    finally:
        conn.close()


def longest_silence(sent: float, blocks: list[tuple[float, str]], counts: Callable[[str], bool],
                    until: Callable[[str], bool]) -> float:
    """The longest time, from the request until the first block `until` accepts, in which no
    block that `counts` (a sign of life to the client in question) arrived."""
    last, longest = sent, 0.0
    for at, block in blocks:
        if counts(block):
            longest, last = max(longest, at - last), at
        if until(block):
            return longest
    raise AssertionError(f"the stream never got there: {[b for _, b in blocks][-5:]}")


def block_data(block: str) -> Any:
    """The JSON of an SSE block's data line (None for a comment or [DONE])."""
    for line in block.split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            return json.loads(line[len("data: "):])
    return None

