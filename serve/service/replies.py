"""What a request produces and where its output goes, between the service and the wire formats.

The service runs a request and hands its output, piece by piece, to the
request's `Journal` (serve/service/journal.py), which keeps it for the caller's own
thread or tells a `Listener`; when it is over it returns a `ChatReply` or
`CompletionReply`.
The wire formats (serve/dialects/openai.py, serve/dialects/anthropic.py, serve/dialects/responses.py)
read these and nothing else of the service.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from serve.core.reply import Usage


@dataclass(frozen=True)
class ReplyStart:
    """What a reply's first events can say before any of it is generated."""
    thinking: bool = False                # it opens in the think channel
    prompt_tokens: Optional[int] = None   # None while the prompt is not built (waiting in line)
    cached_tokens: int = 0                # of those, restored from a snapshot, as known before prefill


@dataclass
class ChatReply:
    message: dict
    finish_reason: str
    usage: Usage
    client_left: bool
    logprobs: Optional[dict] = None   # choices[].logprobs, when asked for
    stop_sequence: str = ""   # the stop string that ended the reply, if one did


@dataclass
class CompletionReply:
    text: str
    finish_reason: str
    usage: Usage
    client_left: bool
    logprobs: Optional[dict] = None
