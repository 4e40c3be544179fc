"""What a request produces and where its output goes, between the service and the wire formats.

The service runs a request and hands its output, piece by piece, to the
request's `Journal` (serve/service/journal.py), which keeps it for the caller's own
thread or tells a `ReplySink`; when it is over it returns a `ChatReply` or
`CompletionReply`.
The wire formats (serve/dialects/openai.py, serve/dialects/anthropic.py, serve/dialects/responses.py)
read these and nothing else of the service.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from serve.core.reply import Delta, Usage


@dataclass(frozen=True)
class ReplyStart:
    """What a reply's first events can say before any of it is generated."""
    thinking: bool = False                # it opens in the think channel
    prompt_tokens: Optional[int] = None   # None while the prompt is not built (waiting in line)
    cached_tokens: int = 0                # of those, restored from a snapshot, as known before prefill


class ReplySink(Protocol):
    """The observer of a caller with no thread of its own (a test, a benchmark): told each
    event as it happens, on the thread running the request, and asked if its client left."""

    def accepted(self, thinking: bool) -> None:
        """The request passed its checks and will wait for the engine; `thinking`: its reply
        opens in the think channel."""

    def start(self) -> None:
        """The request was accepted and generation begins; errors after this are mid-reply."""

    def prefilling(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Prefill begins: the prompt holds `prompt_tokens` positions, `cached_tokens` of them
        restored from a snapshot. Called once, before the first chunk is evaluated."""

    def progress(self, done: int, total: int) -> None:
        """Prefill has evaluated `done` of `total` prompt positions."""

    def emit(self, delta: Delta) -> None:
        """One piece of output (a completion's text is its `content`)."""

    def client_left(self) -> bool:
        """True once the client has disconnected: generation stops at the next token."""

    def queued(self, ahead: int) -> None:
        """The request waits for the engine behind `ahead` others (the running one included);
        called again when that number changes."""

    def fetching(self, positions: int) -> None:
        """Before it waits, the request copies a snapshot of `positions` positions from the
        team's shared tier (seconds, or minutes on a slow share, for a long conversation)."""


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
