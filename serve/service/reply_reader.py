"""Generated tokens -> the reply: deltas for the sink, cut at stop strings, and the whole at the end.

A chat reply goes through its chat format's parser (reasoning, content, tool
calls); a completion's is plain UTF-8 text. Both hold back text that could
still be the start of a stop string (serve/core/stops.py).
"""
from __future__ import annotations

import codecs
from typing import Callable, Collection, Optional, Protocol, Sequence

from serve.formats.base import ReplyParser
from serve.core.reply import assistant_message, Delta
from serve.core.stops import StopFilter
from serve.service.reasoning_budget import ReasoningBudget

Emit = Callable[[Delta], None]


class ReplyReader(Protocol):
    def feed(self, token: int, piece: bytes, emit: Emit) -> bool:
        """One generated token; True once the reply is done."""

    def finish(self, emit: Emit) -> None:
        """Generation stopped without a stop string and with the client there: show what is
        still held back."""

    @property
    def stopped(self) -> bool:
        """A stop string cut the reply."""

    @property
    def ended(self) -> bool:
        """The reply ended by itself (a stop string, or its message closed)."""

    @property
    def has_tool_calls(self) -> bool: ...

    @property
    def thinking(self) -> bool:
        """The think channel is open and no markup is half read (ReplyParser.thinking)."""


class ChatReader:
    def __init__(self, parser: ReplyParser, stops: Sequence[str], stop_tokens: Collection[int],
                 max_calls: Optional[int] = None, budget: Optional[ReasoningBudget] = None):
        """`budget`: counts the tokens read in the think channel."""
        self._parser = parser
        self._budget = budget
        self._stops = StopFilter(stops)
        self._stop_ids = frozenset(stop_tokens)
        # parallel_tool_calls: false. A grammar allows one call; without one (a format that
        # asks in its prompt alone) the reply is cut where a second call opens.
        self._max_calls = max_calls
        self._over = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, token: int, piece: bytes, emit: Emit) -> bool:
        closed = self._parser.ended
        if self._budget is None:
            self._forward(self._parser.feed_token(token, piece), emit)
        else:   # the think channel's own tokens, not its close
            thinking = self._parser.thinking
            self._forward(self._parser.feed_token(token, piece), emit)
            self._budget.count(thinking and self._parser.thinking)
        if self._stops.hit or self._over:
            return True
        # A stop token ends generation by itself, and an uncancelled generate leaves a
        # state worth a snapshot. So once the message has closed, the model gets one more
        # token for the stop token that follows: anything else is cancelled.
        return closed and token not in self._stop_ids

    def finish(self, emit: Emit) -> None:
        self._forward(self._parser.finish(), emit)
        tail = self._stops.flush()
        if tail:
            self._content.append(tail)
            emit(Delta(content=tail))

    def _forward(self, deltas: list[Delta], emit: Emit) -> None:
        for d in deltas:
            if d.reasoning_content:
                self._reasoning.append(d.reasoning_content)
                emit(d)
            elif d.content:
                shown = self._stops.feed(d.content)
                if shown:
                    self._content.append(shown)
                    emit(d if shown == d.content else Delta(content=shown))
            elif d.tool_call:
                if self._max_calls is not None and d.tool_call["index"] >= self._max_calls:
                    self._over = True
                    return
                emit(d)

    @property
    def stopped(self) -> bool:
        return self._stops.hit

    @property
    def ended(self) -> bool:
        return self._stops.hit or self._over or self._parser.ended

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._parser.reply.tool_calls)

    @property
    def thinking(self) -> bool:
        return self._parser.thinking

    @property
    def stop_sequence(self) -> str:
        return self._stops.matched

    def message(self) -> dict:
        """The assistant message as the client receives it."""
        return assistant_message("".join(self._content), "".join(self._reasoning),
                                 self._parser.reply.tool_calls[:self._max_calls])


class TextReader:
    has_tool_calls = False
    thinking = False

    def __init__(self, stops: Sequence[str], special_ids: Collection[int]):
        self._stops = StopFilter(stops)
        self._special_ids = frozenset(special_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []

    def feed(self, token: int, piece: bytes, emit: Emit) -> bool:
        if token not in self._special_ids:  # control tokens (e.g. EOS) are not text
            self._show(self._stops.feed(self._decoder.decode(piece)), emit)
        return self._stops.hit

    def finish(self, emit: Emit) -> None:
        self._show(self._stops.feed(self._decoder.decode(b"", final=True)), emit)
        self._show(self._stops.flush(), emit)

    def _show(self, piece: str, emit: Emit) -> None:
        if piece:
            self._text.append(piece)
            emit(Delta(content=piece))

    @property
    def stopped(self) -> bool:
        return self._stops.hit

    ended = stopped

    @property
    def text(self) -> str:
        return "".join(self._text)
