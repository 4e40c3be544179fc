"""What the engine is doing now: the state /health and /metrics report.

Operators and routers read it to place work; tests read it to know when the
server's idle-time work (settling snapshots, evicting, warming) is over, so
that what they inspect on disk no longer changes under them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ClassActivity:
    """One class of work (interactive, background) as the engine queue sees it."""
    waiting: int = 0              # requests of the class in line
    longest_wait: float = 0.0     # seconds the longest-waiting of them has waited
    waits: int = 0                # times one was handed the engine, since start
    wait_seconds: float = 0.0     # what those waits took in all
    engine_seconds: float = 0.0   # time the class held the engine, since start

    def as_json(self) -> dict:
        return {"queue": self.waiting, "longest_wait_s": round(self.longest_wait, 3),
                "waits": self.waits, "wait_s": round(self.wait_seconds, 3),
                "engine_s": round(self.engine_seconds, 3)}


@dataclass(frozen=True)
class Activity:
    busy: bool       # a request holds the engine
    queue: int       # requests waiting in line for it
    deferred: bool   # idle-time work (a snapshot to settle) is pending or running
    warming: bool    # --warm is running
    holder: Optional[str] = None   # the class of the request holding the engine
    classes: dict[str, ClassActivity] = field(default_factory=dict)
    preemptions: int = 0            # chores that stepped aside for a person, since start

    @property
    def idle(self) -> bool:
        """Nothing runs or waits: snapshot files and counters stay as they are."""
        return not (self.busy or self.queue or self.deferred or self.warming)

    def as_json(self) -> dict:
        return {"idle": self.idle, "busy": self.busy, "queue": self.queue, "deferred": self.deferred,
                "work": {"running": self.holder, "preemptions": self.preemptions,
                         **{work: c.as_json() for work, c in self.classes.items()}}}
