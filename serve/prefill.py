"""Prefill a prompt in watchable, interruptible chunks, reusing snapshots.

The engine state must be empty on entry; on return it holds tokens[:upto].
What follows `upto` is left to waste_generate, which needs at least one
prompt token of its own.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from .checkpoints import SPACING, spaced
from .engine import WasteError
from .engine_api import EngineApi
from .prefix_cache import PrefixCache

# Large enough that an engine batching a chunk internally loses nothing,
# small enough that a vanished client is noticed within a few seconds.
DEFAULT_CHUNK = 512


class PrefillCancelled(Exception):
    """The client went away between two prefill chunks."""


def start_empty(engine: EngineApi) -> None:
    """An empty conversation and image queue: nothing earlier work left, failed or not,
    may reach what comes next (the ABI does not say reset drops the queue)."""
    engine.reset()
    engine.image_clear()


def prefill(engine: EngineApi, tokens: Sequence[int], upto: int, *, cache: Optional[PrefixCache] = None,
            snapshot_at: Sequence[int] = (), chunk: int = DEFAULT_CHUNK,
            progress: Optional[Callable[[int, int], None]] = None,
            cancelled: Optional[Callable[[], bool]] = None, min_snapshot: int = 0,
            spacing: int = SPACING, restored: Optional[Callable[[int], None]] = None) -> int:
    """Restore the longest cached prefix of tokens[:upto], evaluate the rest of it.

    `snapshot_at` lists positions worth a snapshot (e.g. the end of the tools
    block, of the system prompt, of the conversation before the generation
    prompt); every multiple of `spacing` is one too.  Those past `upto` are
    not reached.  A prompt shorter than `min_snapshot` that restored nothing
    saves nothing: re-prefilling it costs little, and a prompt that shares
    nothing with the cache is most likely asked once.  `restored` hears how
    many positions came from a snapshot before any chunk is evaluated (a
    stream's first events say it); the same number is returned.
    """
    if not 0 <= upto < len(tokens):
        raise ValueError("prefill must leave at least one prompt token to generate")
    pos = 0
    if cache is not None:
        snap = cache.lookup(tokens, limit=upto)
        if snap is not None:
            try:
                engine.load_state(snap.path)
                pos = len(snap.tokens)
            except WasteError:
                cache.drop(snap)
                engine.reset()
            else:
                cache.note_restored(pos)
    cached = pos
    if restored is not None:
        restored(cached)
    worth_it = cache is not None and (cached > 0 or upto >= min_snapshot)
    marks = sorted({p for p in [*snapshot_at, *spaced(pos, upto, spacing)]
                    if pos < p <= upto}) if worth_it else []
    for target in marks + [upto]:
        while pos < target:
            if cancelled is not None and cancelled():
                raise PrefillCancelled()
            step = min(chunk, target - pos)
            engine.eval(tokens[pos:pos + step])
            pos += step
            if progress is not None:
                progress(pos, len(tokens))
        if cache is not None and target in marks:
            try:
                cache.store(tokens[:pos], engine.save_state)
            except (WasteError, OSError):
                pass  # a snapshot only spares later requests work; this one goes on without it
    return cached
