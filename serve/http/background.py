"""Background responses (`background: true`), as OpenAI documents them: a job nobody waits on.

A background response is a job (serve/service/jobs.py) whose one reader is
its `Keeper`, on a thread of its own: it feeds the job's events to the
response's Responses exchange as a stream would, and keeps every event the
exchange makes, numbered, so that a client can poll the response
(`GET /v1/responses/{id}`: its status and output so far), resume its event
stream after any sequence number (`?stream=true&starting_after=N`), and cancel
it (`POST /v1/responses/{id}/cancel`: the job stops at its next token or prefill
chunk, and the response ends `cancelled` with what it said). Once it ends, its
final Response is stored like any other (serve/service/response_store.py), so
`previous_response_id` can name it.

The keeper never leaves, so the job runs as a person's request, never as
idle-time work. At shutdown the job is cut like any running one, and its
response ends `incomplete` (cut mid-reply) or `failed` (before it began), with
the reason, and is stored so: never left `in_progress`. Keepers are forgotten
with their jobs' bound (KEEP_FINISHED): after that the stored Response answers.

With a disk (serve/service/background_records.py), each response is also recorded when it
is accepted, before the client hears of it, at most every RECORD_EVERY seconds while it
runs (with its output so far), and when it ends, before its last event is published: after
a restart, even one after the server was killed, its record answers, and a record its
server left unfinished answers `failed`, saying why, with what it had said when recorded.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Iterator, Optional

from serve.core.errors import ApiError
from serve.dialects import responses
from serve.service.background_records import Record, Records
from serve.service.eta import prefill_report
from serve.service.jobs import KEEP_FINISHED, Job
from serve.service.replies import ChatReply, ReplyStart
from serve.service.journal import Emitted, Prefilling, Started

KEPT = KEEP_FINISHED   # keepers held, at most: the finished ones beyond it are dropped first
RECORD_EVERY = 15.0    # seconds between records of a running response: what a kill loses


class Keeper:
    """One background response: its exchange fed by its job, and every event kept."""

    def __init__(self, exchange: responses.ResponsesExchange, job: Job[ChatReply], reader: int, owner: str,
                 records: Optional[Records] = None):
        """`reader`: the keeper's number among the job's readers (Jobs.start gave it);
        `records`: where it is recorded, when the server has a disk for them."""
        self.exchange, self.job, self.owner = exchange, job, owner
        self._cond = threading.Condition()
        self._events: list[dict] = []
        self._done = False
        self._cancelled = False
        self._reader = reader
        self._started = False
        self._records = records
        self._recorded_at = time.monotonic()
        if records is not None:
            records.write(self.response(), owner, 0)
        threading.Thread(target=self._keep, name=f"background-{exchange.id}", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def cancel(self) -> None:
        """End it at its next token or prefill chunk: it ends `cancelled`."""
        self._cancelled = True
        self.job.stop()

    def response(self) -> dict:
        """The Response as it stands: queued, in progress with its output so far, or final.
        Until it is final, serve's `waste.prefill` says where the prompt's evaluation stands
        and when the first token is due, as GET /v1/jobs/{id} does."""
        # The status is read from the same events as the prefill report: the keeper's
        # thread may not have reached the job's start that the report already shows.
        events, _ = self.job.journal.read(0, 0)
        started = any(isinstance(e, Started) for e in events)
        with self._cond:
            response, done = self.exchange.snapshot(self._status(started)), self._done
        if done:
            return response
        return {**response, "waste": {**response.get("waste", {}),
                                      "prefill": prefill_report(events)}}

    def _status(self, started: bool = False) -> Optional[str]:
        """The status of a response not yet final: None once it is (the exchange has it).
        `started`: the caller saw the job's start in its log."""
        if self._done:
            return "cancelled" if self._cancelled else None
        if self._cancelled:
            return "cancelled"
        return "in_progress" if self._started or started else "queued"

    def events(self, after: int) -> Iterator[Optional[list[dict]]]:
        """The events numbered above `after`, as they come: a list at a time, or None when
        nothing came for a while (a heartbeat's moment), until the response ends."""
        position = after + 1
        while True:
            with self._cond:
                if position >= len(self._events) and not self._done:
                    self._cond.wait(1.0)
                batch, done = self._events[position:], self._done
            position += len(batch)
            yield batch or None
            if done and position >= len(self._events):
                return

    # -- on the keeper's thread -------------------------------------------------------------

    def _add(self, data: list[dict]) -> None:
        with self._cond:
            self._events.extend(data)
            self._cond.notify_all()
        if self._records is not None and time.monotonic() - self._recorded_at >= RECORD_EVERY:
            self._recorded_at = time.monotonic()
            with self._cond:
                now, count = self.exchange.snapshot(self._status()), len(self._events)
            self._records.write(now, self.owner, count)

    def _keep(self) -> None:
        journal, position = self.job.journal, 0
        start = ReplyStart()
        opened = False
        while True:
            events, more = journal.read(position)
            position += len(events)
            for event in events:
                if isinstance(event, Started):
                    self._started = True
                elif isinstance(event, Prefilling):
                    start = ReplyStart(start.thinking, event.prompt_tokens, event.cached_tokens)
                elif isinstance(event, Emitted):
                    if not opened:
                        opened = True
                        self._add(self.exchange.opening_events(start))
                    self._add(self.exchange.delta_events(event.delta))
            if not more:
                break
        journal.unfollow(self._reader)
        if not opened:
            self._add(self.exchange.opening_events(start))
        try:
            reply = self.job.result()
        except ApiError as e:   # refused, or cut by shutdown: it says why
            last = self.exchange.failed_events(self.exchange.error(e))
        except Exception as e:   # noqa: BLE001 - the response says it failed, never hangs
            last = self.exchange.failed_events(ApiError(500, f"internal error: {e}"))
        else:
            last = self.exchange.closing_events(reply, "cancelled" if self._cancelled else None)
        self._finish(last)

    def _finish(self, last: list[dict]) -> None:
        """Store the final Response, then publish the last events: a client that saw the end
        can name the response at once."""
        self.exchange.store_final()
        if self._records is not None:
            with self._cond:
                final = self.exchange.snapshot("cancelled" if self._cancelled else None)
                count = len(self._events) + len(last)
            self._records.write(final, self.owner, count)
        with self._cond:
            self._events.extend(last)
            self._done = True
            self._cond.notify_all()


class Keepers:
    """The background responses of one server, by response id."""

    def __init__(self, records: Optional[Records] = None) -> None:
        """`records`: the disk they are recorded on (None: a restart forgets them)."""
        self.records = records
        self._lock = threading.Lock()
        self._keepers: "OrderedDict[str, Keeper]" = OrderedDict()

    def add(self, keeper: Keeper) -> None:
        with self._lock:
            self._keepers[keeper.exchange.id] = keeper
            done = [k for k in self._keepers.values() if k.done]
            for old in done[:max(0, len(self._keepers) - KEPT)]:
                del self._keepers[old.exchange.id]

    def get(self, response_id: str, owner: str) -> Optional[Keeper]:
        with self._lock:
            keeper = self._keepers.get(response_id)
        return keeper if keeper is not None and keeper.owner == owner else None

    def recorded(self, response_id: str, owner: str) -> Optional[Record]:
        """One this server does not keep (it ended long ago, or before a restart), as its
        record holds it: None without a disk, or when it has none that `owner` may see."""
        return self.records.get(response_id, owner) if self.records is not None else None

    def forget(self, response_id: str, owner: str) -> bool:
        """Remove its record (DELETE): False when it had none."""
        return self.records is not None and self.records.forget(response_id, owner)

    def wait(self, timeout: float) -> bool:
        """At shutdown, after the engines stopped: wait up to `timeout` seconds for every
        background response to have stored how it ended. True when they all have."""
        until = time.monotonic() + timeout
        with self._lock:
            keepers = [k for k in self._keepers.values() if not k.done]
        for keeper in keepers:
            if not keeper.wait(max(0.0, until - time.monotonic())):
                return False
        return True
