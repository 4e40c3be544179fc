"""A bounded directory of whole, checked files that several hosts write and read at once.

What a team mounts over NFS or CephFS: no host may rely on flock (NFS locks
are advisory, and lost with a lease), nor on any other host being alive. So:

- publish: the file is written under a temporary name in the same directory,
  fsynced, and renamed into place (a rename is atomic on a local file system
  and, for a single client, on NFS); a reader sees the old file, the new one
  or none, never half of one. Two hosts publishing the same name both write
  whole files and the last rename wins: either is right.
- a file: MAGIC, a little-endian u32 header length, a JSON header (kind,
  identity, body_bytes, and what the kind adds), the body, then a BLAKE2b
  digest of header and body. A reader checks magic, identity and length
  before it reads the body and the digest after, and what fails is counted
  and never used: a foreign file (another model or engine) is left alone, a
  damaged one is removed.
- eviction: when a publish takes the directory past its size (or, when it has
  one, its count of files), the least recently used files (mtime, touched on every use) go first, until the
  directory fits. A reader opens a file and then reads it: on POSIX an
  unlinked file stays readable to whoever has it open (NFS may answer ESTALE,
  which a reader takes as a miss); a reader that finds the file gone misses.
  Two hosts evicting at once each remove only the oldest files their listing
  shows over the bound, and a file another host removed first counts as
  removed, so together they remove about what the bound requires, not twice.
- a temporary file left by a dead writer is removed once it has not changed
  for STALE_SECONDS (an hour: no writer pauses that long between writes).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Optional

MAGIC = b"serve-shared 1\n"
MAX_HEADER = 4096
DIGEST = 32                # BLAKE2b-256 trailer
STALE_SECONDS = 3600.0
TMP = ".tmp-"
_LEN = struct.Struct("<I")
CHUNK = 1 << 20


class Rejected(Exception):
    """A shared file that must not be used: `reason` is "damaged" or "foreign"."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.counted = False   # reject() counts each once, whoever catches it


class Stopped(Exception):
    """A copy given up between two chunks: its caller removes what it wrote."""


@dataclass
class Counters:
    published: int = 0
    publish_failed: int = 0     # a write that failed (a full disk, a lost mount): nothing left
    read: int = 0
    missing: int = 0            # named in a listing, gone when opened (evicted meanwhile)
    damaged: int = 0
    foreign: int = 0
    evicted: int = 0


class Reader:
    """An open shared file whose header checked out; the body is checked as it is read."""

    def __init__(self, f: BinaryIO, header: dict, body_bytes: int, raw_header: bytes):
        self._f = f
        self.header = header
        self.body_bytes = body_bytes
        self._hash = hashlib.blake2b(raw_header, digest_size=DIGEST)
        self._left = body_bytes

    def read(self, n: int) -> bytes:
        """Up to n bytes of the body (fewer only at its end)."""
        data = self._f.read(min(n, self._left))
        if len(data) < min(n, self._left):
            raise Rejected("damaged", "the file is shorter than its header says")
        self._hash.update(data)
        self._left -= len(data)
        return data

    def copy_to(self, out: BinaryIO, stop: Optional[Callable[[], bool]] = None) -> None:
        """The rest of the body into `out`; raises Stopped between two chunks when `stop()`
        says so (the request it is for was given up)."""
        while self._left:
            if stop is not None and stop():
                raise Stopped()
            out.write(self.read(CHUNK))

    def verify(self) -> None:
        """After the whole body was read: the digest must match, and nothing may follow."""
        if self._left:
            raise Rejected("damaged", "the body was not read to its end")
        if self._f.read(DIGEST + 1) != self._hash.digest():
            raise Rejected("damaged", "the checksum does not match")

    def close(self) -> None:
        self._f.close()


class SharedDir:
    """One directory of a shared tier (snapshots, responses, replies), bounded in bytes."""

    def __init__(self, path: str, capacity_bytes: int, identity: str = "",
                 max_files: Optional[int] = None,
                 on_reject: Optional[Callable[[str, Rejected], None]] = None):
        """`on_reject(name, why)` hears of each file that failed its checks (to log it)."""
        if capacity_bytes <= 0:
            raise ValueError("a shared directory's capacity must be positive")
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.max_files = max_files
        self.on_reject = on_reject
        self.counters = Counters()
        self._lock = threading.Lock()   # the counters
        os.makedirs(path, mode=0o700, exist_ok=True)

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + 1)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def names(self) -> list[str]:
        """The published files (a temporary file is nobody's yet)."""
        try:
            return [n for n in os.listdir(self.path) if not n.startswith(".")]
        except OSError:
            return []

    # -- writing ----------------------------------------------------------------------------

    def publish(self, name: str, kind: str, extra: dict, body: Iterable[bytes],
                body_bytes: int) -> bool:
        """Write `body` (body_bytes in all) as `name`, atomically; False when it failed,
        with nothing left behind."""
        header = json.dumps({"kind": kind, "identity": self.identity, "body_bytes": body_bytes,
                             **extra}, sort_keys=True).encode()
        if len(MAGIC) + _LEN.size + len(header) + body_bytes + DIGEST > self.capacity_bytes:
            return False   # larger than the whole directory: it would only evict itself
        tmp = self.file(f"{TMP}{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
                        f"-{os.urandom(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                h = hashlib.blake2b(header, digest_size=DIGEST)
                written = 0
                for piece in body:
                    h.update(piece)
                    f.write(piece)
                    written += len(piece)
                if written != body_bytes:
                    raise ValueError(f"{name}: {written} body bytes written, {body_bytes} announced")
                f.write(h.digest())
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.file(name))
            _fsync_dir(self.path)
        except Stopped:   # given up (shutdown): not a failure, and nothing left
            _unlink(tmp)
            return False
        except (OSError, ValueError):
            _unlink(tmp)
            self.count("publish_failed")
            return False
        self.count("published")
        self.evict()
        return True

    def remove(self, name: str) -> None:
        _unlink(self.file(name))

    def touch(self, name: str) -> None:
        """Most recently used, for every host's eviction."""
        try:
            os.utime(self.file(name))
        except OSError:
            pass

    # -- reading ----------------------------------------------------------------------------

    def open(self, name: str, listed: bool = True) -> Optional[Reader]:
        """The file with its header checked, or None when it is not there: counted as
        missing when it was `listed` (evicted since), a plain miss otherwise. Raises
        Rejected (and counts it) for a damaged or foreign file; a damaged one is removed."""
        try:
            fd = os.open(self.file(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if listed:
                self.count("missing")
            return None
        except OSError:   # ESTALE and the like: evicted under an NFS reader
            self.count("missing")
            return None
        f = os.fdopen(fd, "rb")
        try:
            header, raw, body_bytes = _header(f)
            if header.get("identity") != self.identity:
                raise Rejected("foreign", f"{name} was written for another model or engine")
            return Reader(f, header, body_bytes, raw)
        except Rejected as e:
            f.close()
            self.reject(name, e)
            raise
        except OSError:
            f.close()
            self.count("missing")
            return None

    def read_whole(self, name: str, listed: bool = True) -> Optional[tuple[dict, bytes]]:
        """(header, body) of a small file, checked; None when it is not there or fails its
        checks (counted, as open() and reject() do)."""
        try:
            reader = self.open(name, listed)
        except Rejected:
            return None
        if reader is None:
            return None
        try:
            body = reader.read(reader.body_bytes)
            reader.verify()
        except Rejected as e:
            self.reject(name, e)
            return None
        except OSError:
            self.count("missing")
            return None
        finally:
            reader.close()
        self.touch(name)
        self.count("read")
        return reader.header, body

    def reject(self, name: str, e: Rejected) -> None:
        """Count a file that failed its checks; a damaged one is removed (a foreign one may
        be another host's, of another model, sharing the directory by mistake)."""
        if e.counted:
            return
        e.counted = True
        self.count(e.reason)
        if self.on_reject is not None:
            self.on_reject(name, e)
        if e.reason == "damaged":
            self.remove(name)

    # -- the bound --------------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(files, bytes) published now."""
        files = [st for _, st in self._listing()]
        return len(files), sum(st.st_size for st in files)

    def _listing(self) -> list[tuple[str, os.stat_result]]:
        found = []
        now = time.time()
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue    # gone meanwhile
            if entry.name.startswith(TMP):
                if now - st.st_mtime > STALE_SECONDS:
                    _unlink(entry.path)   # a dead writer's
                continue
            if not entry.name.startswith("."):
                found.append((entry.name, st))
        return found

    def evict(self) -> int:
        """Least recently used first, until the directory fits; the files removed."""
        files = self._listing()
        excess = sum(st.st_size for _, st in files) - self.capacity_bytes
        extra = len(files) - self.max_files if self.max_files is not None else 0
        removed = 0
        for name, st in sorted(files, key=lambda pair: pair[1].st_mtime_ns):
            if excess <= 0 and extra <= 0:
                break
            excess -= st.st_size   # gone already (another host's eviction) counts too
            extra -= 1
            try:
                os.unlink(self.file(name))
            except OSError:
                continue
            removed += 1
            self.count("evicted")
        return removed


def _header(f: BinaryIO) -> tuple[dict, bytes, int]:
    if f.read(len(MAGIC)) != MAGIC:
        raise Rejected("damaged", "not a shared serve file")
    length_bytes = f.read(_LEN.size)
    if len(length_bytes) != _LEN.size:
        raise Rejected("damaged", "the header is cut short")
    (length,) = _LEN.unpack(length_bytes)
    if length > MAX_HEADER:
        raise Rejected("damaged", "the header is too long")
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise Rejected("damaged", "the header is not JSON") from None
    body_bytes = header.get("body_bytes") if isinstance(header, dict) else None
    if not isinstance(body_bytes, int) or body_bytes < 0:
        raise Rejected("damaged", "the header has no body length")
    size = os.fstat(f.fileno()).st_size
    if size != len(MAGIC) + _LEN.size + length + body_bytes + DIGEST:
        raise Rejected("damaged", "the file's length is not what its header says")
    return header, raw, body_bytes


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    """The rename itself durable (a crash right after must not lose the entry)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
