"""A snapshot: an engine state on disk that holds exactly a list of tokens, and the tier that keeps one.

Its own module so that the local tier (cache.py) and the team's tier behind it
(shared.py) both name it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence


@dataclass(frozen=True)
class Snapshot:
    key: str
    tokens: tuple[int, ...]
    path: str       # the engine state file
    size: int       # bytes on disk, state and meta
    written: bool = False   # store() saved the state (rather than finding it kept already)
    namespace: str = ""     # whose it is (serve/snapshots/scope.py): its keys in either tier

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class LocalTier(Protocol):
    """What the shared tier needs of the local one it copies into (cache.py's PrefixCache)."""

    def store(self, tokens: Sequence[int], save: Callable[[str], None],
              namespace: str = "") -> Optional[Snapshot]:
        """Keep the state `save(path)` writes, which holds exactly `tokens`, in `namespace`;
        None when not kept."""
        ...
