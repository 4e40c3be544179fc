"""The snapshot store on its own: prefix lookup, LRU eviction, cleanup."""
from __future__ import annotations

import os

import pytest

from serve.prefix_cache import PrefixCache


def writer(size: int):
    def save(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"s" * size)
    return save


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(1000, parent_dir=str(tmp_path))
    yield c
    c.close()


def test_longest_proper_prefix_wins(cache):
    cache.store([1, 2], writer(10))
    cache.store([1, 2, 3, 4], writer(10))
    cache.store([1, 9, 9], writer(10))
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert cache.lookup([1, 2, 3]).tokens == (1, 2)
    # an exact match is not usable: generation needs one token of its own
    assert cache.lookup([1, 2, 3, 4]).tokens == (1, 2)
    assert cache.lookup([7, 1, 2]) is None


def test_limit_caps_the_prefix(cache):
    cache.store([1, 2, 3, 4], writer(10))
    cache.store([1, 2], writer(10))
    assert cache.lookup([1, 2, 3, 4, 5], limit=3).tokens == (1, 2)
    assert cache.lookup([1, 2, 3, 4, 5], limit=1) is None


def test_lru_eviction_by_bytes(cache):
    cache.store([1], writer(400))
    cache.store([2], writer(400))
    assert cache.lookup([1, 0]) is not None      # touch [1]: [2] is now oldest
    cache.store([3], writer(400))
    assert cache.used_bytes == 800
    assert cache.lookup([2, 0]) is None
    assert cache.lookup([1, 0]) is not None and cache.lookup([3, 0]) is not None
    assert len(os.listdir(cache.directory)) == 2


def test_oversized_snapshot_is_not_kept(cache):
    assert cache.store([5], writer(5000)) is None
    assert len(cache) == 0 and os.listdir(cache.directory) == []


def test_drop_and_close_remove_files(tmp_path):
    c = PrefixCache(1000, parent_dir=str(tmp_path))
    snap = c.store([1, 2], writer(10))
    assert os.path.exists(snap.path)
    c.drop(snap)
    assert not os.path.exists(snap.path) and c.used_bytes == 0
    c.store([3], writer(10))
    c.close()
    assert not os.path.exists(c.directory)


def test_storing_the_same_prefix_twice_saves_once(cache):
    calls = []

    def save(path):
        calls.append(path)
        writer(10)(path)

    cache.store([4, 4], save)
    cache.store([4, 4], save)
    assert len(calls) == 1 and cache.used_bytes == 10


def test_capacity_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        PrefixCache(0, parent_dir=str(tmp_path))


def test_a_failed_save_leaves_no_file(cache):
    def half_written(path: str) -> None:
        writer(10)(path)
        raise OSError("disk full")

    with pytest.raises(OSError):
        cache.store([6, 6], half_written)
    assert len(cache) == 0 and cache.used_bytes == 0 and os.listdir(cache.directory) == []
