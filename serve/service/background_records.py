"""Background responses on disk: a record of each, from the moment it is accepted until after
it ends, so that a restart never loses one, nor leaves it `in_progress` for ever.

A record is a file of its own in a local directory (DIR/responses/ under the prefix cache's
directory), written atomically and checked when read (serve/snapshots/shared_dir.py): when
the response is accepted (queued or in progress), now and then while it runs (its keeper,
serve/http/background.py, says when), and when it ends (completed, incomplete, cancelled or
failed). Records are bounded by count and bytes, least recently used
out first, as the stored responses are in memory.

Each record names its writer: a lock file in the same directory that its server holds
(flock) while it lives. A record still unfinished whose writer no longer holds its lock is
from a server that stopped or was killed before the response finished: it is made `failed`,
saying so, at the next start (every record is read then) or when it is next asked for,
whichever comes first. The lock, rather than a start-up sweep alone, is what lets several
servers share one cache directory: one's start never fails another's running response.

A record belongs to its creator as the running response did (its job's owner: person and
credentials): the file is named by a hash of owner and id, as the stored responses are
(serve/service/response_store.py), and another owner's id is not found, exactly as an id
that was never made. A damaged or truncated record is logged, removed and not found.

After a restart a record has no numbered events left but its last: a resumed stream of it is
that one event (`response.failed` for one the restart ended), numbered after the client's
`starting_after`.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from serve.service.response_store import FILE_NAME, STORE_BYTES, STORE_RESPONSES, owned_name
from serve.snapshots.cache import held
from serve.snapshots.shared_dir import TMP, Rejected, SharedDir

KIND = "background"
WRITER = ".writer-"         # a live server's lock file (dot: not a record, never evicted)
WRITER_NAME = re.compile(r"\.writer-[0-9]+-[0-9a-f]{8}")   # nothing else is a path
UNFINISHED = ("queued", "in_progress")
STATUSES = (*UNFINISHED, "completed", "incomplete", "cancelled", "failed")
RESTARTED = ("the server restarted before this background response finished: it was stopped "
             "or killed while the response ran")


@dataclass(frozen=True)
class Record:
    """One background response as its record holds it."""
    response: dict
    owner: str
    writer: str   # the lock file of the server that wrote it
    count: int    # the events its stream had made when it was written

    def events(self, after: int) -> Iterator[Optional[list[dict]]]:
        """Its stream resumed after `after` (as serve/http/background.py's Keeper gives one):
        its last event alone, numbered after both what it made and what the client saw."""
        yield [{"type": f"response.{self.response['status']}",
                "sequence_number": max(self.count - 1, after + 1), "response": self.response}]


class Records:
    """The background response records in one directory, and this server's lock there."""

    def __init__(self, directory: str, warn: Callable[[str], None],
                 max_records: int = STORE_RESPONSES, max_bytes: int = STORE_BYTES):
        self._warn = warn
        self.files = SharedDir(directory, max_bytes, max_files=max_records,
                               on_reject=self._rejected)
        self._lock_fd, self.writer = self._claim()   # open for good: closing it unlocks
        self.failed_at_start = self._settle_all()

    def write(self, response: dict, owner: str, count: int) -> None:
        """Record `response` as it stands, `count` the events its stream has made."""
        if FILE_NAME.fullmatch(response["id"]):
            self._publish(owned_name(owner, response["id"]),
                          Record(response, owner, self.writer, count))

    def get(self, response_id: str, owner: str) -> Optional[Record]:
        """Its record, settled (failed if its server is gone), or None: not found, another
        owner's, or damaged."""
        if not FILE_NAME.fullmatch(response_id):
            return None
        name = owned_name(owner, response_id)
        record = self._read(name, listed=False)
        if record is not None and (record.response.get("id") != response_id
                                   or record.owner != owner):
            self.files.reject(name, Rejected("damaged", f"{name} is not that response's record"))
            return None
        return record

    def forget(self, response_id: str, owner: str) -> bool:
        """Remove its record; False when there was none."""
        if self.get(response_id, owner) is None:
            return False
        self.files.remove(owned_name(owner, response_id))
        return True

    # -- the rest ---------------------------------------------------------------------------

    def _publish(self, name: str, record: Record) -> None:
        body = json.dumps({"response": record.response, "owner": record.owner,
                           "writer": record.writer, "count": record.count}).encode()
        if not self.files.publish(name, KIND, {}, [body], len(body)):
            self._warn(f"serve: warning: the record of background response "
                       f"{record.response['id']} was not written (disk full?)")

    def _read(self, name: str, listed: bool) -> Optional[Record]:
        found = self.files.read_whole(name, listed)
        if found is None:
            return None
        header, body = found
        try:
            parts = json.loads(body)
            record = Record(parts["response"], parts["owner"], parts["writer"], parts["count"])
            if header.get("kind") != KIND or not isinstance(record.response, dict) \
                    or not isinstance(record.response.get("id"), str) \
                    or not isinstance(record.response.get("output"), list) \
                    or record.response.get("status") not in STATUSES \
                    or not isinstance(record.owner, str) or not isinstance(record.writer, str) \
                    or not WRITER_NAME.fullmatch(record.writer) or not isinstance(record.count, int):
                raise ValueError("not a record")
        except (ValueError, KeyError, TypeError):
            self.files.reject(name, Rejected("damaged", "not a background response record"))
            return None
        return self._settled(name, record)

    def _settled(self, name: str, record: Record) -> Record:
        """A record its server left unfinished, once that server is gone: failed, saying so."""
        if record.response["status"] not in UNFINISHED or record.writer == self.writer \
                or held(self.files.file(record.writer)):
            return record
        response = record.response
        output = [{**item, "status": "incomplete"}
                  if isinstance(item, dict) and item.get("status") == "in_progress" else item
                  for item in response["output"]]
        failed = Record({**response, "status": "failed", "output": output,
                         "error": {"code": "server_error", "message": RESTARTED}},
                        record.owner, self.writer, record.count + 1)
        self._publish(name, failed)
        return failed

    def _settle_all(self) -> int:
        """At start: read every record (a damaged one goes, logged), fail those whose server
        is gone, and remove dead servers' lock files. The records failed."""
        failed = 0
        for name in self.files.names():
            record = self._read(name, listed=True)
            failed += record is not None and record.writer == self.writer
        for name in os.listdir(self.files.path):
            if name.startswith(WRITER) and name != self.writer and not held(self.files.file(name)):
                self.files.remove(name)
        if failed:
            self._warn(f"serve: {failed} background response(s) left unfinished by a server "
                       "that stopped or was killed are now failed")
        return failed

    def _claim(self) -> tuple[int, str]:
        """This server's lock file: locked under a temporary name, then renamed into place, so
        that no other server ever sees it unlocked."""
        suffix = f"{os.getpid()}-{os.urandom(4).hex()}"
        tmp = self.files.file(f"{TMP}{WRITER[1:]}{suffix}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)   # held until this process ends
        os.rename(tmp, self.files.file(WRITER + suffix))
        return fd, WRITER + suffix

    def _rejected(self, name: str, why: Rejected) -> None:
        self._warn(f"serve: warning: ignored the background response record {name}: {why}")
