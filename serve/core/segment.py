"""A piece of prompt text and how the engine tokenizes it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    text: str
    markup: bool  # True: waste_tokenize_markup (server-written structure); False: waste_tokenize
