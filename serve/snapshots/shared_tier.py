"""The team's snapshot tier: engine states every host publishes and every host restores.

Behind each host's local prefix cache (the fast tier) sits a directory every
host of a team reads (--shared-cache DIR, e.g. over NFS): a local snapshot
worth it is published there too, and a prompt whose longest snapshot is
there rather than here copies it into the local tier first, checked, then
restores it as usual. So a host that dies leaves what it published for
whoever takes its conversations, and a preamble warmed on one host is
restored on all.

    DIR/snapshots/<namespace>/<anchor>-<key>.snap   a state: token ids, then the engine state

One file per snapshot (serve/snapshots/shared_dir.py: atomic publish, a
checked header and digest, eviction by use). The namespace and every file's
header carry the identity of the model and engine (serve/snapshots/identity.py);
the token ids in the file must be the prefix looked up; the digest is checked
before the copy in the local tier exists, so a state is loaded only once it
proved whole.
"""
from __future__ import annotations

import os
import threading
from typing import BinaryIO, Callable, Iterator, Optional, Sequence

from serve.snapshots.publishing import Publisher
from serve.snapshots.keys import ID_BYTES, candidates, ids_of, key_of, raw_ids, scoped, seed
from serve.snapshots.snapshot import LocalTier, Snapshot
from serve.snapshots.shared_dir import CHUNK, Rejected, SharedDir, Stopped

SUFFIX = ".snap"
WAIT_POLL = 0.05   # seconds between two looks at whether a request waiting for a copy left


class SharedTier:
    """The shared snapshots of one model and engine. Thread-safe; hosts share it."""

    def __init__(self, root: str, capacity_bytes: int, identity: str):
        self._seed = seed(identity)
        self.root = root
        self.files = SharedDir(os.path.join(root, "snapshots", self._seed.hex()),
                               capacity_bytes, identity)
        self.fetched_tokens = 0          # positions copied from here into the local tier
        self._count = threading.Lock()   # fetched_tokens, and _copying
        self._copying: dict[str, threading.Event] = {}   # file -> set when its copy is over
        self.publisher = Publisher(self)   # publishing off the engine's thread

    @property
    def capacity_bytes(self) -> int:
        return self.files.capacity_bytes

    def _index(self) -> tuple[set[bytes], dict[bytes, str]]:
        """(anchors, key -> file name) of what is published now: one listing."""
        anchors: set[bytes] = set()
        keys: dict[bytes, str] = {}
        for name in self.files.names():
            anchor, _, key = name.removesuffix(SUFFIX).partition("-")
            try:
                anchors.add(bytes.fromhex(anchor))
                keys[bytes.fromhex(key)] = name
            except ValueError:
                continue
        return anchors, keys

    def _found(self, tokens: Sequence[int], longest: int, namespace: str
               ) -> Iterator[tuple[int, str]]:
        """(positions, file) of `namespace`'s published prefixes of tokens[:longest], longest
        first."""
        if longest < 0:
            return
        anchors, keys = self._index()
        chain_seed = scoped(self._seed, namespace)
        for end, key in candidates(chain_seed, raw_ids(tokens[:longest]), longest, anchors):
            if key in keys:
                yield end, keys[key]

    def longest(self, tokens: Sequence[int], limit: int, beyond: int = 0,
                namespace: str = "") -> Optional[tuple[int, str]]:
        """(positions, file) of the longest prefix of tokens[:limit] `namespace` published
        holding more than `beyond` positions, or None."""
        for end, name in self._found(tokens, limit, namespace):
            return (end, name) if end > beyond else None
        return None

    def published(self, tokens: Sequence[int], namespace: str = "") -> int:
        """The positions the longest prefix of `tokens` (itself included) `namespace`
        published holds."""
        found = self.longest(tokens, len(tokens), namespace=namespace)
        return found[0] if found else 0

    def publish(self, snap: Snapshot, state: Optional[BinaryIO] = None,
                stop: Optional[Callable[[], bool]] = None) -> bool:
        """Publish a local snapshot (its state file is read, not moved; `state`: that file,
        opened already). False: not published (the local entry vanished, the write failed:
        counted, or `stop()` said to give up between two chunks: nothing left behind)."""
        anchor, key = key_of(scoped(self._seed, snap.namespace), snap.tokens)
        if state is None:
            try:
                state = open(snap.path, "rb")   # open: the local tier may evict it meanwhile
            except OSError:
                return False
        with state:
            size = os.fstat(state.fileno()).st_size
            body = _chain(raw_ids(snap.tokens), _chunks(state, stop))
            return self.files.publish(f"{anchor.hex()}-{key.hex()}{SUFFIX}", "snapshot",
                                      {"n_tokens": snap.n_tokens},
                                      body, snap.n_tokens * ID_BYTES + size)

    def unpublish(self, snap: Snapshot) -> None:
        """Remove a published snapshot a later one holds all of (a progress snapshot
        superseded)."""
        anchor, key = key_of(scoped(self._seed, snap.namespace), snap.tokens)
        self.files.remove(f"{anchor.hex()}-{key.hex()}{SUFFIX}")

    def fetch(self, name: str, tokens: Sequence[int], n: int, local: LocalTier,
              stop: Optional[Callable[[], bool]] = None, namespace: str = ""
              ) -> Optional[Snapshot]:
        """Copy the published snapshot `name` of tokens[:n] into the local tier, checked on
        the way; the local snapshot, or None (gone, damaged, foreign: counted; or `stop()`
        said to give up, between two chunks: nothing is left behind).

        One copy of a file at a time in this process: a request that wants the file
        another is copying waits for that copy, then finds the snapshot local (or copies
        it itself, when the other gave up)."""
        if not self._alone(name, stop):
            return None
        try:
            return self._copy(name, tokens, n, local, stop, namespace)
        finally:
            with self._count:
                done = self._copying.pop(name)
            done.set()

    def _alone(self, name: str, stop: Optional[Callable[[], bool]]) -> bool:
        """Wait until no other thread copies `name`, and mark it as this one's copy; False
        when `stop()` said to give up first."""
        while True:
            with self._count:
                running = self._copying.get(name)
                if running is None:
                    self._copying[name] = threading.Event()
                    return True
            while not running.wait(WAIT_POLL):
                if stop is not None and stop():
                    return False

    def _copy(self, name: str, tokens: Sequence[int], n: int, local: LocalTier,
              stop: Optional[Callable[[], bool]], namespace: str) -> Optional[Snapshot]:
        def save(path: str) -> None:   # called only when the local tier lacks it
            reader = self.files.open(name)
            if reader is None:
                raise _Missing()   # counted by open()
            try:
                if reader.header.get("n_tokens") != n or reader.body_bytes < n * ID_BYTES:
                    raise Rejected("damaged", f"{name} does not hold {n} positions")
                if ids_of(reader.read(n * ID_BYTES)) != tuple(tokens[:n]):
                    raise Rejected("damaged", f"{name} holds other tokens than its name says")
                with open(path, "wb") as out:
                    reader.copy_to(out, stop)
                reader.verify()   # raised here, the local tier keeps nothing
            finally:
                reader.close()

        try:
            snap = local.store(tokens[:n], save, namespace)
        except Rejected as e:
            self.files.reject(name, e)
            return None
        except (_Missing, Stopped):
            return None
        except OSError:
            self.files.count("missing")   # e.g. ESTALE: evicted under this reader
            return None
        if snap is not None and snap.written:
            self.files.touch(name)
            self.files.count("read")
            with self._count:
                self.fetched_tokens += n
        return snap


class _Missing(Exception):
    """The file went between the listing and the copy."""


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _chunks(state: BinaryIO, stop: Optional[Callable[[], bool]]) -> Iterator[bytes]:
    while chunk := state.read(CHUNK):
        if stop is not None and stop():
            raise Stopped()
        yield chunk
