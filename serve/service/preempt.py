"""A chore gives the engine to a person between two engine calls, and takes it back where it was.

Before each engine call (a prefill step, or the evaluation of a generated
token) a chore asks `due()`. When a person waits, `step_aside()` snapshots the
engine's state through the prefix cache (serve/snapshots/cache.py), lets the
person have the engine (serve/engine/queue.py's Turn.step_aside), and once the
chore's turn comes again restores that snapshot like any prefill restores one
(serve/service/prefill.py): nothing is evaluated twice. Should the snapshot have
been evicted meanwhile, the restore finds the longest one left and evaluates
the rest, which costs time, never correctness.

The chore's body runs on the engine's worker, deep in its stack, so its waiting
in line is handed back to the chore's own thread (EngineWorker.away,
serve/engine/worker.py), and meanwhile the worker runs the person's body nested
above the chore's frames. The generated tokens are part of what the chore
holds; the sampler's state (serve/engine/decode.py's generator and grammar)
stays in those frames, so decoding goes on as if nothing had happened.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from serve.engine.api import EngineApi
from serve.service.prefill import Prefill, start_empty, store
from serve.engine.queue import Turn, Waiter
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.scope import Scope


class Preemption:
    """A chore's way to step aside for a person (prefill.py's and decode.py's Pause)."""

    def __init__(self, engine: EngineApi, turn: Turn, waiter: Waiter,
                 away: Callable[[Callable[[], None]], None], cache: PrefixCache,
                 policy: SnapshotPolicy, chunk: int, scope: Scope,
                 log: Optional[Callable[[str], None]] = None, label: str = ""):
        self.engine, self.turn, self.waiter, self.scope = engine, turn, waiter, scope
        self.away = away   # runs the wait off the engine's thread, which serves others meanwhile
        self.cache, self.policy, self.chunk = cache, policy, chunk
        self.log, self.label = log, label

    def due(self) -> bool:
        """A person waits for the engine: step aside before the next engine call."""
        return self.turn.preempt_due()

    def step_aside(self, tokens: Sequence[int], held: int) -> bool:
        """The engine holds tokens[:held] (and tokens[held] is evaluated next). Save that,
        let the person have the engine, wait for it again, and restore it. False when the
        state could not be saved: the chore goes on, and asks again at its next call."""
        if held and store(self.engine, self.cache, self.policy, tokens[:held], "preempted",
                          namespace=self.scope.own) is None:
            return False
        if self.log is not None:
            self.log(f"{self.label} chore preempted at position {held}: a person waits")
        self.away(lambda: self.turn.step_aside(self.waiter))
        start_empty(self.engine)
        if not held:
            return True
        resume = Prefill(self.engine, tokens, cache=self.cache, policy=self.policy,
                         chunk=self.chunk, insure=False, scope=self.scope)
        resume.restore(held)
        resume.evaluate(held)   # nothing, unless the snapshot was evicted meanwhile
        if self.log is not None:
            self.log(f"{self.label} chore resumed at position {held}")
        return True
