"""Where a request's prefill stands, and when its first token is due, from its run's events.

One `PrefillState` is folded from a run's events (`advance`): its positions and how
many were restored (Prefilling), how many are in the engine after each chunk
(Progress), and the measured prefill rate as it stood then. Its `report` is what a
client reads, the same everywhere: in a stream's `: prefill N/M {...}` comments (each
chunk's, and each heartbeat's while a chunk runs: serve/http/progress.py), in
`GET /v1/jobs/{id}` and in a background response's `GET /v1/responses/{id}`.

The estimate is made at the last chunk's end (what is left at the rate measured then)
and told as seconds from the moment of the report, so a heartbeat in the middle of a
long chunk counts down rather than repeating the chunk's figure. Before the first
chunk the rate is the one earlier prefills measured (None on a fresh server).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from serve.service.journal import Emitted, Event, Prefilling, Progress


@dataclass(frozen=True)
class PrefillState:
    positions: int                          # the prompt's, in all
    restored: int                           # restored from a snapshot
    done: int                               # in the engine as of `at`, restored included
    seconds_per_position: Optional[float]   # the measured rate at `at` (None: unmeasured)
    at: float                               # time.monotonic() of the last chunk's end

    def due(self) -> Optional[float]:
        """time.monotonic() when the first token is estimated to come (None: unmeasured)."""
        spp = self.seconds_per_position
        return None if not spp else self.at + (self.positions - self.done) * spp

    def report(self, now: Optional[float] = None) -> dict:
        """Positions in all, restored, evaluated (of the rest) so far, the measured rate, and
        the first token's estimate in seconds from `now` (monotonic) and as a Unix time."""
        clock = time.monotonic()
        now = clock if now is None else now
        due = self.due()
        spp = self.seconds_per_position
        return {"positions": self.positions, "restored": self.restored,
                "evaluated": self.done - self.restored,
                "positions_per_second": round(1.0 / spp, 3) if spp else None,
                "first_token_seconds": None if due is None else round(max(0.0, due - now), 3),
                "first_token_at": None if due is None else round(time.time() + due - clock, 3)}


def advance(state: Optional[PrefillState], event: Event) -> Optional[PrefillState]:
    """The prefill's state after `event`: None before it begins and once the reply does."""
    if isinstance(event, Prefilling):
        return PrefillState(event.prompt_tokens, event.cached_tokens, event.cached_tokens,
                            event.seconds_per_position, event.at)
    if isinstance(event, Progress) and state is not None:
        rate = event.seconds_per_position or state.seconds_per_position
        return replace(state, positions=event.total, done=event.done,
                       seconds_per_position=rate, at=event.at)
    if isinstance(event, Emitted):
        return None
    return state


def prefill_report(events: Iterable[Event]) -> dict:
    """What GET of a job or of a background response says of its prefill: the report as it
    stands while the prompt is evaluated; once the reply began, every position evaluated
    and no estimate (the first token came); zeros before the prefill began."""
    state: Optional[PrefillState] = None
    last: Optional[PrefillState] = None   # the state before the reply began
    for event in events:
        state = advance(state, event)
        last = state or last
    if state is not None:
        return state.report()
    if last is None:
        return PrefillState(0, 0, 0, None, 0.0).report()
    return {**last.report(), "evaluated": last.positions - last.restored,
            "first_token_seconds": None, "first_token_at": None}
