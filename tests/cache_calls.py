"""The prefix cache's calls composed as the server makes them, one question at a time.

The server looks up in two steps (find while waiting, then recheck and count under the
engine: serve/snapshots/lookup.py) and publishes on a thread of its own; a test that only
asks "what would be restored?" or "publish this now" uses these.
"""
from __future__ import annotations

from typing import Optional, Sequence

from serve.snapshots.cache import PrefixCache, Snapshot
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.publishing import Job, publish_now


def lookup(cache: PrefixCache, tokens: Sequence[int], limit: Optional[int] = None) -> Optional[Snapshot]:
    """The local snapshot a request for `tokens` would restore, counted as a hit or miss."""
    return cache.counted(cache.recheck(cache.find(tokens, limit))).found


def publish(cache: PrefixCache, policy: SnapshotPolicy, snap: Snapshot) -> bool:
    """Publish `snap` to the cache's shared tier now, if the policy says it pays."""
    if cache.shared is None:
        return False
    return publish_now(cache.shared, Job(snap, None, policy.worth_publishing, policy.published))
