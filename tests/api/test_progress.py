"""Prefill progress a client can read, on the random K3 at a scaled clock: each chunk's
`: prefill N/M {...}` comment, estimating the first token from the measured rate, and each
heartbeat's in the same write as the heartbeat; the same report in GET /v1/jobs/{id}; and
every dialect's stream still parsing in its own SDK with the comments in it (Ollama's, with
no comments, still nothing but JSON)."""
from __future__ import annotations

import json
import re
import time

import anthropic
import openai
import pytest

from scripted import call, dechunk, post_open, read_all, real_service, serving, timed_blocks
from serve.snapshots.policy import SnapshotPolicy
from slow_clock import DIALECTS, prompt_text

DELAY_MS = "10"   # per evaluated token: a 64-position chunk lasts about 0.64 s
CHUNK = 64
BEAT = 0.15       # the heartbeat of the `beating` server: several in each chunk


@pytest.fixture(scope="module")
def service(lib_path, k3_container):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", DELAY_MS)
        # A policy that measures (the tests' SlowEnginePolicy holds fixed costs)
        with real_service(lib_path, k3_container, thinking=False, prefill_chunk=CHUNK,
                          snapshot_policy=SnapshotPolicy()) as service:
            yield service


@pytest.fixture(scope="module")
def k3(service):
    with serving(service) as srv:   # heartbeats every 10 s: none in these prompts
        yield srv


@pytest.fixture(scope="module")
def beating(service):
    with serving(service, heartbeat=BEAT) as srv:
        call(srv.port, "POST", "/v1/chat/completions",   # the prefill rate, measured once
             {"messages": [{"role": "user", "content": prompt_text(20, "rate")}], "max_tokens": 1})
        yield srv


def reports(blocks: list[tuple[float, str]]) -> list[tuple[float, int, int, dict]]:
    """(arrival, done, total, report) of each progress comment."""
    found = []
    for at, block in blocks:
        if block.startswith(": prefill "):
            counts, _, report = block[len(": prefill "):].partition(" ")
            done, total = map(int, counts.split("/"))
            found.append((at, done, total, json.loads(report)))
    return found


def test_the_first_tokens_estimate_after_a_chunk_is_within_a_quarter(k3):
    chat = DIALECTS["chat"]
    sent, blocks = timed_blocks(k3.port, chat.path, chat.body(prompt_text(60, "eta")))
    first_token = next(at for at, block in blocks if chat.token(block))
    found = reports(blocks)
    assert len(found) >= 4, [b for _, b in blocks][:5]
    for at, done, total, report in found:
        assert report["positions"] == total and report["restored"] == 0
        assert report["evaluated"] == done
        assert report["positions_per_second"] > 0   # measured from the first chunk on
    # Once one chunk has run: the estimate of what is left against what it took
    at, done, total, report = found[0]
    actual = first_token - at
    assert report["first_token_seconds"] == pytest.approx(actual, rel=0.25), (report, actual)
    assert report["first_token_at"] > 0


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_each_dialects_stream_with_progress_parses_in_its_own_sdk(beating, dialect):
    """Chunks' reports and heartbeats' both (the `beating` server beats several times a chunk)."""
    spec = DIALECTS[dialect]
    body = spec.body(prompt_text(20, f"sdk {dialect}"))
    _, blocks = timed_blocks(beating.port, spec.path, body)
    found = reports(blocks)
    assert found, "no progress comment: the prompt is too short to prove anything"
    # A heartbeat's report repeats its chunk's count: some came with heartbeats
    assert len({done for _, done, _, _ in found}) < len(found), found
    base = f"http://127.0.0.1:{beating.port}"
    fresh = {**body, "stream": True}
    if dialect == "chat":
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
            chunks = list(client.chat.completions.create(**{**fresh, "model": "m"}))
        assert chunks[-1].choices[0].finish_reason == "length"
    elif dialect == "responses":
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
            events = list(client.responses.create(**fresh))
        assert events[-1].type in ("response.completed", "response.incomplete")
    else:
        with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0) as client:
            with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
                message = s.get_final_message()
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


class Writes:
    """A stream read off a raw socket, one HTTP chunk (one send of the stream's writer) at a
    time, each with the time it was whole."""

    def __init__(self, port: int, path: str, body: dict):
        self.sock = post_open(port, body, path)
        self.raw = b""
        self.head = ""
        self.writes: list[tuple[float, str]] = []
        self.ended = False

    def read_until(self, done) -> None:
        while not self.ended and not done():
            data = self.sock.recv(65536)
            if not data:
                break
            self.raw += data
            self._parse(time.monotonic())

    def _parse(self, now: float) -> None:
        if not self.head:
            head, sep, rest = self.raw.partition(b"\r\n\r\n")
            if not sep:
                return
            self.head, self.raw = head.decode(), rest
        while True:
            size, crlf, rest = self.raw.partition(b"\r\n")
            if not crlf or len(rest) < int(size, 16) + 2:
                return
            n = int(size, 16)
            if n == 0:
                self.ended = True
                return
            self.writes.append((now, rest[:n].decode()))
            self.raw = rest[n + 2:]

    def header(self, name: str) -> str:
        return next(line.split(":", 1)[1].strip() for line in self.head.split("\r\n")
                    if line.lower().startswith(name + ":"))


NOTE = re.compile(r": prefill (\d+)/(\d+) (\{[^\n]*\})\n\n")


def notes(text: str) -> list[dict]:
    return [json.loads(m.group(3)) for m in NOTE.finditer(text)]


def test_each_heartbeat_in_prefill_carries_the_progress_in_its_own_write(beating):
    chat = DIALECTS["chat"]
    stream = Writes(beating.port, chat.path, chat.body(prompt_text(40, "beats")))
    def tokens(text: str) -> bool:
        return any(chat.token(block + "\n\n") for block in text.split("\n\n") if block)
    stream.read_until(lambda: any(tokens(text) for _, text in stream.writes))
    stream.sock.close()
    prefill = [text for _, text in stream.writes if not tokens(text)]
    beats = [text for text in prefill if ": keepalive" in text]
    assert len(beats) >= 4, prefill   # the prefill lasts some 3 s, a beat each BEAT
    # Every beat after the prompt's size is known says where it stands, in the beat's write:
    # the note just before the keepalive, no send of its own.
    told = [text for text in beats if NOTE.search(text)]
    assert len(told) >= len(beats) - 2, beats
    for text in told:
        assert re.search(r"\}\n\n: keepalive\n\n", text), text
    reports = [(": keepalive" in text, note) for text in prefill for note in notes(text)]
    # Before its first chunk ends, the stream has an estimate: the rate earlier prefills measured.
    first = next(note for beat, note in reports if beat)
    assert first["positions_per_second"] > 0 and first["first_token_seconds"] > 0, first
    # A beat after a chunk counts down to the same first token.
    pairs = [(chunk, note) for (was_beat, chunk), (beat, note) in zip(reports, reports[1:])
             if not was_beat and beat and note["evaluated"] == chunk["evaluated"]]
    assert pairs, reports
    for chunk, beat in pairs:
        assert beat["first_token_at"] == pytest.approx(chunk["first_token_at"], abs=0.1)
        assert beat["first_token_seconds"] < chunk["first_token_seconds"]


def test_a_job_shows_the_rate_and_estimate_its_stream_does(beating):
    chat = DIALECTS["chat"]
    stream = Writes(beating.port, chat.path, chat.body(prompt_text(40, "job")))
    chunk_notes = lambda: [n for _, t in stream.writes if ": keepalive" not in t for n in notes(t)]
    stream.read_until(lambda: len(chunk_notes()) >= 2)
    job = stream.header("x-serve-job")
    shown = call(beating.port, "GET", f"/v1/jobs/{job}").json()["prefill"]
    said = chunk_notes()[-1]
    assert shown["positions"] == said["positions"] and shown["restored"] == said["restored"]
    assert shown["evaluated"] >= said["evaluated"] and shown["positions_per_second"] > 0
    assert 0 < shown["first_token_seconds"] <= said["first_token_seconds"]
    # The same first token, or a later chunk's new estimate of it
    assert shown["first_token_at"] == pytest.approx(said["first_token_at"],
                                                    abs=max(0.5, said["first_token_seconds"] / 2))
    stream.read_until(lambda: False)
    stream.sock.close()
    done = call(beating.port, "GET", f"/v1/jobs/{job}").json()["prefill"]
    assert done["evaluated"] == done["positions"] - done["restored"] > 0
    assert done["first_token_seconds"] is None and done["positions_per_second"] > 0


def test_an_ollama_stream_in_prefill_is_still_nothing_but_json(beating):
    """NDJSON has no comments: Ollama's heartbeats stay empty pieces, its progress is GET's."""
    sock = post_open(beating.port, {"model": "m", "stream": True, "options": {"num_predict": 2},
                                    "messages": [{"role": "user", "content": prompt_text(30, "o")}]},
                     "/api/chat")
    lines = dechunk(read_all(sock)).decode().splitlines()
    pieces = [json.loads(line) for line in lines]   # each line parses, as Ollama's clients need
    beats = [p for p in pieces if not p["done"] and p["message"]["content"] == ""]
    assert len(beats) >= 3 and pieces[-1]["done"] is True
