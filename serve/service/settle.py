"""After a reply: remember its ids, snapshot the state that holds them, and settle the rest idly.

Reply memory keeps the ids the model produced, keyed by how the reply renders
as history (serve/snapshots/reply_memory.py), so the next turn's prompt holds them
instead of a re-tokenization. A snapshot right after generation spares the
next turn the whole conversation. But the next turn's history holds the whole
message as the renderer writes it: after a stop string, the reply again up to
the cut the client saw; after max_tokens, the closing markup the model never
wrote. Building that state is a `SettleJob`, done in idle time only (an idle
turn of the engine queue) and abandoned the moment a request waits. The settle
thread only waits for that turn; the engine's worker builds the state
(serve/engine/worker.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from serve.engine.types import UnencodableText, WasteError
from serve.engine.api import EngineApi
from serve.engine.queue import EngineQueue
from serve.service.generation import Outcome
from serve.snapshots.history_ids import overlay
from serve.tokenizer.api import Tokenizer
from serve.service.prefill import Prefill, PrefillCancelled, start_empty, store
from serve.snapshots.cache import PrefixCache
from serve.service.prompt import Prompt
from serve.snapshots.reply_memory import ReplyMemory
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.scope import Scope
from serve.core.segment import Segment

# Settling evaluates one token at a time: a request arriving meanwhile waits for
# one token's evaluation at most (about 2 s on K3).
SETTLE_CHUNK = 1


@dataclass(frozen=True)
class SettleJob:
    """The state the next turn will want, to build in idle time."""
    history: list[int]        # the conversation's ids before the reply's generation prompt
    rendered: list[Segment]   # the reply as the next turn's history renders it
    ids: list[int]            # the generation prompt's ids, then every generated id
    saved: int                # of `ids`, how many the snapshot made after generation holds
    scope: Scope              # whose the state is (the prompt's)


class Settler:
    def __init__(self, engine: EngineApi, tokenizer: Tokenizer, queue: EngineQueue,
                 cache: Optional[PrefixCache], policy: SnapshotPolicy,
                 memory: Optional[ReplyMemory], render_reply: Callable[[dict, bool], list[Segment]],
                 on_engine: Callable[[Callable[[], None]], None]):
        self.engine = engine
        self.on_engine = on_engine         # runs the engine's part on the engine's thread
        self.tokenizer = tokenizer         # called while this holds the engine
        self.queue = queue
        self.cache = cache
        self.policy = policy
        self.memory = memory
        self.render_reply = render_reply   # (message, thinking) -> its segments as history
        self._pending: Optional[SettleJob] = None
        self._running = 0                  # settle threads started and not yet finished
        self._count = threading.Lock()
        self._closed = False

    @property
    def deferred(self) -> bool:
        """A job is pending or running: counted until its thread has let the engine go."""
        with self._count:
            return self._running > 0

    def after_reply(self, prompt: Prompt, outcome: Outcome, message: dict) -> None:
        """Remember the reply's ids, snapshot the state that holds them, and leave the rest
        of the next turn's state to idle time. Runs while the request holds the engine."""
        rendered = self.render_reply(message, prompt.thinking) if outcome.tokens else []
        ids = [*prompt.generation, *outcome.tokens]
        if self.memory is not None and rendered:
            reasoning = message.get("reasoning_content") or ""
            dropped = self.render_reply({k: v for k, v in message.items() if k != "reasoning_content"},
                                        prompt.thinking) if reasoning else rendered
            self.memory.remember(rendered, ids, reasoning,
                                 (prompt.conversation, dropped) if dropped != rendered else None,
                                 prompt.scope.own)
        # A full context leaves no room for a next turn; snapshots never reach past images.
        if self.cache is None or outcome.context_full or prompt.image_paths:
            return
        saved = self._snapshot(prompt, outcome, ids)
        if self.memory is not None and rendered:
            self._pending = SettleJob(prompt.history, rendered, ids, saved, prompt.scope)
            with self._count:
                self._running += 1
            threading.Thread(target=self._settle_deferred, name="settle", daemon=True).start()

    def _snapshot(self, prompt: Prompt, outcome: Outcome, ids: Sequence[int]) -> int:
        """The state right after generation, stored when worth it; how many of `ids` it holds."""
        held = len(ids) - outcome.unevaluated   # of the reply's ids, those the state holds
        # A cancelled generate leaves a state the ABI does not describe (it asks for a reset).
        if outcome.result.cancelled:
            return 0
        tokens = [*prompt.ids, *ids[len(prompt.generation):held]]
        if not self.policy.worth("reply", len(tokens) - outcome.saved):
            self.policy.count("reply", False)
            return 0
        assert self.cache is not None   # settle() asks only with a cache
        return held if store(self.engine, self.cache, self.policy, tokens, "reply",
                             namespace=prompt.scope.own) else 0

    def drop(self) -> None:
        """A request took the engine: a job not yet started would build a stale state."""
        self._pending = None

    def _settle_deferred(self) -> None:
        try:
            self.settle()
        finally:
            with self._count:
                self._running -= 1

    def settle(self) -> None:
        """Build the pending job's state, in idle time only.

        It restores the longest snapshot of it and evaluates the rest, in small
        chunks; a request that starts waiting for the engine ends it at the next
        chunk. Runs on its own thread after a reply; tests call it to wait for it.
        """
        with self.queue.idle_turn() as yield_now:
            job, self._pending = self._pending, None
            if yield_now is None or job is None or self._closed or yield_now():
                return
            asked = yield_now
            self.on_engine(lambda: self._build(job, asked))

    def _build(self, job: SettleJob, yield_now: Callable[[], bool]) -> None:
        """The job's state, on the engine's thread, until done or a request waits."""
        try:
            tokens = job.history + overlay(self.tokenizer, job.rendered, job.ids)
            if tokens[len(job.history):] == job.ids[:job.saved]:
                return   # the snapshot after the reply is this state already
            start_empty(self.engine)
            run = Prefill(self.engine, tokens, cache=self.cache, policy=self.policy,
                          chunk=SETTLE_CHUNK, stop=lambda: yield_now() or self._closed,
                          insure=False, scope=job.scope)
            run.restore(len(tokens))
            run.evaluate(len(tokens))
            run.snapshot("reply")
        except (PrefillCancelled, UnencodableText, WasteError, OSError):
            pass   # the snapshot only spares the next turn work; that turn goes on without it
        finally:
            start_empty(self.engine)

    def close(self) -> None:
        """No more jobs: returns once none is running, before the engine closes."""
        self._closed = True
        self._pending = None
        self.queue.wait_idle()
