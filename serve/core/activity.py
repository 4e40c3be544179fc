"""What the engine is doing now: the state /health and /metrics report.

Operators and routers read it to place work; tests read it to know when the
server's idle-time work (settling snapshots, evicting, warming) is over, so
that what they inspect on disk no longer changes under them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activity:
    busy: bool       # a request holds the engine
    queue: int       # requests waiting in line for it
    deferred: bool   # idle-time work (a snapshot to settle) is pending or running
    warming: bool    # --warm is running

    @property
    def idle(self) -> bool:
        """Nothing runs or waits: snapshot files and counters stay as they are."""
        return not (self.busy or self.queue or self.deferred or self.warming)

    def as_json(self) -> dict:
        return {"idle": self.idle, "busy": self.busy, "queue": self.queue, "deferred": self.deferred}
