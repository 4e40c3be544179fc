"""Engine-state snapshots keyed by the exact token prefix they hold.

A chat client resends the whole conversation every turn.  After a prompt is
prefilled, the engine's state is saved here under its token sequence; a later
prompt that extends that sequence loads the snapshot and prefills only the
rest.  A loaded state is bit-identical to a fresh prefill, so answers do not
change — the server stays stateless in behaviour while paying for each
conversation prefix once.

Snapshots live in a private temporary directory that is removed on close().
The cache is bounded in disk bytes and evicts the least recently used entry.
It belongs to one open engine (one container, one library), so snapshots
never cross containers or engine versions.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Snapshot:
    key: str
    tokens: tuple[int, ...]
    path: str
    size: int


def _key(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("i", tokens).tobytes()).hexdigest()


class PrefixCache:
    """Disk-bounded LRU of engine states. Thread-safe; owns its directory."""

    def __init__(self, capacity_bytes: int, parent_dir: Optional[str] = None):
        if capacity_bytes <= 0:
            raise ValueError("prefix cache capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.directory = tempfile.mkdtemp(prefix="serve-prefix-", dir=parent_dir)
        self._entries: "OrderedDict[str, Snapshot]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], limit: Optional[int] = None) -> Optional[Snapshot]:
        """The longest snapshot whose tokens are a proper prefix of `tokens`.

        `limit` caps the usable prefix length (e.g. the first image position:
        identical placeholder ids do not mean identical image embeddings).
        A proper prefix, because generation needs at least one new token.
        """
        longest = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        with self._lock:
            best: Optional[Snapshot] = None
            for snap in self._entries.values():
                n = len(snap.tokens)
                if n > longest or (best is not None and n <= len(best.tokens)):
                    continue
                if tuple(tokens[:n]) == snap.tokens:
                    best = snap
            if best is not None:
                self._entries.move_to_end(best.key)
            return best

    def store(self, tokens: Sequence[int], save: Callable[[str], None]) -> Optional[Snapshot]:
        """Snapshot the engine's current state, which holds exactly `tokens`.

        `save(path)` writes the state (Engine.save_state); what it raises is
        raised here, with nothing left on disk.  A snapshot larger than the
        whole cache is not kept.  Returns the new entry, or None.
        """
        key = _key(tokens)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        path = os.path.join(self.directory, key + ".state")
        try:
            save(path)
            size = os.path.getsize(path)
        except BaseException:
            _unlink(path)  # a half-written snapshot is no entry, and would hold disk until exit
            raise
        if size > self.capacity_bytes:
            _unlink(path)
            return None
        snap = Snapshot(key, tuple(tokens), path, size)
        with self._lock:
            self._entries[key] = snap
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.size
                _unlink(old.path)
        return snap

    def drop(self, snap: Snapshot) -> None:
        """Forget a snapshot (e.g. one that failed to load)."""
        with self._lock:
            if self._entries.pop(snap.key, None) is not None:
                self._bytes -= snap.size
        _unlink(snap.path)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
