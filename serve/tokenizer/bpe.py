"""Byte-pair merging of one piece: its bytes -> ids.

By rank (tiktoken's rule, and the reference engine's without tokenizer.merges):
repeatedly merge the adjacent pair whose concatenation has the lowest rank, the
leftmost on ties; a piece that is itself a token is that token. By merge list
(a converted GGUF's tokenizer.merges, Hugging Face's rule): merge the adjacent
pair listed earliest, never taking a whole piece as a shortcut. A heap of
candidate pairs, invalidated lazily, keeps a long piece O(n log n): a 50 KB run
of letters is one piece.

WARP merges a piece longer than 1024 bytes in windows of at most that many,
each ending on a UTF-8 boundary (`encode_windows`): no token spans a seam.
"""
from __future__ import annotations

import heapq
from typing import Optional

from serve.tokenizer.vocabulary import Vocabulary


class Merger:
    def __init__(self, vocab: Vocabulary):
        self.ranks = vocab.ranks
        self.merges = vocab.merges
        self.byte_ids = vocab.byte_ids

    def encode_windows(self, piece: bytes, window: int) -> list[int]:
        """`piece` merged in consecutive windows of at most `window` bytes, each but the
        last shortened while the byte after it continues a UTF-8 character."""
        if len(piece) <= window:
            return self.encode(piece)
        out: list[int] = []
        at = 0
        while at < len(piece):
            size = min(window, len(piece) - at)
            if at + size < len(piece):
                while size > 1 and piece[at + size] & 0xC0 == 0x80:
                    size -= 1
            out.extend(self.encode(piece[at:at + size]))
            at += size
        return out

    def encode(self, piece: bytes) -> list[int]:
        n = len(piece)
        if n == 1:
            return [self.byte_ids[piece[0]]]
        if self.merges is None:
            whole = self.ranks.get(piece)
            if whole is not None:
                return [whole]
        # Symbols as byte spans: size[i] is the length of the symbol starting at i (0 inside
        # one), prev[i] the start of the symbol before it.
        size = [1] * n
        prev = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, int]] = []   # (rank, start, left size, right size)
        for i in range(n - 1):
            self._push(heap, piece, i, 1, 1)
        while heap:
            _, at, left, right = heapq.heappop(heap)
            if size[at] != left or at + left >= n or size[at + left] != right:
                continue   # stale: one of its symbols has merged since
            size[at + left] = 0
            merged = size[at] = left + right
            end = at + merged
            if end < n:
                prev[end] = at
                self._push(heap, piece, at, merged, size[end])
            if at > 0:
                before = prev[at]
                self._push(heap, piece, before, size[before], merged)
        out, i = [], 0
        while i < n:
            k = size[i]
            out.append(self.byte_ids[piece[i]] if k == 1 else self.ranks[piece[i:i + k]])
            i += k
        return out

    def _push(self, heap: list, piece: bytes, at: int, left: int, right: int) -> None:
        rank = self._rank(piece[at:at + left], piece[at + left:at + left + right])
        if rank is not None:
            heapq.heappush(heap, (rank, at, left, right))

    def _rank(self, left: bytes, right: bytes) -> Optional[int]:
        if self.merges is None:
            return self.ranks.get(left + right)
        a, b = self.ranks.get(left), self.ranks.get(right)
        return None if a is None or b is None else self.merges.get((a, b))
