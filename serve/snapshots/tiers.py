"""The two tiers together: publish what pays to the shared tier, fetch what pays from it.

Timed for the snapshot policy (serve/snapshots/policy.py), which decides;
the local tier (serve/snapshots/cache.py) is always the one the engine loads
from. Both calls are no-ops without a shared tier.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from serve.snapshots.cache import PrefixCache, Snapshot
from serve.snapshots.policy import SnapshotPolicy

FETCH_TRIES = 3   # shared snapshots tried, longest first, before prefilling from the local one


def publish(cache: PrefixCache, policy: SnapshotPolicy, snap: Snapshot) -> bool:
    """Publish a snapshot just stored locally when sparing another host its prefill pays."""
    shared = cache.shared
    if shared is None:
        return False
    if not policy.worth_publishing(snap.n_tokens - shared.published(snap.tokens)):
        return False
    started = time.monotonic()
    done = shared.publish(snap)
    if done:
        policy.published(time.monotonic() - started)
    return done


def fetch(cache: PrefixCache, policy: SnapshotPolicy, tokens: Sequence[int], limit: int,
          have: Optional[Snapshot]) -> Optional[Snapshot]:
    """A snapshot of tokens[:limit] longer than `have` (the local tier's), copied from the
    shared tier into the local one when that pays; None otherwise."""
    shared = cache.shared
    if shared is None:
        return None
    held = have.n_tokens if have is not None else 0
    tried: set[str] = set()
    # A file that fails its check is skipped for the next longest (a damaged one is gone).
    for _ in range(FETCH_TRIES):
        found = shared.longest(tokens, min(limit, len(tokens) - 1), beyond=held)
        if found is None or found[1] in tried or not policy.worth_fetching(found[0] - held):
            return None
        tried.add(found[1])
        started = time.monotonic()
        snap = shared.fetch(found[1], tokens, found[0], cache)
        if snap is not None:
            policy.fetched(time.monotonic() - started)
            return snap
    return None
