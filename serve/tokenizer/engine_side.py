"""The engine's own tokenizer as a Tokenizer: every call goes through `run`.

For a thread that holds the engine, `run` calls at once; for one that waits
in front of it (a request checked before the queue), `run` is the engine
queue's errand (serve/engine/queue.py), which runs it between engine calls.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, TypeVar

from serve.engine.api import EngineApi

T = TypeVar("T")


class Runner(Protocol):
    def __call__(self, work: Callable[[], T]) -> T: ...


def at_once(work: Callable[[], T]) -> T:
    return work()


class EngineTokenizer:
    def __init__(self, engine: EngineApi, run: Runner = at_once):
        self._engine = engine
        self._run = run
        self.specials = engine.specials

    def tokenize(self, text: str) -> list[int]:
        return self._run(lambda: self._engine.tokenize(text))

    def tokenize_markup(self, text: str) -> list[int]:
        return self._run(lambda: self._engine.tokenize(text, markup=True))

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self._run(lambda: self._engine.detokenize(ids))
