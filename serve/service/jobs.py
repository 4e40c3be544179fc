"""Requests as jobs: each generation runs on a thread of its own and outlives the connection
that asked for it.

On K3 one turn is hours of engine time, so it cannot belong to one HTTP
connection. A `Job` runs its request (Service.chat or Service.complete) on its
own thread; its events go to its Journal's append-only log, which any number of
readers follow, each from its own position (serve/service/journal.py). A client that
leaves only stops reading: what the work may still do then is
serve/service/detach.py's rule.

An identical request (the same endpoint, the same parsed body with its keys in
any order, the same credentials: the caller's `key`) that arrives while a job
runs that nobody follows any more (its client left: Codex and opencode resend
at once when a stream drops) attaches to it, gets everything said so far at
once, then follows it live. So does one that arrives soon after such a job
ended: its reply was never delivered. Otherwise it is a new question and gets
a job of its own: sent while the first one's client is still there, it asks
in parallel (an agent sampling twice); sent after the reply reached its
client, it asks again (a chat page's "regenerate").

Finished jobs are kept at most `keep_seconds`, at most `keep_count` of them and
at most KEEP_EVENTS events in all, the oldest forgotten first; running ones are
bounded by the engine's line.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, TypeVar

from serve.core.ids import new_id
from serve.service.eta import prefill_report
from serve.service.replies import ChatReply, CompletionReply
from serve.service.journal import Emitted, Queued, Journal, Started

R = TypeVar("R", ChatReply, CompletionReply)

KEEP_FINISHED_SECONDS = 600.0   # a finished, undelivered job waits this long for its client
KEEP_FINISHED = 64              # finished jobs kept, at most
KEEP_EVENTS = 200_000           # and their events, at most (some 60 MB): long replies go first


@dataclass
class Job(Generic[R]):
    """One request's generation, on its own thread; its result once the thread is done."""
    id: str
    key: str                     # identical requests have the same key
    owner: str                   # who may reach it by id (a digest of the credentials)
    model: str
    journal: Journal
    created: float = field(default_factory=time.time)
    reply: Optional[R] = None
    error: Optional[BaseException] = None
    finished_at: Optional[float] = None   # time.monotonic() once the thread is done
    delivered: bool = False               # a reader followed it to its end

    def result(self) -> R:
        """The reply, or what the request raised. Only once its journal has ended."""
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply

    def stop(self) -> None:
        """End it at its next token or prefill chunk, as a normal finish with what was said."""
        self.journal.stop()

    def status(self) -> str:
        """queued, in_progress, completed, stopped, incomplete (cut by its limit or by its
        client leaving) or failed."""
        if self.finished_at is None:
            events, _ = self.journal.read(0, 0)
            return "in_progress" if any(isinstance(e, Started) for e in events) else "queued"
        if self.error is not None:
            return "failed"
        assert self.reply is not None
        if self.journal.stopped:
            return "stopped"
        if self.reply.client_left or self.reply.finish_reason == "length":
            return "incomplete"
        return "completed"

    def describe(self) -> dict:
        """What GET /v1/jobs/{id} shows: its state, its prefill, and its output so far."""
        events, _ = self.journal.read(0, 0)
        ahead = 0
        reasoning, content, calls = [], [], 0
        for event in events:
            if isinstance(event, Queued):
                ahead = event.ahead
            elif isinstance(event, Emitted):
                reasoning.append(event.delta.reasoning_content)
                content.append(event.delta.content)
                calls += int(bool(event.delta.tool_call and "id" in event.delta.tool_call))
        status = self.status()
        away = self.journal.detached_for()
        out = {"id": self.id, "object": "job", "status": status, "model": self.model,
               "created_at": int(self.created),
               "followed": away is None and self.finished_at is None,
               "prefill": prefill_report(events),
               "output": {"reasoning": "".join(reasoning), "content": "".join(content),
                          "tool_calls": calls,
                          "deltas": sum(isinstance(e, Emitted) for e in events)}}
        if status == "queued":
            out["queue"] = {"ahead": ahead}
        if away is not None:
            out["detached_seconds"] = round(away, 3)
        if self.finished_at is not None and self.error is None:
            assert self.reply is not None
            out["finish_reason"] = self.reply.finish_reason
            out["usage"] = {"prompt_tokens": self.reply.usage.prompt_tokens,
                            "completion_tokens": self.reply.usage.completion_tokens,
                            "cached_tokens": self.reply.usage.cached_tokens}
        elif self.error is not None:
            out["error"] = {"message": str(self.error)}
        return out


class Jobs:
    """The jobs of one server, by id and by key."""

    def __init__(self, attach: bool = True, keep_seconds: float = KEEP_FINISHED_SECONDS,
                 keep_count: int = KEEP_FINISHED):
        self.attach = attach
        self.keep_seconds = keep_seconds
        self.keep_count = keep_count
        self._lock = threading.Lock()
        self._jobs: "OrderedDict[str, Job]" = OrderedDict()   # by id, oldest first
        self._by_key: dict[str, Job] = {}                       # the newest job of each key

    def start(self, key: str, owner: str, model: str, journal: Journal,
              work: Callable[[Journal], R],
              client_left: Callable[[], bool]) -> tuple[Job[R], bool, int]:
        """The job an identical request may attach to (True), or a new one running
        `work(journal)` on its own thread (False); and the caller's reader number, for it follows
        the job's journal either way (Journal.follow, with its client's `client_left` probe)."""
        with self._lock:
            self._forget_old()
            found = self._by_key.get(key) if self.attach else None
            if found is not None and found.owner == owner and found.model == model \
                    and self._joinable(found):
                return found, True, found.journal.follow(client_left)
            job: Job[R] = Job(new_id("job"), key, owner, model, journal)
            reader = journal.follow(client_left)
            self._jobs[job.id] = job
            self._by_key[key] = job
        # Handed over in a box the job's thread empties: a Thread keeps its arguments until
        # after its run() ends, and the work holds the request (tens of megabytes, for some).
        threading.Thread(target=self._execute, args=(job, [work]), name=f"job-{job.id}",
                         daemon=True).start()
        return job, False, reader

    @staticmethod
    def _joinable(job: Job) -> bool:
        if job.finished_at is None:
            return not (job.journal.stopped or job.journal.cut or job.journal.followed())
        return not job.delivered and job.error is None and not job.journal.stopped \
            and not job.result().client_left

    def get(self, job_id: str, owner: str) -> Optional[Job]:
        """The job with this id, if `owner` made it (another's is as absent as a missing one)."""
        with self._lock:
            job = self._jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def owned(self, owner: str) -> list[Job]:
        """The jobs `owner` made that are still known, oldest first."""
        with self._lock:
            return [job for job in self._jobs.values() if job.owner == owner]

    def _execute(self, job: Job[R], box: list[Callable[[Journal], R]]) -> None:
        self._work(job, box.pop())   # the request goes with the work, before the end is told
        job.finished_at = time.monotonic()
        job.journal.end()
        if job.error is not None:   # nothing to attach to: only its readers hold it
            with self._lock:
                self._drop(job)

    @staticmethod
    def _work(job: Job[R], work: Callable[[Journal], R]) -> None:
        try:
            job.reply = work(job.journal)
        except BaseException as e:  # noqa: BLE001 - handed to the job's readers
            # Its frames would hold the request for as long as the error is kept: the
            # readers re-raise it from where they are.
            job.error = e.with_traceback(None)
            e.__context__ = None

    def _forget_old(self) -> None:
        """Finished jobs past their time or beyond the count, oldest first. Under _lock."""
        now = time.monotonic()
        finished = [job for job in self._jobs.values() if job.finished_at is not None]
        events = sum(job.journal.size for job in finished)
        for n, job in enumerate(finished):
            assert job.finished_at is not None
            if now - job.finished_at < self.keep_seconds and len(finished) - n <= self.keep_count \
                    and events <= KEEP_EVENTS:
                continue
            events -= job.journal.size
            self._drop(job)

    def _drop(self, job: Job) -> None:
        """Forget a job, by id and by key. Under _lock."""
        self._jobs.pop(job.id, None)
        if self._by_key.get(job.key) is job:
            del self._by_key[job.key]
