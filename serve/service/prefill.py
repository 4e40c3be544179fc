"""Prefill a prompt in watchable, interruptible chunks, reusing snapshots and placing new ones.

The engine state must be empty on entry; after a run it holds tokens[:upto].
A request leaves what follows `upto` to waste_generate, which needs at least
one prompt token of its own.

Every chunk, save and load is timed for the snapshot policy
(serve/snapshots/policy.py), which says where a snapshot pays. Between two
chunks the prefill asks `stop()`; a prefill that stops first snapshots what it
has when that pays, so that whoever resumes it (the client's retry, a warm
once the engine is idle again) restores it instead of prefilling it again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from serve.snapshots.checkpoints import spaced
from serve.engine.binding import REFERENCE_BUILD
from serve.engine.types import WasteError
from serve.engine.api import EngineApi
from serve.snapshots.cache import PrefixCache, Snapshot
from serve.snapshots.lookup import Lookup
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.scope import NO_SCOPE, Scope
from serve.snapshots import tiers

# A prefill is handed to the engine in steps of the engine's own batch: a longer
# call gains nothing, and holds the engine longer between chances to do anything
# else (preempt a chore, notice a hang-up, serve a waiting request). WARP's
# libwaste evaluates 64 positions per internal step (WASTE_CHUNK_MAX in its
# src/model.h); the reference engine costs the same per position from 512 on
# (bench/prefill_step.py). The ABI has no call that says, so the build tells.
REFERENCE_STEP = 512
WARP_STEP = 64
DEFAULT_CHUNK = REFERENCE_STEP


def engine_step(build_info: str) -> int:
    """The prefill step for a libwaste, by its waste_build_info(): the reference engine's,
    else WARP's (the production engine; smaller steps are never wrong, only slower)."""
    return REFERENCE_STEP if build_info.startswith(REFERENCE_BUILD) else WARP_STEP


class Pause(Protocol):
    """A chore's chance to step aside for a person before an engine call (preempt.py)."""

    def due(self) -> bool: ...

    def step_aside(self, tokens: Sequence[int], held: int) -> bool:
        """The engine holds tokens[:held]; it holds them again on return. True when it
        stepped aside, a snapshot of tokens[:held] saved."""


class PrefillCancelled(Exception):
    """The prefill stopped between two chunks (its client left, a request waits, shutdown)."""


@dataclass(frozen=True)
class Prefilled:
    cached: int   # positions restored from a snapshot
    saved: int    # positions the longest snapshot of the prefilled prefix holds now (0: none)


def start_empty(engine: EngineApi) -> None:
    """An empty conversation and image queue: nothing earlier work left, failed or not,
    may reach what comes next (the ABI does not say reset drops the queue)."""
    engine.reset()
    engine.image_clear()


def store(engine: EngineApi, cache: PrefixCache, policy: SnapshotPolicy, tokens: Sequence[int],
          kind: str, supersedes: Optional[Snapshot] = None, namespace: str = ""
          ) -> Optional[Snapshot]:
    """Snapshot the engine's state, which holds exactly `tokens`, in `namespace` (whose it
    is: serve/snapshots/scope.py), timing the save for the
    policy, and publish it for the team off the engine's thread when that pays. None when
    it could not be saved: a snapshot only spares later requests work, and this one goes
    on without it. `supersedes`: a progress snapshot this one holds all of (its shared copy
    goes once this one is published)."""
    started = time.monotonic()
    try:
        snap = cache.store(tokens, engine.save_state, namespace)
    except (WasteError, OSError):
        snap = None
    if snap is not None and snap.written:
        policy.saved_state(snap.size, time.monotonic() - started)
    policy.count(kind, snap is not None)
    if snap is not None:
        tiers.publish_later(cache, policy, snap, supersedes)
    return snap


class Prefill:
    """One prompt's prefill: restore() the longest snapshot, then run() to a position."""

    def __init__(self, engine: EngineApi, tokens: Sequence[int], *, cache: Optional[PrefixCache],
                 policy: SnapshotPolicy, chunk: int = DEFAULT_CHUNK,
                 progress: Optional[Callable[[int, int], None]] = None,
                 stop: Optional[Callable[[], bool]] = None, insure: bool = True,
                 pause: Optional[Pause] = None, scope: Scope = NO_SCOPE):
        """`insure`: consider a progress snapshot at each chunk boundary (off for work that
        snapshots where it stops anyway, and evaluates a token at a time); `pause`: a
        chore's, asked before each chunk; `scope`: whose snapshots it restores and stores."""
        self.engine, self.tokens, self.cache, self.policy = engine, tokens, cache, policy
        self.chunk, self.progress, self.stop, self.insure = chunk, progress, stop, insure
        self.pause, self.scope = pause, scope
        self.pos = 0        # positions the engine holds
        self.cached = 0     # of those, restored from a snapshot
        self.saved = 0      # the longest snapshot of tokens[:pos]
        self._snapshots = cache is not None
        self._rolling: Optional[Snapshot] = None   # the latest progress snapshot, until superseded

    def restore(self, limit: int, early: Optional[Lookup] = None) -> int:
        """Load the longest snapshot of tokens[:limit], if any; the positions it holds.

        `early`: the lookup made while the request waited for the engine (tiers.find:
        hashed, verified, fetched from the shared tier), only brought up to date here
        (tiers.claim); without one it is made now, on the engine (idle-time work)."""
        if self.cache is None:
            return 0
        if early is None:
            early = tiers.find(self.cache, self.policy, self.tokens, limit, scope=self.scope)
        lookup = tiers.claim(self.cache, self.policy, early)
        snap = lookup.found
        if snap is None:
            return 0
        started = time.monotonic()
        try:
            self.engine.load_state(snap.path)
        except WasteError:
            self.cache.drop(snap)
            self.engine.reset()
            return 0
        # The check counts toward a load's cost wherever it ran (a fetch is timed apart).
        self.policy.loaded_state(lookup.checked + time.monotonic() - started)
        self.cache.note_restored(snap.n_tokens)
        self.pos = self.cached = self.saved = snap.n_tokens
        return self.cached

    def evaluate(self, upto: int, snapshot_at: Sequence[int] = ()) -> Prefilled:
        """Evaluate up to `upto`, snapshotting the checkpoints in `snapshot_at` and the
        progress in between where the policy says they pay. Raises PrefillCancelled when
        stop() says so between two chunks, after snapshotting what it has if that pays."""
        if not self.pos <= upto <= len(self.tokens):
            raise ValueError(f"cannot prefill to {upto} from {self.pos} of {len(self.tokens)} tokens")
        policy = self.policy
        self._snapshots = self.cache is not None and policy.snapshots_at_all(self.cached, upto)
        checkpoints = {p for p in snapshot_at if self.pos < p <= upto} if self._snapshots else set()
        fixed = set(spaced(self.pos, upto, policy.spacing)) \
            if self._snapshots and policy.spacing is not None else set()
        for target in sorted(checkpoints | fixed | {upto}):
            while self.pos < target:
                if self.stop is not None and self.stop():
                    self.snapshot("stopped")
                    raise PrefillCancelled()
                if self.pause is not None and self.pause.due() \
                        and self.pause.step_aside(self.tokens, self.pos):
                    self.saved = self.pos
                step = min(self.chunk, target - self.pos)
                started = time.monotonic()
                self.engine.eval(self.tokens[self.pos:self.pos + step])
                policy.prefilled(step, time.monotonic() - started)
                self.pos += step
                if self.progress is not None:
                    self.progress(self.pos, len(self.tokens))
                if self.pos < target and self.insure and policy.spacing is None:
                    self.snapshot("progress")
            if target in checkpoints:
                self.snapshot("checkpoint")
            elif target in fixed:
                self.snapshot("progress")
        return Prefilled(self.cached, self.saved)

    def snapshot(self, kind: str) -> None:
        """Snapshot tokens[:pos] when the policy says a snapshot of `kind` pays here."""
        if not self._snapshots or self.pos == self.saved:
            return
        if not self.policy.worth(kind, self.pos - self.saved, first=self.saved == 0):
            if kind != "progress":   # considered at every chunk: its skips say nothing
                self.policy.count(kind, False)
            return
        assert self.cache is not None   # _snapshots says there is one
        snap = store(self.engine, self.cache, self.policy, self.tokens[:self.pos], kind,
                     supersedes=self._rolling, namespace=self.scope.own)
        if snap is None:
            return
        if self._rolling is not None:
            self.cache.drop(self._rolling)   # this one holds all it did
        self._rolling = snap if kind == "progress" and self.policy.spacing is None else None
        self.saved = self.pos


def prefill(engine: EngineApi, tokens: Sequence[int], upto: int, *,
            cache: Optional[PrefixCache] = None, policy: Optional[SnapshotPolicy] = None,
            snapshot_at: Sequence[int] = (), chunk: int = DEFAULT_CHUNK,
            progress: Optional[Callable[[int, int], None]] = None,
            stop: Optional[Callable[[], bool]] = None) -> Prefilled:
    """Restore the longest snapshot of tokens[:upto] and evaluate the rest of it."""
    run = Prefill(engine, tokens, cache=cache, policy=policy or SnapshotPolicy(), chunk=chunk,
                  progress=progress, stop=stop)
    run.restore(upto)
    return run.evaluate(upto, snapshot_at)
