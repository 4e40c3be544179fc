"""What serve needs of a tokenizer: text to ids, with and without markup, and back.

Two things meet it: the off-engine tokenizer (serve/tokenizer/encoder.py), a
pure function of the container's files that any thread may call, and the
engine's own (waste_tokenize, waste_tokenize_markup, waste_detokenize) through
serve/tokenizer/engine_side.py, when the off-engine one is not equal to it
(serve/tokenizer/tokenizer_choice.py decides at start). Before a request holds the engine,
a Runner runs its whole tokenizing: at once, or as one errand of the engine
queue, between engine calls.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence, TypeVar

from serve.core.segment import Segment

T = TypeVar("T")


class Tokenizer(Protocol):
    specials: dict[str, int]   # special token text -> id

    def tokenize(self, text: str) -> list[int]:
        """Text as content: special tokens' texts are ordinary text (waste_tokenize)."""

    def tokenize_markup(self, text: str) -> list[int]:
        """Text serve wrote: special tokens' texts are their ids (waste_tokenize_markup)."""

    def detokenize(self, ids: Sequence[int]) -> bytes:
        """Ids -> their bytes, specials as their text (waste_detokenize)."""


def tokenize_segments(tokenizer: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    """Each segment on its own, by the entry point its `markup` picks: never concatenated
    (content would be read as markup) nor merged (BPE is not associative)."""
    ids: list[int] = []
    for segment in segments:
        ids.extend(tokenizer.tokenize_markup(segment.text) if segment.markup
                   else tokenizer.tokenize(segment.text))
    return ids


class Runner(Protocol):
    def __call__(self, work: Callable[[], T]) -> T: ...


def at_once(work: Callable[[], T]) -> T:
    return work()
