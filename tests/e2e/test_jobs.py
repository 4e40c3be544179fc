"""A turn is a job, not a connection: at a scaled K3 clock, on the reference engine.

`python3 -m serve` with WASTE_DELAY_MS set, so each generated token takes DELAY_MS. In
every dialect, blocking and streamed, a client hangs up partway through its reply and
sends the same request again at once (as Codex and opencode do): the retry attaches to
the job, gets what was said so far at once, then the rest live, and the engine evaluates
each position once (serve_engine_evaluated_tokens_total). With a different request
waiting instead, the job whose client left steps aside at its next engine call.
"""
from __future__ import annotations

import json
import socket
import time
import uuid
from typing import Callable

import pytest

from scripted import call, post_open, scrape
from served import serve

DELAY_MS = 50        # per evaluated token: 60 tokens decoded again would take 3 s
CUT = 30             # the client hangs up after this many pieces of the reply
TOKENS = 80


def _evaluated(port: int) -> float:
    return scrape(port)[("serve_engine_evaluated_tokens_total", ())]


@pytest.fixture(scope="module")
def slow(k3_container, lib_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(k3_container, lib_path, tmp_path_factory.mktemp("jobs"), "--no-thinking",
                   "--no-prefix-cache", "--heartbeat", "1") as served:
            yield served


def _unique() -> str:
    return f"Tell me a long story about the number {uuid.uuid4().int % 10**9}."


# Each dialect: a body for a prompt, and how many pieces of reply text a stream's data holds.
def _chat(prompt: str) -> dict:
    return {"model": "k3", "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
            "temperature": 0}


def _completion(prompt: str) -> dict:
    return {"model": "k3", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}


def _messages(prompt: str) -> dict:
    return {"model": "k3", "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
            "temperature": 0}


def _responses(prompt: str) -> dict:
    return {"model": "k3", "input": prompt, "max_output_tokens": TOKENS, "temperature": 0}


def _chat_piece(event: dict) -> str:
    choice = (event.get("choices") or [{}])[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _named_piece(event: dict) -> str:
    return (event.get("delta") or {}).get("text", "") if event.get("type") == "content_block_delta" \
        else event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""


OPENAI = ("/v1/chat/completions", "/v1/completions")
DIALECTS = {
    "chat": ("/v1/chat/completions", _chat, _chat_piece),
    "completions": ("/v1/completions", _completion, _chat_piece),
    "messages": ("/v1/messages", _messages, _named_piece),
    "responses": ("/v1/responses", _responses, _named_piece),
}


def _blocking_text(path: str, body: dict) -> str:
    if path == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    if path == "/v1/responses":
        return body["output_text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _usage(path: str, body: dict) -> tuple[int, int]:
    usage = body["usage"]
    if path in ("/v1/messages", "/v1/responses"):
        return usage["input_tokens"], usage["output_tokens"]
    return usage["prompt_tokens"], usage["completion_tokens"]


class Pieces:
    """A stream read off a raw socket, block by block, with the reply's pieces counted."""

    def __init__(self, sock: socket.socket, piece: Callable[[dict], str]):
        self.sock, self.piece = sock, piece
        self.raw = b""
        self.pieces: list[tuple[float, str]] = []   # (arrival, text)
        self.final: dict = {}       # the event carrying the usage (the last one that does)
        self.blocks: list[str] = []   # the SSE data blocks parsed so far

    def read_until(self, done: Callable[[], bool]) -> None:
        while not done():
            data = self.sock.recv(65536)
            if not data:
                return
            self.raw += data
            self._parse(time.monotonic())

    def _parse(self, now: float) -> None:
        body = dechunk_partial_text(self.raw)
        events = [b for b in body.split("\n\n")[:-1] if "data: " in b]
        for block in events[len(self.blocks):]:
            data = block.split("data: ", 1)[1]
            self.blocks.append(block)
            if data == "[DONE]":
                continue
            event = json.loads(data)
            text = self.piece(event)
            if text:
                self.pieces.append((now, text))
            if event.get("type") in ("message_delta", "response.completed", "response.incomplete") \
                    or (event.get("usage") and not event.get("type")):
                self.final = event

    def text(self) -> str:
        return "".join(t for _, t in self.pieces)


def dechunk_partial_text(raw: bytes) -> str:
    """What a chunked response's body holds so far (an unfinished chunk left out)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return ""
    out = b""
    while body:
        size, crlf, rest = body.partition(b"\r\n")
        if not crlf:
            break
        n = int(size, 16)
        if n == 0 or len(rest) < n + 2:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out.decode("utf-8", "replace")


def _stream(port: int, path: str, body: dict, piece: Callable[[dict], str]) -> Pieces:
    extra = {"stream_options": {"include_usage": True}} if path in OPENAI else {}
    return Pieces(post_open(port, {**body, "stream": True, **extra}, path), piece)


@pytest.mark.parametrize("name", DIALECTS)
def test_a_stream_cut_and_sent_again_is_decoded_once(slow, name):
    path, make, piece = DIALECTS[name]
    body = make(_unique())
    before = _evaluated(slow.port)
    first = _stream(slow.port, path, body, piece)
    first.read_until(lambda: len(first.pieces) >= CUT)
    first.sock.close()
    said = first.text()
    assert len(first.pieces) >= CUT, "the reply ended before the cut: a longer reply is needed"
    sent = time.monotonic()
    retry = _stream(slow.port, path, body, piece)
    retry.read_until(lambda: False)
    retry.sock.close()
    # What was said before the hang-up comes at once (decoding it again would take
    # CUT * DELAY_MS = 1.5 s), and the retry holds the whole reply from its first piece.
    assert retry.text().startswith(said)
    # (in a piece or a few: what is told at once may go as one event)
    told, at = "", sent
    for at, text in retry.pieces:
        told += text
        if len(told) >= len(said):
            break
    assert at - sent < CUT * DELAY_MS / 1000 * 0.8, at - sent
    prompt, completion = _usage(path, _final_usage(path, retry))
    evaluated = _evaluated(slow.port) - before
    # Each position once: the prompt, then each generated token (the last one sampled need
    # not be evaluated). Decoding the cut part again would add CUT or more.
    assert prompt + completion - 1 <= evaluated <= prompt + completion + 1, (evaluated, prompt,
                                                                               completion)


def _final_usage(path: str, reader: Pieces) -> dict:
    event = reader.final
    if path == "/v1/responses":
        return event["response"]
    if path == "/v1/messages":
        start = next(json.loads(b.split("data: ", 1)[1]) for b in reader.blocks
                     if '"message_start"' in b)
        return {"usage": {"input_tokens": start["message"]["usage"]["input_tokens"],
                          "output_tokens": event["usage"]["output_tokens"]}}
    return event


@pytest.mark.parametrize("name", DIALECTS)
def test_a_blocking_request_cut_and_sent_again_is_decoded_once(slow, name):
    path, make, _ = DIALECTS[name]
    body = make(_unique())
    before = _evaluated(slow.port)
    s = post_open(slow.port, body, path)
    deadline = time.monotonic() + 60
    while True:   # the job's output, as GET /v1/jobs shows it, until the cut
        listed = call(slow.port, "GET", "/v1/jobs").json()["data"]
        mine = [j for j in listed if j["status"] == "in_progress"]
        if mine and mine[-1]["output"]["deltas"] >= CUT:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.05)
    s.close()
    retry = call(slow.port, "POST", path, body, timeout=120)
    assert retry.status == 200, retry.body
    reply = retry.json()
    assert len(_blocking_text(path, reply)) > 0
    prompt, completion = _usage(path, reply)
    evaluated = _evaluated(slow.port) - before
    assert prompt + completion - 1 <= evaluated <= prompt + completion + 1, (evaluated, prompt,
                                                                               completion)
    assert retry.headers["x-serve-job"] == mine[-1]["id"]


def test_a_job_whose_client_left_steps_aside_for_a_different_request(slow):
    path, make, piece = DIALECTS["chat"]
    left = _stream(slow.port, path, make(_unique()), piece)
    left.read_until(lambda: len(left.pieces) >= 5)
    job = _header(left.raw, "x-serve-job")
    left.sock.close()
    other = call(slow.port, "POST", path, {**make(_unique()), "max_tokens": 5}, timeout=120)
    assert other.status == 200
    state = call(slow.port, "GET", f"/v1/jobs/{job}").json()
    # It stopped at its next engine call once the other request waited: far short of its
    # TOKENS, and over before the other request's reply was.
    assert state["status"] == "incomplete", state
    assert state["output"]["deltas"] < TOKENS // 2, state


def test_a_different_request_never_attaches(slow):
    path, make, piece = DIALECTS["chat"]
    body = make(_unique())
    first = _stream(slow.port, path, body, piece)
    first.read_until(lambda: len(first.pieces) >= 3)
    job = _header(first.raw, "x-serve-job")
    first.sock.close()
    other = call(slow.port, "POST", path, {**body, "temperature": 0.5, "max_tokens": 3},
                 timeout=120)
    assert other.status == 200 and other.headers["x-serve-job"] != job


def test_stop_ends_the_reply_as_a_normal_finish(slow):
    path, make, piece = DIALECTS["chat"]
    reader = _stream(slow.port, path, make(_unique()), piece)
    reader.read_until(lambda: len(reader.pieces) >= 3)
    job = _header(reader.raw, "x-serve-job")
    stopped = call(slow.port, "POST", f"/v1/jobs/{job}/stop")
    assert stopped.status == 200 and stopped.json()["stop_requested"] is True
    reader.read_until(lambda: False)
    events = dechunk_partial_text(reader.raw)
    assert events.rstrip().endswith("data: [DONE]")
    assert '"finish_reason": "stop"' in events and '"error"' not in events
    state = call(slow.port, "GET", f"/v1/jobs/{job}").json()
    assert state["status"] == "stopped" and state["output"]["deltas"] < TOKENS
    # Another's credentials do not reach it.
    assert call(slow.port, "POST", f"/v1/jobs/{job}/stop",
                headers={"Authorization": "Bearer someone-else"}).status == 404


def _header(raw: bytes, name: str) -> str:
    head = raw.split(b"\r\n\r\n", 1)[0].decode()
    return next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                if line.lower().startswith(name + ":"))


def test_answer_now_closes_the_reasoning_and_the_stream_goes_on(slow):
    """POST /v1/jobs/{id}/answer mid-reasoning: the think channel closes at the next token,
    what was reasoned stays, and the same stream carries the answer."""
    path, make, _ = DIALECTS["chat"]

    def piece(event: dict) -> str:
        delta = ((event.get("choices") or [{}])[0].get("delta") or {})
        return ("R" if delta.get("reasoning_content") else "") + ("C" if delta.get("content") else "")
    body = {**make(_unique()), "reasoning_effort": "high", "max_tokens": 60}
    reader = _stream(slow.port, path, body, piece)
    reader.read_until(lambda: len(reader.pieces) >= 5)
    assert "C" not in reader.text(), "the model closed its reasoning itself: nothing to test"
    job = _header(reader.raw, "x-serve-job")
    answered = call(slow.port, "POST", f"/v1/jobs/{job}/answer")
    assert answered.status == 200 and answered.json()["answering"] is True
    reader.read_until(lambda: False)
    kinds = reader.text()
    assert dechunk_partial_text(reader.raw).rstrip().endswith("data: [DONE]")
    assert "C" in kinds and "R" not in kinds[kinds.index("C"):]
    assert kinds.count("R") < 30   # closed soon after the call, far short of max_tokens
    again = call(slow.port, "POST", f"/v1/jobs/{job}/answer").json()
    assert again["answering"] is False and again["status"] in ("completed", "incomplete")


def _reasoning_kinds(event: dict) -> str:
    """A letter per character said: R for reasoning, C for content (so a reply read in
    different events, one token each or told at once, reads the same)."""
    delta = ((event.get("choices") or [{}])[0].get("delta") or {})
    return "R" * len(delta.get("reasoning_content") or "") + "C" * len(delta.get("content") or "")


def _until(check: Callable[[], dict], what: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def _left(port: int, reader: Pieces) -> str:
    """The reader's client hangs up; the job's id, once the job knows nobody follows it."""
    job = _header(reader.raw, "x-serve-job")
    reader.sock.close()
    _until(lambda: "detached_seconds" in call(port, "GET", f"/v1/jobs/{job}").json(),
           "the job never saw its client leave")
    return job


def test_answer_now_reaches_a_job_whose_client_left(slow):
    """The client left mid-reasoning; answer now closes the reasoning of the job going on
    without it, and the same request sent again gets the whole reply: the reasoning as it
    was, then the answer."""
    path, make, _ = DIALECTS["chat"]
    body = {**make(_unique()), "reasoning_effort": "high", "max_tokens": 60}
    reader = _stream(slow.port, path, body, _reasoning_kinds)
    reader.read_until(lambda: len(reader.pieces) >= 5)
    assert "C" not in reader.text(), "the model closed its reasoning itself: nothing to test"
    job = _left(slow.port, reader)
    answered = call(slow.port, "POST", f"/v1/jobs/{job}/answer").json()
    assert answered["answering"] is True and answered["followed"] is False
    again = _stream(slow.port, path, body, _reasoning_kinds)
    again.read_until(lambda: False)
    assert _header(again.raw, "x-serve-job") == job   # attached: the same job, not a new one
    kinds = again.text()
    assert kinds.startswith(reader.text()) and "C" in kinds
    assert "R" not in kinds[kinds.index("C"):]
    assert dechunk_partial_text(again.raw).rstrip().endswith("data: [DONE]")
    state = call(slow.port, "GET", f"/v1/jobs/{job}").json()
    assert state["output"]["reasoning"] and state["output"]["content"]


def test_stop_reaches_a_job_whose_client_left(slow):
    path, make, piece = DIALECTS["chat"]
    reader = _stream(slow.port, path, make(_unique()), piece)
    reader.read_until(lambda: len(reader.pieces) >= 3)
    job = _left(slow.port, reader)
    assert call(slow.port, "POST", f"/v1/jobs/{job}/stop").json()["stop_requested"] is True
    state = _until(lambda: (s := call(slow.port, "GET", f"/v1/jobs/{job}").json())["status"]
                   != "in_progress" and s, "the stop never ended it")
    assert state["status"] == "stopped" and state["finish_reason"] == "stop"
    assert 3 <= state["output"]["deltas"] < TOKENS
