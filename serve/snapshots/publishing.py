"""Publishing to the team's tier on a thread of its own, so the engine never waits for it.

A snapshot the local tier saved is copied to the shared directory when that
pays: on K3 seconds a checkpoint over NFS, which used to be spent holding the
engine. The engine's thread only opens the state file and queues it (an open
file stays readable when the local tier evicts it meanwhile); one publisher
thread copies the snapshots in order, one at a time.

- The line is bounded (MAX_WAITING): a new progress snapshot replaces the one it
  supersedes while that one still waits (it holds all of it), and otherwise a
  full line makes the engine's thread wait for room, so nothing is dropped.
- A progress snapshot superseded by a published one is unpublished after it.
- At shutdown, drain() publishes what waits within the drain time; then the copy
  under way stops between two chunks and removes its temporary file, and what
  was not started stays in the local tier only: no partial file is ever left.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, Protocol, Sequence

from serve.snapshots.snapshot import Snapshot

MAX_WAITING = 8   # snapshots queued for publishing, at most (each holds an open file)
IDLE_SECONDS = 1.0   # the publisher thread ends after this long with nothing to publish
JOIN_POLL = 0.1      # seconds between two looks at hurry() while drain() waits for the thread


class Tier(Protocol):
    """What the publisher needs of the shared tier (shared.py's SharedTier)."""

    def published(self, tokens: Sequence[int], namespace: str = "") -> int: ...

    def publish(self, snap: Snapshot, state: Optional[BinaryIO] = None,
                stop: Optional[Callable[[], bool]] = None) -> bool: ...

    def unpublish(self, snap: Snapshot) -> None: ...


@dataclass
class Job:
    snap: Snapshot
    state: Optional[BinaryIO]            # opened when queued; None: opened when published
    worth: Callable[[int], bool]         # the policy: does sparing this many positions pay?
    timed: Callable[[float], None]       # the policy: a publish took this many seconds
    supersedes: Optional[Snapshot] = None   # unpublished once this one is published

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def publish_now(tier: Tier, job: Job, stop: Optional[Callable[[], bool]] = None) -> bool:
    """Publish a snapshot when sparing another host its prefill pays; True when published."""
    snap = job.snap
    try:
        if not job.worth(snap.n_tokens - tier.published(snap.tokens, snap.namespace)):
            done = False
        else:
            started = time.monotonic()
            done = tier.publish(snap, job.state, stop)
            if done:
                job.timed(time.monotonic() - started)
        # A superseded progress snapshot goes once one holding all of it is there.
        if job.supersedes is not None \
                and tier.published(snap.tokens, snap.namespace) == snap.n_tokens:
            tier.unpublish(job.supersedes)
        return done
    finally:
        job.close()


class Publisher:
    """The publisher thread of one shared tier, started with a job when none runs."""

    def __init__(self, tier: Tier, max_waiting: int = MAX_WAITING):
        self._tier = tier
        self._max = max_waiting
        self._jobs: deque[Job] = deque()
        self._running: Optional[Job] = None
        self._cond = threading.Condition()
        self._closed = False
        self._halt = threading.Event()    # drain() ran out of time: stop the copy under way
        self._thread: Optional[threading.Thread] = None

    @property
    def pending(self) -> int:
        """Snapshots waiting or being published."""
        with self._cond:
            return len(self._jobs) + (self._running is not None)

    def submit(self, snap: Snapshot, worth: Callable[[int], bool],
               timed: Callable[[float], None], supersedes: Optional[Snapshot] = None) -> None:
        """Queue a snapshot the local tier just saved (on the engine's thread: one open())."""
        try:
            state: Optional[BinaryIO] = open(snap.path, "rb")
        except OSError:
            return   # gone already: nothing to publish
        job = Job(snap, state, worth, timed, supersedes)
        with self._cond:
            waiting = next((j for j in self._jobs if supersedes is not None
                            and j.snap.key == supersedes.key), None)
            if waiting is not None:   # not started: this one holds all of it
                self._jobs.remove(waiting)
                waiting.close()
                job.supersedes = waiting.supersedes
            self._cond.wait_for(lambda: len(self._jobs) < self._max or self._closed)
            if self._closed:
                job.close()
                return
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="publish", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until nothing waits or is being published; True when so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and self._running is None, timeout)

    def drain(self, timeout: float, hurry: Callable[[], bool] = lambda: False) -> bool:
        """At shutdown: no new jobs; publish what waits for up to `timeout` seconds, then stop
        the copy under way (its temporary file removed) and drop the rest (local only). True
        when everything queued was published. A copy stuck in one write (a lost mount) is
        waited for until `hurry()` (a second signal), then left to the process's exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        done = self.flush(timeout)
        if not done:
            self._halt.set()
            with self._cond:
                dropped, self._jobs = list(self._jobs), deque()
                self._cond.notify_all()
            for job in dropped:
                job.close()
        with self._cond:
            thread = self._thread
        while thread is not None and thread.is_alive() and not hurry():
            thread.join(JOIN_POLL)
        return done

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed, IDLE_SECONDS)
                if not self._jobs:
                    self._thread = None   # closed, or idle: the next job starts another
                    return
                self._running = job = self._jobs.popleft()
                self._cond.notify_all()   # room in line
            try:
                publish_now(self._tier, job, self._halt.is_set)
            except Exception:   # noqa: BLE001 - this thread must outlive any one publish
                pass   # a publish only spares other hosts work; the next may go through
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()
