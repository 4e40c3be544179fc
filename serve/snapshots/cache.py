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

Lookups cost O(prompt length) whatever the number of entries (keys, in
serve/snapshots/keys.py); an entry's files are described in
serve/snapshots/entry_format.py. RAM per entry is a few hundred bytes, never
its token list. A request looks up (find) while it waits for the engine, and
the engine only rechecks what it found (serve/snapshots/lookup.py). This is the fast, local tier: `shared`, when set, is the
team's tier behind it (serve/snapshots/shared_tier.py).
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from serve.snapshots.entry_format import (Entry, PrefixCacheError, encode_meta, is_private_dir,
                                          listdir, private_dir, scan_root, write_private)
from serve.snapshots.lookup import Lookup, open_entry, unchanged, usable
from serve.snapshots.snapshot import Snapshot
from serve.snapshots.keys import BLOCK, anchors, key_of, probe, raw_ids, scoped, seed

if TYPE_CHECKING:
    from serve.snapshots.shared_tier import SharedTier

__all__ = ["BLOCK", "DEFAULT_MAX_ENTRIES", "PrefixCache", "PrefixCacheError", "Snapshot",
           "default_directory"]

DEFAULT_MAX_ENTRIES = 1024
_GEN = struct.Struct("<Q")


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
        private_dir(self.root, created_only=True)
        self._seed = seed(identity)
        self.namespace = self._seed.hex()
        self.directory = os.path.join(self.root, self.namespace)
        private_dir(self.directory)
        self._lock = threading.Lock()           # the in-memory index
        self._writes = 0                        # store() calls writing into the work directory
        self._closed = False                    # close() began: no new writes
        self._quiet = threading.Condition(self._lock)   # notified when _writes drops
        self._dir_mutex = threading.Lock()      # flock does not exclude this process's own threads
        self._dir_lock = os.open(os.path.join(self.root, "lock"),
                                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._entries: "OrderedDict[bytes, Entry]" = OrderedDict()  # least recent first
        self._anchor_count: dict[bytes, int] = {}
        self._bytes = 0
        self._generation = -1
        self._additions = 0     # entries of this namespace added to the index, ever (lookup.py)
        self.hits = self.misses = self.restored_tokens = 0
        self.shared: Optional[SharedTier] = None   # the team's tier behind this one (--shared-cache)
        self.reclaimed = 0   # dead processes' work directories removed at start
        with self._shared(rescan=False):
            # Under the directory lock, so that no one sees this work directory unowned.
            self._work = tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=self.root)
            self._owner = os.open(os.path.join(self._work, "owner"),
                                  os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._owner, fcntl.LOCK_EX)  # held until close() or death
            self.reclaimed = reclaim_orphans(self.root, self._work)
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

    def find(self, tokens: Sequence[int], limit: Optional[int] = None,
             namespace: str = "") -> Lookup:
        """The longest snapshot whose tokens are a proper prefix of `tokens`, verified, and
        nothing counted: what a request looks up while it waits for the engine, rechecked
        and counted once it holds it (tiers.claim; serve/snapshots/lookup.py).

        `limit` caps the usable prefix length (e.g. the first image position:
        identical placeholder ids do not mean identical image embeddings).
        A proper prefix, because generation needs at least one new token.
        A damaged or vanished entry met on the way is dropped. Only `namespace`'s entries
        are found (serve/snapshots/scope.py): its keys are hashed from its own seed.
        """
        longest = usable(tokens, limit)
        raw = raw_ids(tokens[:max(longest, 0)])
        with self._lock:
            additions = self._additions
        chain = anchors(scoped(self._seed, namespace), raw, longest // BLOCK) if longest >= 0 else []
        lookup = Lookup(tokens, limit, longest, raw, chain, additions, namespace)
        return self._verify_longest(lookup, beyond=-1) or lookup

    def recheck(self, lookup: Lookup) -> Lookup:
        """Under the engine: a lookup made earlier, brought up to date without reading what
        it verified again. A longer entry added since is verified now and taken; the
        verified entry is kept while its files are the ones verified; one evicted or
        changed meanwhile means looking up again. Nothing counted."""
        if lookup.longest < 0:
            return lookup
        with self._lock:
            grew = self._additions != lookup.additions
        if grew:
            held = lookup.found.n_tokens if lookup.found is not None else -1
            longer = self._verify_longest(lookup, beyond=held)
            if longer is not None:
                return longer
        if lookup.entry is None:
            return lookup
        with self._lock:
            indexed = self._entries.get(lookup.entry.key) is not None
        if indexed and unchanged(lookup):
            return lookup
        # Evicted or changed: again, from scratch.
        return self.find(lookup.tokens, lookup.limit, lookup.namespace)

    def counted(self, lookup: Lookup) -> Lookup:
        """A rechecked lookup, to restore now: counted once, a hit or a miss."""
        if lookup.longest >= 0:
            with self._lock:
                if lookup.found is not None:
                    self.hits += 1
                else:
                    self.misses += 1
        if lookup.entry is not None:
            self._touch(lookup.entry)
        return lookup

    def entry(self, key: str) -> Optional[Entry]:
        """The indexed entry of a snapshot's key (Snapshot.key), or None."""
        with self._lock:
            return self._entries.get(bytes.fromhex(key))

    def note_restored(self, n_tokens: int) -> None:
        """Count positions a caller actually restored from a snapshot (stats)."""
        with self._lock:
            self.restored_tokens += n_tokens

    def store(self, tokens: Sequence[int], save: Callable[[str], None],
              namespace: str = "") -> Optional[Snapshot]:
        """Snapshot the engine's current state, which holds exactly `tokens`, in `namespace`.

        `save(path)` writes the state (Engine.save_state); what it raises is
        raised here, with nothing left on disk.  A snapshot larger than the
        whole cache is not kept.  Returns the new entry, or None.
        """
        tokens = tuple(tokens)
        anchor, key = key_of(scoped(self._seed, namespace), tokens)
        with self._lock:
            known = self._entries.get(key)
            if known is None:
                if self._closed:
                    return None   # shutting down: the work directory is going away
                self._writes += 1
        if known is not None:
            snap = Snapshot(key.hex(), tokens, os.path.join(known.dir, "state"), known.size,
                            namespace=namespace)
            self._touch(known)
            return snap
        try:
            return self._write(key, anchor, tokens, save, namespace)
        finally:
            with self._lock:
                self._writes -= 1
                self._quiet.notify_all()

    def _write(self, key: bytes, anchor: bytes, tokens: tuple, save: Callable[[str], None],
               namespace: str) -> Optional[Snapshot]:
        scratch = tempfile.mkdtemp(dir=self._work)
        try:
            state = os.path.join(scratch, "state")
            save(state)
            os.chmod(state, 0o600)  # in this process's private scratch directory
            size = os.lstat(state).st_size
            meta = encode_meta(self.identity, key, anchor, tokens, state, size)
            total = size + len(meta)
            if total > self.capacity_bytes:
                return None
            write_private(os.path.join(scratch, "meta"), meta)
            with self._shared():
                if key not in self._entries:
                    final = os.path.join(self.directory, key.hex())
                    try:
                        os.rename(scratch, final)
                    except OSError as e:
                        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                    else:
                        self._add(Entry(key, anchor, len(tokens), total, final))
                        self._evict()
                entry = self._entries.get(key)
            if entry is None:
                return None
            return Snapshot(key.hex(), tokens, os.path.join(entry.dir, "state"), entry.size, True,
                            namespace)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone already when it was published

    def drop(self, snap: Snapshot) -> None:
        """Forget a snapshot and remove it (e.g. one that failed to load)."""
        entry = self.entry(snap.key)
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

    def _verify_longest(self, lookup: Lookup, beyond: int) -> Optional[Lookup]:
        """The lookup holding the longest entry past `beyond` positions whose files check
        out, or None; entries whose files fail are dropped."""
        for _, key in probe(lookup.chain, lookup.raw, lookup.longest, self._anchor_count, beyond):
            with self._lock:
                entry = self._entries.get(key)
            if entry is None:
                continue
            started = time.monotonic()
            opened = open_entry(entry, lookup.raw, self.identity, lookup.namespace)
            if opened is None:
                self._forget(entry)
                continue
            self._touch(entry)   # most recent: kept ahead of others while its request waits
            return lookup.verified(entry, *opened, time.monotonic() - started)
        return None

    def _touch(self, entry: Entry) -> None:
        """Most recently used, here and (through the meta's mtime) for other processes."""
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
        try:
            os.utime(os.path.join(entry.dir, "meta"), follow_symlinks=False)
        except OSError:
            pass

    # -- bookkeeping ------------------------------------------------------------------------

    def _add(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.key] = entry
            self._bytes += entry.size
            if entry.anchor is not None:
                self._additions += 1   # a lookup made before this may have a longer entry now
                self._anchor_count[entry.anchor] = self._anchor_count.get(entry.anchor, 0) + 1

    def _remove(self, entry: Entry) -> None:
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

    def _forget(self, entry: Entry) -> None:
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
        found = scan_root(self.root, self.namespace, self._delete)
        with self._lock:
            self._entries.clear()
            self._anchor_count.clear()
            self._bytes = 0
        for scanned in found:
            self._add(scanned)

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


def held(path: str) -> bool:
    """Whether a live process holds the flock on `path`. A missing file is held by no one
    (its process died between creating it and locking it); one that cannot be opened is
    taken as held, since no one can tell it dead."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def reclaim_orphans(root: str, own_work: str) -> int:
    """Remove the work directories of processes that died (their `owner` lock is free)."""
    reclaimed = 0
    for name in listdir(root):
        path = os.path.join(root, name)
        if not name.startswith("work-") or path == own_work or not is_private_dir(path):
            continue
        if held(os.path.join(path, "owner")):
            continue       # alive
        shutil.rmtree(path, ignore_errors=True)
        reclaimed += 1
    return reclaimed
