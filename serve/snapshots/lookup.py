"""A prefix-cache lookup made before the engine is free, and what makes it safe to use later.

Finding a prompt's snapshot costs no engine: hashing the prompt's blocks,
reading the best entry's meta and checksumming its state (hundreds of MB on
K3), and with a shared tier copying a longer snapshot into the local one. So a
request does all that while it waits (serve/snapshots/tiers.py's find), and
keeps a `Lookup`: the hashed anchors, the verified entry, and the identity of
the files it verified. When the request holds the engine the lookup may be
stale, and the cache's claim (PrefixCache.recheck) settles it cheaply:

- an entry added since (the request ahead stored a longer snapshot of the same
  conversation) is found by probing the kept anchors again, a few tail hashes,
  and is verified then;
- the verified entry still in the index with the same files (device, inode,
  size, and the state's mtime and ctime: no write or replacement since) is used
  as verified, without reading it again;
- a verified entry evicted, damaged or replaced meanwhile is not used: the
  lookup is made again, under the engine, as it was before this existed.

Hits and misses are counted then, once, for what is really restored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from serve.snapshots.entry_format import Entry, crc32, read_meta
from serve.snapshots.keys import ID_BYTES, raw_ids
from serve.snapshots.snapshot import Snapshot


@dataclass(frozen=True)
class Files:
    """What identifies an entry's files as the ones verified: a write or a replacement
    changes it. The meta's times are left out: every use touches them (recency)."""
    meta: tuple[int, int, int]                 # device, inode, size
    state: tuple[int, int, int, int, int]      # device, inode, size, mtime, ctime (ns)

    @staticmethod
    def of(entry_dir: str) -> "Files":
        meta = os.lstat(os.path.join(entry_dir, "meta"))
        state = os.lstat(os.path.join(entry_dir, "state"))
        return Files((meta.st_dev, meta.st_ino, meta.st_size),
                     (state.st_dev, state.st_ino, state.st_size, state.st_mtime_ns,
                      state.st_ctime_ns))


@dataclass(frozen=True)
class Lookup:
    """One prompt's lookup: what it probed, and the entry it verified (None: a miss)."""
    tokens: Sequence[int]
    limit: Optional[int]        # the usable prefix's cap (the first image's position)
    longest: int                # the longest prefix a snapshot may hold (-1: none can)
    raw: bytes                  # tokens[:longest], as the keys hash them
    chain: Sequence[bytes]      # the anchors of raw's whole blocks, hashed once
    additions: int              # the cache's count of entries added, when it was probed
    namespace: str = ""         # whose entries it probed (serve/snapshots/scope.py)
    found: Optional[Snapshot] = None
    entry: Optional[Entry] = None
    files: Optional[Files] = None
    checked: float = 0.0        # seconds the verification took (a load's cost counts it)

    def verified(self, entry: Entry, snap: Snapshot, files: Files, checked: float) -> "Lookup":
        return replace(self, found=snap, entry=entry, files=files, checked=checked)


def usable(tokens: Sequence[int], limit: Optional[int]) -> int:
    """The longest prefix of `tokens` a snapshot may hold: a proper one, because generation
    needs at least one new token, and at most `limit`."""
    return len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)


def open_entry(entry: Entry, raw: bytes, identity: str, namespace: str = ""
               ) -> Optional[tuple[Snapshot, Files]]:
    """The entry as a Snapshot, if its files are whole and hold exactly these tokens, and
    the identity of the files checked; None when it is damaged or gone."""
    try:
        files = Files.of(entry.dir)
        header, tokens = read_meta(os.path.join(entry.dir, "meta"), with_tokens=True)
        state = os.path.join(entry.dir, "state")
        if (header.get("identity") != identity or header.get("key") != entry.key.hex()
                or raw_ids(tokens) != raw[:entry.n_tokens * ID_BYTES] or len(tokens) != entry.n_tokens
                or crc32(state, header.get("state_bytes")) != header.get("state_crc32")
                or Files.of(entry.dir) != files):   # written to while it was read
            return None
    except (OSError, ValueError):
        return None
    return Snapshot(entry.key.hex(), tokens, state, entry.size, namespace=namespace), files


def unchanged(lookup: Lookup) -> bool:
    """The verified entry's files are still the ones verified."""
    if lookup.entry is None or lookup.files is None:
        return False
    try:
        return Files.of(lookup.entry.dir) == lookup.files
    except OSError:
        return False
