"""Logprobs on the stream of deltas, and their OpenAI shapes.

The decoder (serve/engine/decode.py) hands each token's entry to a `LogprobTrail`
before the token is reported; the trail wraps the request's sink and puts
the entries of the tokens behind a piece of answer text on the delta that
carries it, as `delta["logprobs"]`: a list of entries in the shape of
OpenAI chat's `choices[].logprobs.content[]`:

    {"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob", "bytes"}]}

Only answer text carries logprobs (chat `content`, completions `text`), as in
OpenAI's API: tokens of reasoning, tool calls and markup are left out. A token
whose text is held back (an incomplete UTF-8 character, a possible stop
string) rides on the next delta that shows text; text a stop string cut away
takes its tokens' entries with it. Every wire format shapes these entries
itself: `chat_logprobs` and `completion_logprobs` below.
"""
from __future__ import annotations

from typing import Any, Optional

from serve.service.replies import ReplySink


class LogprobTrail:
    """A sink wrapper that attaches pending token entries to the next answer-text delta."""

    def __init__(self, sink: ReplySink, special_ids: frozenset[int], text_key: str):
        self._sink = sink
        self._special_ids = special_ids
        self._text_key = text_key     # "content" for chat, "text" for completions
        self._pending: list[dict] = []
        self.entries: list[dict] = []  # everything attached, in order: the blocking reply's

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)   # start, progress, gone and any later sink method

    def token(self, token: int, entry: Optional[dict]) -> None:
        if token in self._special_ids:
            self._pending.clear()   # structure: what came since (an element's header) is not text
        elif entry is not None:
            self._pending.append(entry)

    def emit(self, delta: dict) -> None:
        if delta.get(self._text_key):
            if self._pending:
                delta = {**delta, "logprobs": self._pending}
                self.entries.extend(self._pending)
                self._pending = []
        elif "reasoning_content" in delta or "tool_calls" in delta:
            self._pending = []   # those tokens were not answer text
        self._sink.emit(delta)


def text_length(entry: dict) -> int:
    """How many characters of text a token adds (a partial character counts as its bytes do)."""
    return len(bytes(entry["bytes"]).decode("utf-8", "replace"))


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI completions' legacy shape; text_offset counts from `offset` (characters)."""
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(entry["token"])
        offsets.append(offset)
        offset += text_length(entry)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            # The sampled token is always listed, so a dict may hold logprobs + 1 entries.
            "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]},
                              e["token"]: e["logprob"]} for e in entries],
            "text_offset": offsets}
