"""When a reply's reasoning ends: its token budget, or "answer now" from outside the run.

One `ReasoningBudget` per chat run that thinks (the Journal holds it as `reasoning`). The
reply reader counts the think-channel tokens the format's parser reports (`count`),
and generation asks after each token whether to close the channel (`due`): the budget
is spent, or another thread called `answer_now()`. Generation then hands the engine
the format's closing markup (`closing`, e.g. K3's `<|close|>think<|sep|><|open|>
response<|sep|>`) and the model goes on in its answer channel.

`answer_now` is a flag set from any thread and read once per token: no lock on the
token path (a bool's write and read are atomic in CPython, and a token that misses it
is followed by one that sees it).
"""
from __future__ import annotations

from typing import Optional, Sequence

from serve.core.reply import Usage
from serve.formats.base import ChatFormat
from serve.tokenizer.api import Tokenizer, tokenize_segments

BUDGET, ANSWER_NOW, MODEL = "budget", "answer_now", "model"   # what ended the reasoning


class ReasoningBudget:
    def __init__(self, limit: Optional[int], closing: Sequence[int]):
        """`limit`: think-channel tokens allowed (None: as many as the reply's own limit);
        `closing`: the ids that close the think channel and open the answer."""
        self.limit = limit
        self.closing = tuple(closing)
        self.tokens = 0                        # think-channel tokens the model generated
        self.ended_by: Optional[str] = None    # BUDGET, ANSWER_NOW or MODEL, once it ended
        self.anytime = True   # False: generation cannot close it between two budget points
        self._now = False

    def answer_now(self) -> bool:
        """From any thread: close the reasoning at the next token. False when the reasoning
        has already ended (there is nothing to close), or this run cannot close it
        (serve/service/steer.py: waste_generate on a prompt with images)."""
        self._now = True
        return self.ended_by is None and self.anytime

    def count(self, thinking: bool) -> None:
        """One generated token: read in the open think channel (`thinking`), or not: the
        first that is not (the model's own close) ends the reasoning as the model's doing."""
        if self.ended_by is not None:
            return
        if thinking:
            self.tokens += 1
        else:
            self.ended_by = MODEL

    def left(self) -> Optional[int]:
        """Think-channel tokens the budget still allows (None: no budget)."""
        return None if self.limit is None else max(0, self.limit - self.tokens)

    def due(self, thinking: bool) -> Optional[str]:
        """Close the think channel now? BUDGET or ANSWER_NOW when it must be (and it is
        open, with no markup half read: `thinking`), else None."""
        if self.ended_by is not None or not thinking:
            return None
        if self._now:
            return ANSWER_NOW
        return BUDGET if self.limit is not None and self.tokens >= self.limit else None

    def close(self, by: str) -> tuple[int, ...]:
        """The think channel is being closed for `by`: the ids to hand the engine."""
        self.ended_by = by
        return self.closing

    def account(self, usage: Usage) -> None:
        """The reply's usage says how many tokens reasoning took, and what ended it."""
        usage.reasoning_tokens = self.tokens
        usage.waste.update(reasoning_tokens=self.tokens, reasoning_budget=self.limit,
                           reasoning_ended=self.ended_by)


def closing_ids(chat_format: ChatFormat, tokenizer: Tokenizer) -> list[int]:
    """The ids of the format's reasoning_end, tokenized once, at start, while the engine is
    idle ([] without a think channel)."""
    if not chat_format.supports_reasoning:
        return []
    return tokenize_segments(tokenizer, chat_format.reasoning_end())
