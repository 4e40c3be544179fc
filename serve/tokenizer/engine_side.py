"""The engine's own tokenizer as a Tokenizer: for a thread that holds the engine, or for
work the engine queue runs as an errand (serve/engine/queue.py), between engine calls."""
from __future__ import annotations

from typing import Sequence

from serve.engine.api import EngineApi


class EngineTokenizer:
    def __init__(self, engine: EngineApi):
        self._engine = engine
        self.specials = engine.specials

    def tokenize(self, text: str) -> list[int]:
        return self._engine.tokenize(text)

    def tokenize_markup(self, text: str) -> list[int]:
        return self._engine.tokenize(text, markup=True)

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self._engine.detokenize(ids)
