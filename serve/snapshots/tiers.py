"""The two tiers together: publish what pays to the shared tier, fetch what pays from it.

Timed for the snapshot policy (serve/snapshots/policy.py), which decides;
the local tier (serve/snapshots/cache.py) is always the one the engine loads
from. Every call is a no-op without a shared tier. The engine's thread
publishes later (publish_later: on the publisher thread).

A request finds its snapshot while it waits for the engine (find: the local
tier's lookup, and a longer snapshot copied from the shared tier into the local
one), and claims it once it holds the engine (claim: brought up to date,
counted; serve/snapshots/lookup.py says why that is safe).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from serve.snapshots.cache import PrefixCache, Snapshot
from serve.snapshots.lookup import Files, Lookup
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.scope import NO_SCOPE, Scope

FETCH_TRIES = 3   # shared snapshots tried, longest first, before prefilling from the local one


def find(cache: PrefixCache, policy: SnapshotPolicy, tokens: Sequence[int],
         limit: Optional[int] = None, stop: Optional[Callable[[], bool]] = None,
         fetching: Optional[Callable[[int], None]] = None, scope: Scope = NO_SCOPE) -> Lookup:
    """The longest snapshot of a proper prefix of tokens[:limit], verified, from either
    tier (a shared one copied into the local tier when that pays), of the namespaces
    `scope` searches (its own first: the longest wins, the first of equals); `stop()`,
    asked between two chunks of a copy, gives it up; `fetching(positions)` is told before
    a copy starts. Nothing is counted until claim()."""
    found = [_find(cache, policy, tokens, limit, stop, fetching, namespace)
             for namespace in scope.searched]
    return max(found, key=lambda lookup: lookup.found.n_tokens if lookup.found else 0)


def _find(cache: PrefixCache, policy: SnapshotPolicy, tokens: Sequence[int],
          limit: Optional[int], stop: Optional[Callable[[], bool]],
          fetching: Optional[Callable[[int], None]], namespace: str) -> Lookup:
    lookup = cache.find(tokens, limit, namespace)
    if lookup.longest < 0:
        return lookup
    fetched = fetch(cache, policy, tokens, lookup.longest, lookup.found, stop, fetching, namespace)
    return lookup if fetched is None else _local(cache, lookup, fetched)


def claim(cache: PrefixCache, policy: SnapshotPolicy, lookup: Lookup) -> Lookup:
    """Under the engine: the lookup find() made, brought up to date (PrefixCache.recheck)
    and counted once. When the snapshot it verified went meanwhile, the shared tier is
    asked again too, as find() did."""
    current = cache.recheck(lookup)
    held = current.found.n_tokens if current.found is not None else 0
    if lookup.found is not None and held < lookup.found.n_tokens:
        fetched = fetch(cache, policy, lookup.tokens, current.longest, current.found,
                        namespace=lookup.namespace)
        if fetched is not None:
            current = _local(cache, current, fetched)
    return cache.counted(current)


def _local(cache: PrefixCache, lookup: Lookup, fetched: Snapshot) -> Lookup:
    """The lookup holding a snapshot just copied into the local tier: checked on the way
    in, so not read again. One this copy did not write (another request's) is verified as
    any local entry is."""
    entry = cache.entry(fetched.key) if fetched.written else None
    try:
        if entry is not None:
            return lookup.verified(entry, fetched, Files.of(entry.dir), 0.0)
    except OSError:
        pass   # evicted at once
    return cache.find(lookup.tokens, lookup.limit, lookup.namespace)


def publish_later(cache: PrefixCache, policy: SnapshotPolicy, snap: Snapshot,
                  supersedes: Optional[Snapshot] = None) -> None:
    """Publish a snapshot just stored locally when sparing another host its prefill pays, on
    the shared tier's publisher thread (serve/snapshots/publishing.py): what the engine's
    thread calls. `supersedes`: a progress snapshot `snap` holds all of, to
    unpublish once `snap` is published."""
    if cache.shared is not None:
        cache.shared.publisher.submit(snap, policy.worth_publishing, policy.published, supersedes)


def fetch(cache: PrefixCache, policy: SnapshotPolicy, tokens: Sequence[int], limit: int,
          have: Optional[Snapshot], stop: Optional[Callable[[], bool]] = None,
          fetching: Optional[Callable[[int], None]] = None, namespace: str = ""
          ) -> Optional[Snapshot]:
    """A snapshot of tokens[:limit] longer than `have` (the local tier's), copied from
    `namespace`'s in the shared tier into the local one when that pays; None otherwise."""
    shared = cache.shared
    if shared is None:
        return None
    held = have.n_tokens if have is not None else 0
    tried: set[str] = set()
    # A file that fails its check is skipped for the next longest (a damaged one is gone).
    for _ in range(FETCH_TRIES):
        found = shared.longest(tokens, min(limit, len(tokens) - 1), beyond=held,
                               namespace=namespace)
        if found is None or found[1] in tried or not policy.worth_fetching(found[0] - held):
            return None
        tried.add(found[1])
        if fetching is not None:
            fetching(found[0])
        started = time.monotonic()
        snap = shared.fetch(found[1], tokens, found[0], cache, stop, namespace)
        if snap is not None:
            policy.fetched(time.monotonic() - started)
            return snap
        if stop is not None and stop():
            return None
    return None
