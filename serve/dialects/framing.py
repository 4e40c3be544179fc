"""How a stream's events are framed on the wire: server-sent events, or NDJSON (Ollama's).

Every exchange names its framing: the stream's Content-Type, and what a line for
people and proxies (`: queue 2`, `: prefill 512/2048`) is in it. Server-sent
events have comments, which every client skips. NDJSON has none: Ollama's
clients parse each line as JSON (the `ollama` Python client calls `json.loads`
on every line, the blank one too), so nothing but whole JSON objects may go in
the stream, and those notes are left out. Its heartbeat is then the exchange's
own (serve/dialects/ollama.py): an empty chunk, `"content": ""` and `"done": false`, which
every Ollama client reads as a piece of reply that adds nothing, and which keeps a
client's and a proxy's read timeouts from firing in a long prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from serve.dialects.sse import json_text, sse_comment


@dataclass(frozen=True)
class Framing:
    content_type: str
    comment: Callable[[str], bytes]   # a note for people and proxies; b"" where none can go


def ndjson_line(payload: Any) -> bytes:
    """One NDJSON record: the object on one line (JSON escapes every newline inside it)."""
    return json_text(payload).encode() + b"\n"


SSE = Framing("text/event-stream", sse_comment)
NDJSON = Framing("application/x-ndjson", lambda text: b"")
