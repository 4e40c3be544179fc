"""A stream's prefill progress, in a form every client reads or safely ignores.

Each chunk's `: prefill N/M` comment (what the chat page and people read) carries a
JSON object after it: an SSE parser skips a comment line (the HTML standard's "a line
starting with a colon: ignore it"; the openai and anthropic SDKs' decoders do), and the
comment it extends already reached every dialect's clients, so none can take it for an
event; it rides on the write each chunk already makes. llama.cpp's
`return_progress` puts a `prompt_progress` object on data chunks instead; a data
chunk is something every dialect's client must parse, and Anthropic's and Responses'
have no place for it, so serve keeps it in the comment.
"""
from __future__ import annotations

import json
import time

from serve.service.journal import Progress


def prefill_comment(event: Progress, restored: int) -> str:
    """`prefill N/M {...}`: positions in all, restored from a snapshot, evaluated so far
    (of the rest), the measured rate and when the first token is due, in seconds from now
    and as a Unix time (null until a rate is measured)."""
    spp = event.seconds_per_position
    eta = (event.total - event.done) * spp if spp else None
    report = {"positions": event.total, "restored": restored,
              "evaluated": event.done - restored,
              "positions_per_second": round(1.0 / spp, 3) if spp else None,
              "first_token_seconds": None if eta is None else round(eta, 3),
              "first_token_at": None if eta is None else round(time.time() + eta, 3)}
    return f"prefill {event.done}/{event.total} {json.dumps(report, separators=(',', ':'))}"
