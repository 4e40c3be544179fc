"""Stop strings matched on text that arrives in arbitrary pieces.

A stop string can straddle any number of tokens, so text that could still be
the start of one is held back until the next piece settles it.
"""
from __future__ import annotations

from typing import Sequence


class StopFilter:
    """Feed text in pieces; get back what may be shown, cut at the first stop string."""

    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.hit = False
        self.matched = ""   # the stop string that ended the text, once `hit`

    def feed(self, text: str) -> str:
        """Returns the text that is now safe to emit; sets `hit` when a stop string completes."""
        if self.hit:
            return ""
        if not self._stops:
            return text
        buffer = self._pending + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.hit = True
            self.matched = min((s for s in self._stops if buffer.find(s) == cut), key=len)
            self._pending = ""
            return buffer[:cut]
        keep = self._longest_partial_suffix(buffer)
        self._pending = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, once no more text will come (it never became a stop string)."""
        tail, self._pending = self._pending, ""
        return "" if self.hit else tail

    def _first_match(self, buffer: str) -> int | None:
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _longest_partial_suffix(self, buffer: str) -> int:
        # Only a proper prefix of a stop string can be pending: a whole one would have matched.
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
