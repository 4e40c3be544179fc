"""The token ids the model generated for each reply, keyed by how the reply renders.

A client sends a reply back as text. Re-tokenizing that text seldom gives the
ids the model sampled (a character split across tokens, a rare merge), so the
next prompt would part from the state saved after generation just past where
the reply began. Remembering the ids lets the history use them instead.

Entries are keyed by a digest of the reply rendered as an assistant history
message (the segments the chat format writes for it), not by any wire field:
every dialect that renders the same internal message finds the same entry.
The memory belongs to one process and is bounded in bytes, least recently
used first out.
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from .xtml import Segment

DEFAULT_CAPACITY = 64 << 20   # about 16M remembered ids


@dataclass(frozen=True)
class Remembered:
    ids: array            # the generation prompt's ids, then every generated id ('i' array)
    reasoning: str        # what the reply said in its think channel, for --keep-reasoning

    @property
    def size(self) -> int:
        return self.ids.itemsize * len(self.ids) + len(self.reasoning.encode("utf-8", "replace"))


def digest(rendered: Sequence[Segment]) -> bytes:
    """A digest of rendered segments in which text and markup can never be confused."""
    h = hashlib.sha256()
    for segment in rendered:
        data = segment.text.encode("utf-8", "surrogatepass")
        h.update(b"M" if segment.markup else b"T")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class ReplyMemory:
    """Bounded LRU of replies: rendered reply -> the ids that produced it. Thread-safe."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY):
        if capacity_bytes <= 0:
            raise ValueError("reply memory capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self._by_rendering: "OrderedDict[bytes, Remembered]" = OrderedDict()
        # The same replies, keyed by their rendering without reasoning (--keep-reasoning).
        self._without_reasoning: dict[bytes, bytes] = {}
        self.used_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_rendering)

    def remember(self, rendered: Sequence[Segment], ids: Sequence[int], reasoning: str = "",
                 dropped: Optional[Sequence[Segment]] = None) -> None:
        """Keep `ids` for a reply that renders as `rendered`.

        `dropped`: the conversation before the reply followed by the reply
        rendered without its reasoning, which is what a client that drops
        reasoning sends back; given only when the reply had reasoning. The
        conversation is part of it because replies often differ in reasoning
        alone (an empty answer cut in the think channel, the same tool call).
        """
        entry = Remembered(array("i", ids), reasoning)
        if entry.size > self.capacity_bytes:
            return
        key = digest(rendered)
        stripped = digest(dropped) if dropped else None
        with self._lock:
            old = self._by_rendering.pop(key, None)
            if old is not None:
                self.used_bytes -= old.size
            self._by_rendering[key] = entry
            self.used_bytes += entry.size
            if stripped is not None:
                self._without_reasoning[stripped] = key
            while self.used_bytes > self.capacity_bytes:
                _, evicted = self._by_rendering.popitem(last=False)
                self.used_bytes -= evicted.size
            if len(self._without_reasoning) > 2 * len(self._by_rendering):
                self._without_reasoning = {k: v for k, v in self._without_reasoning.items()
                                           if v in self._by_rendering}

    def recall(self, rendered: Sequence[Segment]) -> Optional[Remembered]:
        """The reply that renders exactly as `rendered`, if remembered."""
        key = digest(rendered)
        with self._lock:
            entry = self._by_rendering.get(key)
            if entry is not None:
                self._by_rendering.move_to_end(key)
            return entry

    def recall_without_reasoning(self, dropped: Sequence[Segment]) -> Optional[Remembered]:
        """The remembered reply with reasoning that `dropped` (see remember) describes."""
        with self._lock:
            key = self._without_reasoning.get(digest(dropped))
            entry = self._by_rendering.get(key) if key is not None else None
            if entry is not None:
                self._by_rendering.move_to_end(key)
            return entry
