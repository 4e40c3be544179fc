"""One streamed generation in each of serve's five dialects, timed as a client reads it.

Every dialect gets the same question, greedy, thinking off, and the same number
of tokens; the chat dialects render the same prompt ids. Each stream is read as
it arrives and only its token events are stamped (the opening, closing and
heartbeat events are not), by a marker in their bytes, so the client stays light.
"""
from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass
from typing import Callable

QUESTION = "Tell me a long story about the sea."


@dataclass(frozen=True)
class Dialect:
    path: str
    body: Callable[[list[dict], str, int], dict]   # (messages, raw prompt, tokens) -> body
    separator: bytes                               # between two events
    is_token: Callable[[bytes], bool]              # does this event carry a token?


DIALECTS: dict[str, Dialect] = {
    "chat": Dialect(
        "/v1/chat/completions",
        lambda messages, _, n: {"messages": messages, "max_tokens": n, "temperature": 0,
                                "reasoning_effort": "none", "stream": True,
                                "stream_options": {"include_usage": True}},
        b"\n\n", lambda e: b'"delta": {"content": "' in e),
    "completions": Dialect(
        "/v1/completions",
        lambda _, prompt, n: {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}},
        b"\n\n", lambda e: b'"finish_reason": null' in e),
    "messages": Dialect(
        "/v1/messages",
        lambda messages, _, n: {"model": "m", "messages": messages, "max_tokens": n,
                                "temperature": 0, "thinking": {"type": "disabled"},
                                "stream": True},
        b"\n\n", lambda e: b'"text_delta"' in e),
    "responses": Dialect(
        "/v1/responses",
        lambda messages, _, n: {"model": "m", "input": messages, "max_output_tokens": n,
                                "temperature": 0, "reasoning": {"effort": "none"}, "stream": True},
        b"\n\n", lambda e: e.startswith(b"event: response.output_text.delta\n")),
    "ollama": Dialect(
        "/api/chat",
        lambda messages, _, n: {"model": "m", "messages": messages, "think": False, "stream": True,
                                "options": {"temperature": 0, "num_predict": n}},
        b"\n", lambda e: b'"done": false' in e and b'"content": ""' not in e),
}


# Every dialect's closing events say how many tokens were generated (in `waste`, at least).
_GENERATED = re.compile(rb'"completion_tokens": (\d+)')


def stream(port: int, dialect: Dialect, body: dict) -> tuple[list[float], int]:
    """POST `body` to `dialect` and read the stream to its end: the arrival time of each
    token event (events that arrive in one read share its time), and the tokens generated
    (a few tokens make no event of their own: their text goes out with the next one's)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", dialect.path, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"{dialect.path}: {resp.status} {resp.read()[:300]!r}")
    stamps: list[float] = []
    generated = 0
    pending = b""
    while chunk := resp.read1(1 << 16):
        now = time.perf_counter()
        events = (pending + chunk).split(dialect.separator)
        pending = events.pop()
        for event in events:
            if dialect.is_token(event):
                stamps.append(now)
            elif found := _GENERATED.search(event):
                generated = int(found[1])
    conn.close()
    if not stamps:
        raise SystemExit(f"{dialect.path}: no tokens streamed")
    return stamps, generated


def token_rate(stamps: list[float], generated: int) -> float:
    """Tokens/s from the first token event to the last, counting every generated token."""
    span = stamps[-1] - stamps[0]
    return (generated - 1) / span if len(stamps) > 1 and span > 0 else float("nan")
