"""The server's jobs (serve/service/jobs.py): which request attaches to which job, and what
finished jobs it keeps. Runs are driven by hand: no engine is needed to hold them."""
from __future__ import annotations

import threading

from serve.core.reply import Delta
from serve.service import jobs
from serve.service.jobs import Jobs
from serve.service.journal import Journal


def _finish(registry: Jobs, key: str, events: int) -> jobs.Job:
    """A job whose work makes `events` deltas and returns at once; its reader then leaves."""
    run = Journal(threading.Event())

    def work(r: Journal) -> str:
        for _ in range(events):
            r.emit(Delta(content="x"))
        return "reply"
    job, _, reader = registry.start(key, "me", "m", run, work, lambda: False)  # type: ignore[arg-type]
    while not run.ended:
        run.read(0, 0.01)
    run.unfollow(reader)
    return job


def test_finished_jobs_are_bounded_by_their_events(monkeypatch):
    monkeypatch.setattr(jobs, "KEEP_EVENTS", 25)
    registry = Jobs()
    first = _finish(registry, "a", 10)
    second = _finish(registry, "b", 10)
    assert registry.get(first.id, "me") is first and registry.get(second.id, "me") is second
    third = _finish(registry, "c", 10)   # 30 events now: the oldest goes at the next start
    _finish(registry, "d", 1)
    # Only the oldest went: the two left hold 20 events, within the bound.
    assert registry.get(first.id, "me") is None
    assert registry.get(second.id, "me") is second and registry.get(third.id, "me") is third


def test_another_owner_reaches_no_job():
    registry = Jobs()
    job = _finish(registry, "a", 1)
    assert registry.get(job.id, "me") is job and registry.get(job.id, "someone else") is None
    assert registry.owned("someone else") == []
