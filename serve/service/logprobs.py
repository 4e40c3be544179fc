"""Logprobs on the stream of deltas, and their OpenAI shapes.

The decoder (serve/engine/decode.py) hands each token's entry to the request's
`LogprobLedger` before the token is reported; the request's Journal
(serve/service/journal.py) has the ledger put the entries of the tokens behind a
piece of answer text on the delta that carries it, as `Delta.logprobs`: a list
of entries in the shape of
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

from dataclasses import replace
from typing import Optional

from serve.core.reply import Delta


class LogprobLedger:
    """Token entries, held until the answer-text delta they belong to goes out."""

    def __init__(self, special_ids: frozenset[int]):
        self._special_ids = special_ids
        self._pending: list[dict] = []
        self.entries: list[dict] = []  # everything attached, in order: the blocking reply's

    def token(self, token: int, entry: Optional[dict]) -> None:
        if token in self._special_ids:
            self._pending.clear()   # structure: what came since (an element's header) is not text
        elif entry is not None:
            self._pending.append(entry)

    def attach(self, delta: Delta) -> Delta:
        """The delta, carrying the entries of the tokens behind its answer text."""
        if delta.content:
            if self._pending:
                delta = replace(delta, logprobs=self._pending)
                self.entries.extend(self._pending)
                self._pending = []
        elif delta.reasoning_content or delta.tool_call:
            self._pending = []   # those tokens were not answer text
        return delta


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
