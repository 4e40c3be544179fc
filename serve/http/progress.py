"""A stream's prefill progress, in a form every client reads or safely ignores.

Each chunk's `: prefill N/M` comment (what the chat page and people read) carries a
JSON object after it (serve/service/eta.py's report), and so does each heartbeat
while a chunk runs: the comment goes into the heartbeat's own bytes, so it rides on
the write the heartbeat makes anyway, and a stream in a chunk that lasts minutes
still counts down to its first token. An SSE parser skips a comment line (the HTML
standard's "a line starting with a colon: ignore it"; the openai and anthropic SDKs'
decoders do), and the comment it extends already reached every dialect's clients, so
none can take it for an event. llama.cpp's `return_progress` puts a
`prompt_progress` object on data chunks instead; a data chunk is something every
dialect's client must parse, and Anthropic's and Responses' have no place for it, so
serve keeps it in the comment. Ollama's NDJSON has no comments
(serve/dialects/framing.py): its stream carries no progress, and its client reads
the same report from GET /v1/jobs/{id} (the X-Serve-Job header names it).
"""
from __future__ import annotations

import json
from typing import Optional

from serve.service.eta import PrefillState


def prefill_comment(state: PrefillState, now: Optional[float] = None) -> str:
    """`prefill N/M {...}`: the report as of `now` (time.monotonic(); None: this moment)."""
    report = json.dumps(state.report(now), separators=(',', ':'))
    return f"prefill {state.done}/{state.positions} {report}"
