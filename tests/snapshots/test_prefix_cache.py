"""The snapshot store on its own: prefix lookup, bounds, persistence, damage, sharing."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import pytest

from conftest import ROOT
from cache_calls import lookup
from serve.snapshots import entry_format, keys
from serve.snapshots.cache import BLOCK, PrefixCache, PrefixCacheError


def writer(size: int):
    def save(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"s" * size)
    return save


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    yield c
    c.close()


def entry_dirs(c: PrefixCache) -> list[str]:
    return [os.path.join(c.directory, name) for name in os.listdir(c.directory)]


def test_longest_proper_prefix_wins(cache):
    cache.store([1, 2], writer(10))
    cache.store([1, 2, 3, 4], writer(10))
    cache.store([1, 9, 9], writer(10))
    assert lookup(cache, [1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert lookup(cache, [1, 2, 3]).tokens == (1, 2)
    # an exact match is not usable: generation needs one token of its own
    assert lookup(cache, [1, 2, 3, 4]).tokens == (1, 2)
    assert lookup(cache, [7, 1, 2]) is None


def test_prefixes_across_block_boundaries(cache):
    long = list(range(5 * BLOCK + 7))
    for n in (BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 3):
        cache.store(long[:n], writer(10))
    assert lookup(cache, long).n_tokens == 5 * BLOCK + 3
    assert lookup(cache, long, limit=5 * BLOCK + 2).n_tokens == 3 * BLOCK
    assert lookup(cache, long[:BLOCK + 1]).n_tokens == BLOCK
    assert lookup(cache, long[:BLOCK]).n_tokens == BLOCK - 1
    other = long[:2 * BLOCK] + [-1] + long[2 * BLOCK + 1:]   # differs inside the third block
    assert lookup(cache, other).n_tokens == BLOCK + 1


def test_limit_caps_the_prefix(cache):
    cache.store([1, 2, 3, 4], writer(10))
    cache.store([1, 2], writer(10))
    assert lookup(cache, [1, 2, 3, 4, 5], limit=3).tokens == (1, 2)
    assert lookup(cache, [1, 2, 3, 4, 5], limit=1) is None


def test_lru_eviction_by_bytes(tmp_path):
    probe = PrefixCache(1 << 20, parent_dir=str(tmp_path / "probe"))
    one = probe.store([1], writer(400)).size            # state and meta
    probe.close()
    cache = PrefixCache(2 * one + 10, parent_dir=str(tmp_path))
    cache.store([1], writer(400))
    cache.store([2], writer(400))
    assert lookup(cache, [1, 0]) is not None      # touch [1]: [2] is now oldest
    cache.store([3], writer(400))
    assert cache.used_bytes == 2 * one
    assert lookup(cache, [2, 0]) is None
    assert lookup(cache, [1, 0]) is not None and lookup(cache, [3, 0]) is not None
    assert len(entry_dirs(cache)) == 2
    cache.close()


def test_lru_eviction_by_entries(tmp_path):
    cache = PrefixCache(1 << 20, parent_dir=str(tmp_path), max_entries=3)
    for t in range(5):
        cache.store([t], writer(10))
    assert len(cache) == 3 and len(entry_dirs(cache)) == 3
    assert [lookup(cache, [t, 0]) is not None for t in range(5)] == [False, False, True, True, True]
    cache.close()


def test_oversized_snapshot_is_not_kept(cache):
    assert cache.store([5], writer(2 << 20)) is None
    assert len(cache) == 0 and entry_dirs(cache) == []


def test_drop_removes_and_close_keeps_entries(tmp_path):
    c = PrefixCache(1000, parent_dir=str(tmp_path))
    snap = c.store([1, 2], writer(10))
    assert os.path.exists(snap.path)
    c.drop(snap)
    assert not os.path.exists(snap.path) and c.used_bytes == 0
    kept = c.store([3], writer(10))
    work = [name for name in os.listdir(tmp_path) if name.startswith("work-")]
    assert len(work) == 1
    c.close()
    assert os.path.exists(kept.path)   # snapshots outlive the process
    assert not any(name.startswith("work-") for name in os.listdir(tmp_path))


def test_storing_the_same_prefix_twice_saves_once(cache):
    calls = []

    def save(path):
        calls.append(path)
        writer(10)(path)

    cache.store([4, 4], save)
    cache.store([4, 4], save)
    assert len(calls) == 1 and len(cache) == 1


def test_bounds_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        PrefixCache(0, parent_dir=str(tmp_path))
    with pytest.raises(ValueError):
        PrefixCache(100, parent_dir=str(tmp_path), max_entries=0)


def test_a_failed_save_leaves_no_file(cache):
    def half_written(path: str) -> None:
        writer(10)(path)
        raise OSError("disk full")

    with pytest.raises(OSError):
        cache.store([6, 6], half_written)
    assert len(cache) == 0 and cache.used_bytes == 0 and entry_dirs(cache) == []
    assert os.listdir(cache._work) == ["owner"]


def test_stats_count_hits_misses_and_restored_tokens(cache):
    cache.store([1, 2, 3], writer(10))
    lookup(cache, [1, 2, 3, 4])
    lookup(cache, [9, 9])
    cache.note_restored(3)
    assert cache.stats() == {"entries": 1, "bytes": cache.used_bytes, "hits": 1, "misses": 1,
                             "restored_tokens": 3}


# -- persistence --------------------------------------------------------------------------


def test_a_restart_finds_the_snapshots(tmp_path):
    first = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="model A")
    stored = first.store(list(range(200)), writer(50))
    first.close()
    again = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="model A")
    found = lookup(again, list(range(300)))
    assert found is not None and found.tokens == tuple(range(200)) and found.path == stored.path
    again.close()


def test_another_identity_never_sees_an_entry(tmp_path):
    a = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="engine 0.6.8")
    a.store([1, 2, 3], writer(10))
    b = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="engine 0.6.9")
    assert lookup(b, [1, 2, 3, 4]) is None
    assert len(b) == 1   # yet it counts toward the directory's bounds
    # An entry copied into another namespace is refused by its recorded identity.
    b.store([5], writer(10))
    src = entry_dirs(a)[0]
    os.rename(src, os.path.join(b.directory, os.path.basename(src)))
    c = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="engine 0.6.9")
    assert lookup(c, [1, 2, 3, 4]) is None
    for each in (a, b, c):
        each.close()


def test_the_bounds_hold_across_restarts(tmp_path):
    big = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="x")
    for t in range(10):
        big.store([t, t], writer(100))
    big.close()
    small = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="y", max_entries=4)
    assert len(small) == 4 and sum(len(os.listdir(os.path.join(tmp_path, d)))
                                   for d in os.listdir(tmp_path) if len(d) == 32) == 4
    one = small.store([1], writer(100)).size
    small.close()
    tight = PrefixCache(2 * one + 50, parent_dir=str(tmp_path), identity="x")
    assert len(tight) == 2 and tight.used_bytes <= 2 * one + 50
    tight.close()


@pytest.mark.parametrize("damage", ["corrupt state", "truncated state", "corrupt meta",
                                    "truncated meta", "missing state", "symlinked meta"])
def test_a_damaged_entry_is_dropped(tmp_path, damage):
    c = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    snap = c.store(list(range(100)), writer(1000))
    meta = os.path.join(os.path.dirname(snap.path), "meta")
    if damage == "corrupt state":
        with open(snap.path, "r+b") as f:
            f.seek(500)
            f.write(b"X")
    elif damage == "truncated state":
        os.truncate(snap.path, 999)
    elif damage == "corrupt meta":
        with open(meta, "r+b") as f:
            f.seek(len(entry_format.MAGIC) + 8)
            f.write(b"\xff\xff")
    elif damage == "truncated meta":
        os.truncate(meta, os.path.getsize(meta) - 4)
    elif damage == "missing state":
        os.unlink(snap.path)
    else:
        real = str(tmp_path / "elsewhere")
        os.rename(meta, real)
        os.symlink(real, meta)
    assert lookup(c, list(range(101))) is None
    assert len(c) == 0 and entry_dirs(c) == []
    c.close()


def test_damage_found_at_start_is_removed(tmp_path):
    c = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    c.store([1, 2], writer(10))
    os.mkdir(os.path.join(c.directory, "junk"))
    with open(os.path.join(c.directory, "junk", "meta"), "wb") as f:
        f.write(b"not a meta file")
    c.close()
    again = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    assert len(again) == 1 and len(entry_dirs(again)) == 1
    again.close()


def test_files_are_private(tmp_path):
    root = tmp_path / "cache"
    c = PrefixCache(1 << 20, parent_dir=str(root))
    snap = c.store([1], writer(10))
    for path in (root, c.directory, os.path.dirname(snap.path)):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    for name in ("state", "meta"):
        assert stat.S_IMODE(os.lstat(os.path.join(os.path.dirname(snap.path), name)).st_mode) == 0o600
    c.close()


def test_an_unusable_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(PrefixCacheError, match="symlink"):
        PrefixCache(100, parent_dir=str(tmp_path / "link"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(PrefixCacheError):
        PrefixCache(100, parent_dir=str(tmp_path / "file"))
    shared = tmp_path / "shared"
    c = PrefixCache(100, parent_dir=str(shared))
    c.close()
    os.chmod(c.directory, 0o755)   # a namespace others can read is not trusted
    with pytest.raises(PrefixCacheError, match="0700"):
        PrefixCache(100, parent_dir=str(shared))


# -- sharing: processes, orphans ------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}, {root!r} + "/tests"]
    from cache_calls import lookup
    from serve.snapshots.cache import PrefixCache

    def save(path):
        with open(path, "wb") as f:
            f.write(b"s" * 300)
        if {hang!r}:
            print("saving", flush=True)
            time.sleep(600)

    cache = PrefixCache({capacity}, {directory!r}, identity="shared", max_entries={entries})
    for i in range({count}):
        cache.store([i % 7, i, {me}], save)          # private entries
        cache.store([i % 7, i], save)                # the same keys in both processes
        lookup(cache, [i % 7, i, 0, 0])
    cache.close()
""")


def child(tmp_path, me: int, count: int, hang: bool = False, entries: int = 1000,
          capacity: int = 1 << 30) -> subprocess.Popen:
    code = CHILD.format(root=str(ROOT), hang=hang, capacity=capacity, directory=str(tmp_path),
                        entries=entries, count=count, me=me)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_close_waits_for_a_snapshot_being_written_and_then_refuses_new_ones(tmp_path):
    """Shutdown closes the cache while a stopped prefill may be saving where it got: the
    save ends first, so that nothing of this process is left in the directory."""
    c = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    saving, release = threading.Event(), threading.Event()

    def slow_save(path: str) -> None:
        saving.set()
        assert release.wait(30)
        writer(10)(path)

    stored: list = []
    worker = threading.Thread(target=lambda: stored.append(c.store([1, 2, 3], slow_save)))
    worker.start()
    assert saving.wait(30)
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()          # waiting for the save in flight
    release.set()
    worker.join(30)
    closer.join(30)
    assert not closer.is_alive() and stored[0] is not None
    assert c.store([4, 5, 6], writer(10)) is None   # closed: nothing new is written
    assert not [name for name in os.listdir(tmp_path) if name.startswith("work-")]
    reopened = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    assert lookup(reopened, [1, 2, 3, 4]).n_tokens == 3 and reopened.reclaimed == 0
    reopened.close()


def test_two_processes_write_concurrently(tmp_path):
    procs = [child(tmp_path, me, 150, entries=60) for me in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for p in procs:
        p.stdout.close()
    c = PrefixCache(1 << 30, parent_dir=str(tmp_path), identity="shared")
    assert 0 < len(c) <= 60
    assert len(entry_dirs(c)) == len(c)
    # Every entry left is whole: each one looks up to itself.
    for name in os.listdir(c.directory):
        header, tokens = entry_format.read_meta(os.path.join(c.directory, name, "meta"), True)
        assert lookup(c, list(tokens) + [0]).tokens == tokens
    assert len(c) == len(entry_dirs(c))
    assert [n for n in os.listdir(tmp_path) if n.startswith("work-")] == [c._work.rsplit("/", 1)[1]]
    c.close()


def test_a_killed_process_leaves_work_that_the_next_start_reclaims(tmp_path):
    proc = child(tmp_path, 1, 1, hang=True)
    try:
        assert proc.stdout.readline() == "saving\n"
        alive = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="shared")
        assert alive.reclaimed == 0     # its owner still holds the lock
        alive.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    left = [n for n in os.listdir(tmp_path) if n.startswith("work-")]
    assert len(left) == 1 and os.listdir(tmp_path / left[0])   # the half-written snapshot
    after = PrefixCache(1 << 20, parent_dir=str(tmp_path), identity="shared")
    assert after.reclaimed == 1 and len(after) == 0
    assert [n for n in os.listdir(tmp_path) if n.startswith("work-")] == [os.path.basename(after._work)]
    after.close()


# -- cost: bounded memory, lookups independent of the entry count ----------------------------


def test_a_soak_keeps_entries_files_and_memory_bounded(tmp_path):
    c = PrefixCache(1 << 30, parent_dir=str(tmp_path), max_entries=50)

    def round_of(n: int) -> None:
        for i in range(n):
            prompt = [i % 13] * 40 + list(range(i, i + 150))
            lookup(c, prompt + [1])
            c.store(prompt, writer(64))

    round_of(500)
    # Only what the cache's own code allocated, at any depth: the suite's other threads (a
    # server of another test finishing its idle work) allocate meanwhile on a busy machine.
    mine = [tracemalloc.Filter(True, str(ROOT / "serve" / "snapshots" / "*"), all_frames=True)]
    tracemalloc.start(32)
    before = tracemalloc.take_snapshot().filter_traces(mine)
    round_of(2500)
    grown = sum(s.size_diff for s in
                tracemalloc.take_snapshot().filter_traces(mine).compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(c) == 50 and len(entry_dirs(c)) == 50
    assert len(c._anchor_count) <= 50
    assert grown < 64 << 10, grown   # 2,500 more stores, and the heap stays where it was
    c.close()


def count_digests(monkeypatch) -> list[int]:
    calls = [0]
    real = keys.digest

    def counting(prev: bytes, data: bytes) -> bytes:
        calls[0] += 1
        return real(prev, data)

    monkeypatch.setattr(keys, "digest", counting)
    return calls


def test_lookup_work_does_not_grow_with_the_entry_count(tmp_path, monkeypatch):
    prompt = list(range(1000, 1000 + 20 * BLOCK))
    work = []
    for entries in (10, 1000):
        c = PrefixCache(1 << 30, parent_dir=str(tmp_path / str(entries)), max_entries=entries)
        c.store(prompt[:10 * BLOCK + 5], writer(1))   # the one that will be found
        for i in range(entries - 1):                   # and many that share its first block
            c.store(prompt[:BLOCK] + [i, i], writer(1))
        calls = count_digests(monkeypatch)
        assert lookup(c, prompt).n_tokens == 10 * BLOCK + 5
        work.append(calls[0])
        monkeypatch.undo()
        c.close()
    assert work[0] == work[1]
    assert work[0] <= 20 + 2 * BLOCK   # one per block, and the positions of two anchored blocks
