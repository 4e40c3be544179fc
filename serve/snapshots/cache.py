"""Engine-state snapshots on disk, keyed by the exact token prefix they hold.

A chat client resends the whole conversation every turn, and an agent resends
the same preamble (tools, system prompt) on every request.  After part of a
prompt is prefilled, the engine's state is saved here under its token
sequence; a later prompt that extends that sequence loads the snapshot and
prefills only the rest.  A loaded state is bit-identical to a fresh prefill,
so answers do not change.

Snapshots persist in a cache directory shared by every server process:

    DIR/lock                   flock: eviction bookkeeping, and a generation counter
    DIR/<namespace>/<key>/     one entry: `meta` (tokens, checksums) and `state`
    DIR/work-<pid>-<random>/   one process's unfinished writes; `owner` is flocked

The namespace is the identity of what produced the state (serve/snapshots/identity.py):
another container or engine build never finds, let alone loads, an entry.
An entry appears by renaming a finished directory into place and vanishes
by renaming it out, so a reader never sees half of one.  A damaged entry is
dropped when it is found.  The cache is bounded in bytes and in entries across
every namespace, least recently used first.

Lookups cost O(prompt length) whatever the number of entries: tokens are
hashed in blocks of BLOCK, each block's hash chained to the one before; an
entry is found by the chain hash of its whole blocks (its anchor) and then a
hash of its few tokens past the last whole block.  RAM per entry is a few
hundred bytes, never its token list.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import struct
import sys
import tempfile
import threading
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

BLOCK = 64                  # tokens per hashed block
DEFAULT_MAX_ENTRIES = 1024
MAGIC = b"serve-prefix 1\n"
MAX_HEADER = 4096           # a meta header longer than this is damage, not an entry
_LEN = struct.Struct("<I")
_GEN = struct.Struct("<Q")


class PrefixCacheError(Exception):
    """The cache directory cannot be used (not a directory, not private, a symlink)."""


@dataclass(frozen=True)
class Snapshot:
    key: str
    tokens: tuple[int, ...]
    path: str       # the engine state file
    size: int       # bytes on disk, state and meta
    written: bool = False   # store() saved the state (rather than finding it kept already)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class _Entry:
    """What RAM holds per entry: no tokens, only hashes and sizes."""
    key: bytes
    anchor: Optional[bytes]   # None: another namespace's entry, counted but never found
    n_tokens: int
    size: int
    dir: str


def _digest(prev: bytes, data: bytes) -> bytes:
    """The one hash the index uses (tests count its calls)."""
    return hashlib.blake2b(prev + data, digest_size=16).digest()


def _raw(tokens: Sequence[int]) -> bytes:
    ids = array("i", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def _anchors(seed: bytes, raw: bytes, blocks: int) -> list[bytes]:
    """chain[q]: the hash of the first q whole blocks (chain[0] is the namespace seed)."""
    chain, step = [seed], BLOCK * 4
    for q in range(blocks):
        chain.append(_digest(chain[-1], raw[q * step:(q + 1) * step]))
    return chain


def _entry_key(anchor: bytes, tail: bytes) -> bytes:
    return _digest(anchor, b"T" + tail)  # the marker keeps keys apart from anchors


CLOSE_WAIT = 10.0   # seconds close() waits for a snapshot being written: a save takes far less


class PrefixCache:
    """A disk-bounded, entry-bounded LRU of engine states. Thread-safe; processes share it."""

    def __init__(self, capacity_bytes: int, parent_dir: Optional[str] = None, *,
                 identity: str = "", max_entries: int = DEFAULT_MAX_ENTRIES):
        """`parent_dir` is the cache directory (default: default_directory())."""
        if capacity_bytes <= 0:
            raise ValueError("prefix cache capacity must be positive")
        if max_entries <= 0:
            raise ValueError("prefix cache entry bound must be positive")
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self.identity = identity
        self.root = str(parent_dir or default_directory())
        _private_dir(self.root, created_only=True)
        self._seed = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.namespace = self._seed.hex()
        self.directory = os.path.join(self.root, self.namespace)
        _private_dir(self.directory)
        self._lock = threading.Lock()           # the in-memory index
        self._writes = 0                        # store() calls writing into the work directory
        self._closed = False                    # close() began: no new writes
        self._quiet = threading.Condition(self._lock)   # notified when _writes drops
        self._dir_mutex = threading.Lock()      # flock does not exclude this process's own threads
        self._dir_lock = os.open(os.path.join(self.root, "lock"),
                                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._entries: "OrderedDict[bytes, _Entry]" = OrderedDict()  # least recent first
        self._anchor_count: dict[bytes, int] = {}
        self._bytes = 0
        self._generation = -1
        self.hits = self.misses = self.restored_tokens = 0
        self.reclaimed = 0   # dead processes' work directories removed at start
        with self._shared(rescan=False):
            # Under the directory lock, so that no one sees this work directory unowned.
            self._work = tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=self.root)
            self._owner = os.open(os.path.join(self._work, "owner"),
                                  os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._owner, fcntl.LOCK_EX)  # held until close() or death
            self.reclaimed = self._reclaim_orphans()
        with self._shared(rescan=True):
            self._evict()    # the bounds hold even when this process was started with smaller ones

    # -- the public surface ---------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "hits": self.hits,
                    "misses": self.misses, "restored_tokens": self.restored_tokens}

    def lookup(self, tokens: Sequence[int], limit: Optional[int] = None) -> Optional[Snapshot]:
        """The longest snapshot whose tokens are a proper prefix of `tokens`.

        `limit` caps the usable prefix length (e.g. the first image position:
        identical placeholder ids do not mean identical image embeddings).
        A proper prefix, because generation needs at least one new token.
        A damaged or vanished entry met on the way is dropped.
        """
        longest = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        if longest < 0:
            return None
        raw = _raw(tokens[:longest])
        for entry in self._candidates(raw, longest):
            snap = self._open(entry, raw)
            if snap is None:
                self._forget(entry)
                continue
            self._touch(entry, snap)
            with self._lock:
                self.hits += 1
            return snap
        with self._lock:
            self.misses += 1
        return None

    def note_restored(self, n_tokens: int) -> None:
        """Count positions a caller actually restored from a snapshot (stats)."""
        with self._lock:
            self.restored_tokens += n_tokens

    def store(self, tokens: Sequence[int], save: Callable[[str], None]) -> Optional[Snapshot]:
        """Snapshot the engine's current state, which holds exactly `tokens`.

        `save(path)` writes the state (Engine.save_state); what it raises is
        raised here, with nothing left on disk.  A snapshot larger than the
        whole cache is not kept.  Returns the new entry, or None.
        """
        tokens = tuple(tokens)
        raw = _raw(tokens)
        whole = len(tokens) // BLOCK
        anchor = _anchors(self._seed, raw, whole)[-1]
        key = _entry_key(anchor, raw[whole * BLOCK * 4:])
        with self._lock:
            known = self._entries.get(key)
            if known is None:
                if self._closed:
                    return None   # shutting down: the work directory is going away
                self._writes += 1
        if known is not None:
            snap = Snapshot(key.hex(), tokens, os.path.join(known.dir, "state"), known.size)
            self._touch(known, snap)
            return snap
        try:
            return self._write(key, anchor, tokens, save)
        finally:
            with self._lock:
                self._writes -= 1
                self._quiet.notify_all()

    def _write(self, key: bytes, anchor: bytes, tokens: tuple, save: Callable[[str], None]
               ) -> Optional[Snapshot]:
        scratch = tempfile.mkdtemp(dir=self._work)
        try:
            state = os.path.join(scratch, "state")
            save(state)
            os.chmod(state, 0o600)  # in this process's private scratch directory
            size = os.lstat(state).st_size
            meta = self._meta(key, anchor, tokens, state, size)
            total = size + len(meta)
            if total > self.capacity_bytes:
                return None
            _write_private(os.path.join(scratch, "meta"), meta)
            with self._shared():
                if key not in self._entries:
                    final = os.path.join(self.directory, key.hex())
                    try:
                        os.rename(scratch, final)
                    except OSError as e:
                        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                    else:
                        self._add(_Entry(key, anchor, len(tokens), total, final))
                        self._evict()
                entry = self._entries.get(key)
            if entry is None:
                return None
            return Snapshot(key.hex(), tokens, os.path.join(entry.dir, "state"), entry.size, True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone already when it was published

    def drop(self, snap: Snapshot) -> None:
        """Forget a snapshot and remove it (e.g. one that failed to load)."""
        with self._lock:
            entry = self._entries.get(bytes.fromhex(snap.key))
        if entry is not None:
            self._forget(entry)

    def close(self) -> None:
        """Let go of this process's share: entries stay for the next start.

        A snapshot being written (a prefill stopped by shutdown saves where it got) is
        waited for, up to CLOSE_WAIT seconds, so that its scratch files do not outlive the
        work directory; whatever a stuck disk still holds then is reclaimed by the next
        start."""
        with self._lock:
            self._closed = True
            self._quiet.wait_for(lambda: self._writes == 0, timeout=CLOSE_WAIT)
        with self._dir_mutex:   # no eviction of this process's is moving an entry into it
            shutil.rmtree(self._work, ignore_errors=True)
        for fd in (self._owner, self._dir_lock):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- lookup ---------------------------------------------------------------------------

    def _candidates(self, raw: bytes, longest: int) -> Iterator[_Entry]:
        """Entries whose tokens are a prefix of raw, longest first: O(longest) hashes.

        Only blocks that anchor some entry are probed position by position."""
        chain = _anchors(self._seed, raw, longest // BLOCK)
        for q in range(len(chain) - 1, -1, -1):
            if chain[q] not in self._anchor_count:
                continue
            start = q * BLOCK
            for end in range(min(start + BLOCK - 1, longest), start - 1, -1):
                key = _entry_key(chain[q], raw[start * 4:end * 4])
                with self._lock:
                    entry = self._entries.get(key)
                if entry is not None:
                    yield entry

    def _open(self, entry: _Entry, raw: bytes) -> Optional[Snapshot]:
        """The entry as a Snapshot, if its files are whole and hold exactly these tokens."""
        try:
            header, tokens = _read_meta(os.path.join(entry.dir, "meta"), with_tokens=True)
            state = os.path.join(entry.dir, "state")
            if (header.get("identity") != self.identity or header.get("key") != entry.key.hex()
                    or _raw(tokens) != raw[:entry.n_tokens * 4] or len(tokens) != entry.n_tokens
                    or _crc32(state, header.get("state_bytes")) != header.get("state_crc32")):
                return None
        except (OSError, ValueError):
            return None
        return Snapshot(entry.key.hex(), tokens, state, entry.size)

    def _touch(self, entry: _Entry, snap: Snapshot) -> None:
        """Most recently used, here and (through the meta's mtime) for other processes."""
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
        try:
            os.utime(os.path.join(entry.dir, "meta"), follow_symlinks=False)
        except OSError:
            pass

    # -- bookkeeping ------------------------------------------------------------------------

    def _meta(self, key: bytes, anchor: bytes, tokens: tuple[int, ...], state: str,
              size: int) -> bytes:
        header = json.dumps({"identity": self.identity, "key": key.hex(), "anchor": anchor.hex(),
                             "n_tokens": len(tokens), "state_bytes": size,
                             "state_crc32": _crc32(state, size)}).encode()
        return MAGIC + _LEN.pack(len(header)) + header + _raw(tokens)

    def _add(self, entry: _Entry) -> None:
        with self._lock:
            self._entries[entry.key] = entry
            self._bytes += entry.size
            if entry.anchor is not None:
                self._anchor_count[entry.anchor] = self._anchor_count.get(entry.anchor, 0) + 1

    def _remove(self, entry: _Entry) -> None:
        with self._lock:
            if self._entries.pop(entry.key, None) is None:
                return
            self._bytes -= entry.size
            if entry.anchor is not None:
                left = self._anchor_count[entry.anchor] - 1
                if left:
                    self._anchor_count[entry.anchor] = left
                else:
                    del self._anchor_count[entry.anchor]

    def _forget(self, entry: _Entry) -> None:
        with self._shared():
            self._remove(entry)
            self._delete(entry.dir)

    def _evict(self) -> None:
        """Least recently used first, until both bounds hold. Under the directory lock."""
        while self._entries and (self._bytes > self.capacity_bytes
                                 or len(self._entries) > self.max_entries):
            with self._lock:
                oldest = next(iter(self._entries.values()))
            self._remove(oldest)
            self._delete(oldest.dir)

    def _delete(self, entry_dir: str) -> None:
        """Out of sight first (one rename), then off the disk."""
        trash = os.path.join(self._work, "trash-" + os.path.basename(entry_dir))
        try:
            os.rename(entry_dir, trash)
        except OSError:
            return  # another process removed it already
        shutil.rmtree(trash, ignore_errors=True)

    # -- sharing the directory with other processes -----------------------------------------

    def _shared(self, rescan: Optional[bool] = None) -> "_DirectoryLock":
        """The directory lock; the index is rebuilt from disk first when another
        process changed the directory since this one last did (rescan=None)."""
        return _DirectoryLock(self, rescan)

    def _rescan(self) -> None:
        """Rebuild the index from disk: every namespace counts toward the bounds,
        only this one's entries can be found.  Recency is the meta's mtime."""
        found: list[tuple[int, _Entry]] = []
        for ns in _listdir(self.root):
            ns_dir = os.path.join(self.root, ns)
            if len(ns) != 32 or not _is_private_dir(ns_dir):
                continue
            for name in _listdir(ns_dir):
                entry_dir = os.path.join(ns_dir, name)
                entry = _scan_entry(entry_dir, own=ns == self.namespace)
                if entry is None:
                    self._delete(entry_dir)
                else:
                    found.append(entry)
        found.sort(key=lambda pair: pair[0])
        with self._lock:
            self._entries.clear()
            self._anchor_count.clear()
            self._bytes = 0
        for _, scanned in found:
            self._add(scanned)

    def _reclaim_orphans(self) -> int:
        """Remove the work directories of processes that died (their `owner` lock is free)."""
        reclaimed = 0
        for name in _listdir(self.root):
            path = os.path.join(self.root, name)
            if not name.startswith("work-") or path == self._work or not _is_private_dir(path):
                continue
            try:
                fd = os.open(os.path.join(path, "owner"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None      # died between creating it and locking its owner file
            except OSError:
                continue
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue       # alive
            finally:
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            reclaimed += 1
        return reclaimed


class _DirectoryLock:
    """The per-directory flock, and a generation counter in the lock file: a
    process whose last seen generation is stale rescans before it changes anything."""

    def __init__(self, cache: PrefixCache, rescan: Optional[bool]):
        self._cache = cache
        self._rescan = rescan

    def __enter__(self) -> None:
        c = self._cache
        c._dir_mutex.acquire()
        fcntl.flock(c._dir_lock, fcntl.LOCK_EX)
        try:
            data = os.pread(c._dir_lock, _GEN.size, 0)
            self._generation = _GEN.unpack(data)[0] if len(data) == _GEN.size else 0
            if self._rescan or (self._rescan is None and self._generation != c._generation):
                c._rescan()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        fcntl.flock(self._cache._dir_lock, fcntl.LOCK_UN)
        self._cache._dir_mutex.release()

    def __exit__(self, *exc) -> None:
        c = self._cache
        try:
            c._generation = self._generation + 1
            os.pwrite(c._dir_lock, _GEN.pack(c._generation), 0)
        finally:
            self._release()


def default_directory() -> Path:
    """$XDG_CACHE_HOME/serve, else ~/.cache/serve."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):  # the XDG spec says to ignore a relative path
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "serve"


def _private_dir(path: str, created_only: bool = False) -> None:
    """Make `path` a 0700 directory, or check it is one of ours.

    With created_only, an existing directory need only be a real directory
    (the operator may point at a shared one, e.g. /tmp); everything inside is
    private."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        if created_only:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise PrefixCacheError(f"{path} is not a directory (symlinks are not followed)")
            return
    except OSError as e:
        raise PrefixCacheError(f"cannot create {path}: {e.strerror or e}") from None
    if not _is_private_dir(path):
        raise PrefixCacheError(f"{path} must be a directory of this user's with mode 0700, "
                               "not a symlink")


def _is_private_dir(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_meta(path: str, with_tokens: bool) -> tuple[dict, tuple[int, ...]]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a snapshot meta file")
        (length,) = _LEN.unpack(f.read(_LEN.size) or b"\xff\xff\xff\xff")
        if length > MAX_HEADER:
            raise ValueError("meta header too long")
        header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("meta header is not an object")
        if not with_tokens:
            return header, ()
        body = f.read()
    n = header.get("n_tokens")
    if not isinstance(n, int) or len(body) != 4 * n:
        raise ValueError("meta token count does not match")
    ids = array("i")
    ids.frombytes(body)
    if sys.byteorder == "big":
        ids.byteswap()
    return header, tuple(ids)


def _scan_entry(entry_dir: str, own: bool) -> Optional[tuple[int, _Entry]]:
    """(recency, entry) from an entry's meta header, or None when it is damaged."""
    try:
        meta = os.path.join(entry_dir, "meta")
        header, _ = _read_meta(meta, with_tokens=False)
        key, anchor = bytes.fromhex(header["key"]), bytes.fromhex(header["anchor"])
        n, state_bytes = header["n_tokens"], header["state_bytes"]
        st_meta = os.lstat(meta)
        st_state = os.lstat(os.path.join(entry_dir, "state"))
        if (os.path.basename(entry_dir) != header["key"] or not isinstance(n, int)
                or not stat.S_ISREG(st_state.st_mode) or st_state.st_size != state_bytes):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # Another namespace's entries count toward the bounds but can never be found.
    entry = _Entry(key, anchor if own else None, n, st_meta.st_size + state_bytes, entry_dir)
    return st_meta.st_mtime_ns, entry


def _crc32(path: str, expected_size: object) -> Optional[int]:
    """zlib CRC-32 of a file, or None when its size is not `expected_size`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size != expected_size:
            return None
        crc = 0
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc
