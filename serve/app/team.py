"""`--shared-cache DIR`: the team's tier, a directory every host of a team reads and writes.

It holds the snapshots hosts publish (serve/snapshots/shared_tier.py), the ids of
the replies they wrote (serve/snapshots/reply_memory.py) and their stored
Responses (serve/service/response_store.py), each a file of its own,
written atomically and checked when read (serve/snapshots/shared_dir.py):

    DIR/snapshots/<namespace>/   engine states, bounded by --shared-cache-size
    DIR/replies/<namespace>/     generated ids by rendered reply, REPLIES_BYTES at most
    DIR/responses/               stored responses, SHARED_BYTES at most (any model's)
    DIR/seal.key                 the key reasoning signatures are made with (serve/dialects/seal.py)
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from serve.dialects import seal
from serve.service.response_store import SHARED_BYTES
from serve.snapshots.cache import PrefixCache
from serve.snapshots.shared_tier import SharedTier
from serve.snapshots.shared_dir import SharedDir

REPLIES_BYTES = 1 << 30
DEFAULT_CAP = 64 << 30


@dataclass(frozen=True)
class Team:
    snapshots: SharedTier
    replies: SharedDir
    responses: SharedDir


def default_size(directory: str) -> int:
    """A quarter of the free space where the shared tier goes, at most DEFAULT_CAP."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return min(shutil.disk_usage(existing).free // 4, DEFAULT_CAP)


def open_team(directory: str, size: int, cache: PrefixCache) -> Team:
    """The shared tier behind `cache` (which it is attached to). Raises OSError when the
    directory cannot be made, ValueError when its seal.key is not a key."""
    snapshots = SharedTier(directory, size, cache.identity)
    seal.use_shared_key(os.path.join(directory, "seal.key"))
    team = Team(snapshots,
                SharedDir(os.path.join(directory, "replies", cache.namespace), REPLIES_BYTES,
                          cache.identity),
                SharedDir(os.path.join(directory, "responses"), SHARED_BYTES))
    cache.shared = snapshots
    return team


def describe(tier: SharedTier) -> str:
    """The banner's line."""
    files, used = tier.files.usage()
    return (f"{tier.root}: snapshots {tier.capacity_bytes / 2**30:.2f} GiB at "
            f"most ({files} published, {used / 2**30:.2f} GiB), replies and stored responses too")
