"""Prefill a prompt in watchable, interruptible chunks, reusing snapshots.

The engine state must be empty on entry.  On return it holds a prefix of the
prompt, and `Prefill.remaining` (never empty) is what waste_generate must
still append: generation needs at least one prompt token of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .engine import WasteError
from .prefix_cache import PrefixCache

# Large enough that an engine batching a chunk internally loses nothing,
# small enough that a vanished client is noticed within a few seconds.
DEFAULT_CHUNK = 512


class PrefillCancelled(Exception):
    """The client went away between two prefill chunks."""


@dataclass
class Prefill:
    cached_tokens: int       # positions restored from a snapshot
    remaining: list[int]     # still to be appended by generate (>= 1 token)


def prefill(engine, tokens: Sequence[int], *, cache: Optional[PrefixCache] = None,
            snapshot_at: Sequence[int] = (), image_start: Optional[int] = None,
            chunk: int = DEFAULT_CHUNK,
            progress: Optional[Callable[[int, int], None]] = None,
            cancelled: Optional[Callable[[], bool]] = None) -> Prefill:
    """Restore the longest cached prefix of `tokens`, then eval up to the end.

    `snapshot_at` lists positions worth a snapshot (e.g. the end of the
    conversation before the generation prompt).  `image_start` is the first
    image placeholder position: no snapshot is used or made past it, and the
    image part is left to generate in one call, since an engine may consume
    its whole image queue on the next eval.
    """
    if not tokens:
        raise ValueError("empty prompt")
    end = len(tokens) - 1 if image_start is None else min(len(tokens) - 1, image_start)
    pos = 0
    if cache is not None:
        snap = cache.lookup(tokens, limit=end)
        if snap is not None:
            try:
                engine.load_state(snap.path)
                pos = len(snap.tokens)
            except WasteError:
                cache.drop(snap)
                engine.reset()
    cached = pos
    marks = sorted({p for p in snapshot_at if pos < p <= end}) if cache is not None else []
    for target in marks + [end]:
        while pos < target:
            if cancelled is not None and cancelled():
                raise PrefillCancelled()
            step = min(chunk, target - pos)
            engine.eval(tokens[pos:pos + step])
            pos += step
            if progress is not None:
                progress(pos, len(tokens))
        if cache is not None and target in marks:
            cache.store(tokens[:pos], engine.save_state)
    return Prefill(cached_tokens=cached, remaining=list(tokens[pos:]))
