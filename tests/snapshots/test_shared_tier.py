"""The shared snapshot tier on its own: hosts (here: caches with local directories of their
own, threads and processes) publishing, fetching, evicting and damaging the same files."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import ROOT
from scripted import call, scrape, wait_idle
from cache_calls import lookup, publish
from served import run_cli, serve
from serve.dialects import seal
from serve.service.response_store import ResponseStore
from serve.snapshots import tiers
from serve.snapshots.cache import PrefixCache
from serve.snapshots.keys import BLOCK
from serve.snapshots.policy import SnapshotPolicy
from serve.snapshots.reply_memory import ReplyMemory
from serve.snapshots.shared_tier import SharedTier
from serve.snapshots.shared_dir import DIGEST, Rejected, SharedDir
from serve.core.segment import Segment

IDENTITY = '{"model": "test"}'


def state_of(tokens) -> bytes:
    """The 'engine state' a test writes for `tokens`: which tokens, recognizably, and bulk."""
    head = ",".join(map(str, tokens)).encode()
    return head + b"|" + bytes((sum(tokens) + k) % 251 for k in range(4000))


def saver(tokens):
    def save(path: str) -> None:
        with open(path, "wb") as f:
            f.write(state_of(tokens))
    return save


class Host:
    """One host's local tier in front of the shared one."""

    def __init__(self, tmp_path, name: str, shared: str, capacity: int = 1 << 30,
                 identity: str = IDENTITY):
        self.cache = PrefixCache(1 << 30, str(tmp_path / name), identity=identity)
        self.tier = SharedTier(shared, capacity, identity)
        self.cache.shared = self.tier
        self.policy = SnapshotPolicy()

    def store(self, tokens):
        snap = self.cache.store(tokens, saver(tokens))
        assert publish(self.cache, self.policy, snap)
        return snap

    def restore(self, tokens):
        """What a prompt of `tokens` would load: the local tier's, or the shared tier's."""
        local = lookup(self.cache, tokens)
        return tiers.fetch(self.cache, self.policy, tokens, len(tokens), local) or local


@pytest.fixture
def hosts(tmp_path):
    made = []

    def make(name: str, **kw) -> Host:
        made.append(Host(tmp_path, name, str(tmp_path / "shared"), **kw))
        return made[-1]
    yield make
    for host in made:
        host.cache.close()


def only_file(tier: SharedTier) -> str:
    [name] = tier.files.names()
    return tier.files.file(name)


def test_a_snapshot_published_by_one_host_is_restored_whole_by_another(hosts):
    a, b = hosts("a"), hosts("b")
    prompt = list(range(3 * BLOCK + 5))
    a.store(prompt[:2 * BLOCK + 3])
    snap = b.restore(prompt)
    assert snap.n_tokens == 2 * BLOCK + 3
    with open(snap.path, "rb") as f:
        assert f.read() == state_of(prompt[:2 * BLOCK + 3])
    assert lookup(b.cache, prompt).n_tokens == snap.n_tokens     # now in b's local tier
    assert b.tier.files.counters.read == 1 and b.tier.fetched_tokens == snap.n_tokens
    # A longer local snapshot wins; a shorter shared one is not even opened.
    b.cache.store(prompt[:3 * BLOCK], saver(prompt[:3 * BLOCK]))
    assert b.restore(prompt).n_tokens == 3 * BLOCK and b.tier.files.counters.read == 1


def test_publishing_what_is_published_already_writes_nothing(hosts):
    a, b = hosts("a"), hosts("b")
    a.store([1, 2, 3])
    snap = b.cache.store([1, 2, 3], saver([1, 2, 3]))
    assert not publish(b.cache, b.policy, snap)    # spares no one anything
    assert b.tier.files.counters.published == 0


@pytest.mark.parametrize("damage", ["flipped state byte", "flipped token", "truncated",
                                    "appended", "bad magic", "huge header", "empty"])
def test_a_damaged_file_is_counted_removed_and_never_loaded(damage, hosts):
    a, b = hosts("a"), hosts("b")
    a.store([5, 6, 7, 8])
    path = only_file(a.tier)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "flipped state byte":
            f.seek(size - DIGEST - 100)
            byte = f.read(1)
            f.seek(size - DIGEST - 100)
            f.write(bytes([byte[0] ^ 1]))
        elif damage == "flipped token":
            f.seek(size - DIGEST - len(state_of([5, 6, 7, 8])) - 4)
            f.write(b"\x09\x00\x00\x00")
        elif damage == "truncated":
            f.truncate(size - 1000)
        elif damage == "appended":
            f.seek(0, os.SEEK_END)
            f.write(b"x")
        elif damage == "bad magic":
            f.write(b"X")
        elif damage == "huge header":
            f.seek(len(b"serve-shared 1\n"))
            f.write(b"\xff\xff\xff\x7f")
        else:
            f.truncate(0)
    assert b.restore([5, 6, 7, 8, 9]) is None
    assert b.tier.files.counters.damaged == 1 and b.tier.files.counters.read == 0
    assert len(b.cache) == 0 and not os.path.exists(path)


def test_a_foreign_file_is_counted_left_alone_and_never_loaded(hosts, tmp_path):
    ours, theirs = hosts("ours"), hosts("theirs", identity='{"model": "other"}')
    theirs.store([5, 6, 7, 8])
    # Their file, under the name our key for those tokens has (a copy, a collision, a mix-up).
    ours.store([5, 6, 7, 8])
    shutil.copyfile(only_file(theirs.tier), only_file(ours.tier))
    reader = hosts("reader")
    assert reader.restore([5, 6, 7, 8, 9]) is None
    assert reader.tier.files.counters.foreign == 1 and len(reader.cache) == 0
    assert os.path.exists(only_file(ours.tier))   # another model's host may be using it


def test_a_file_truncated_or_corrupted_under_a_reader_fails_its_check(tmp_path):
    files = SharedDir(str(tmp_path), 1 << 20)
    body = bytes(range(256)) * 400
    for damage in ("truncate", "overwrite"):
        assert files.publish("x", "test", {}, [body], len(body))
        reader = files.open("x")
        assert reader.read(1000) == body[:1000]
        with open(files.file("x"), "r+b") as f:   # in place: what a broken writer does
            if damage == "truncate":
                f.truncate(50_000)
            else:
                f.seek(60_000)
                f.write(b"\0" * 100)
        with pytest.raises(Rejected) as cut:
            reader.read(len(body) - 1000)
            reader.verify()
        assert cut.value.reason == "damaged"
        reader.close()


def test_a_file_evicted_or_replaced_under_a_reader_is_still_read_whole(tmp_path):
    files = SharedDir(str(tmp_path), 1 << 20)
    body = os.urandom(200_000)
    assert files.publish("x", "test", {}, [body], len(body))
    reader = files.open("x")
    head = reader.read(10)
    os.unlink(files.file("x"))                       # another host's eviction
    other = os.urandom(200_000)
    assert files.publish("x", "test", {}, [other], len(other))   # and a new publish
    assert head + reader.read(len(body) - 10) == body
    reader.verify()
    reader.close()
    again = files.open("x")
    assert again.read(len(other)) == other
    again.verify()
    again.close()


def test_eviction_keeps_the_bound_and_the_most_recently_used(hosts):
    one = len(state_of([1, 1, 1])) + 300
    a = hosts("a", capacity=3 * one)     # room for three files, not four
    b = hosts("b", capacity=3 * one)
    for n in (1, 2, 3):
        a.store([n] * 3)
        published = a.tier.longest([n] * 3 + [0], 3)[1]
        os.utime(a.tier.files.file(published), (n, n))   # used long ago, [1] first
    assert b.restore([1, 1, 1, 0]).n_tokens == 3        # used now
    b.store([4, 4, 4])                                  # one over: the least recently used goes
    assert [n for n in (1, 2, 3, 4) if b.tier.longest([n] * 3 + [0], 3)] == [1, 3, 4]
    assert b.tier.files.usage()[1] <= b.tier.capacity_bytes
    assert b.tier.files.counters.evicted == 1


CHILD = textwrap.dedent('''
    import os, random, sys, threading
    sys.path[:0] = [{root!r}, {tests!r}, {tests!r} + "/snapshots"]
    from test_shared_tier import Host, state_of
    from pathlib import Path
    me, rounds = {me}, {rounds}
    host = Host(Path({tmp!r}), "host%d" % me, {shared!r}, capacity={capacity})
    random.seed(me)
    bad = []
    def work(thread):
        rng = random.Random(me * 100 + thread)
        for r in range(rounds):
            k = rng.randrange(12)
            tokens = [k] * (5 + k)            # twelve entries, written by every host
            if rng.random() < 0.5:
                snap = host.cache.store(tokens, lambda p: open(p, "wb").write(state_of(tokens)))
                host.tier.publish(snap)
            else:
                snap = host.restore(tokens + [99])
                if snap is not None:
                    with open(snap.path, "rb") as f:
                        data = f.read()
                    if data != state_of(list(snap.tokens)):
                        bad.append(snap.tokens)
                    host.cache.drop(snap)          # so the next look goes to the shared tier
    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    c = host.tier.files.counters
    print(len(bad), c.published, c.read, c.damaged, c.foreign, c.evicted, c.publish_failed)
    host.cache.close()
''')


def test_hosts_publishing_evicting_and_reading_the_same_entries_at_once(tmp_path):
    one = len(state_of([0])) + 400
    capacity = 5 * one             # twelve entries into room for about five: constant eviction
    shared = str(tmp_path / "shared")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD.format(
        root=str(ROOT), tests=str(ROOT / "tests"), tmp=str(tmp_path), shared=shared, me=me,
        rounds=150, capacity=capacity)], stdout=subprocess.PIPE, text=True) for me in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    counts = [list(map(int, out.split())) for out in outputs]
    assert all(bad == 0 and damaged == 0 and foreign == 0 and failed == 0
               for bad, _, _, damaged, foreign, _, failed in counts), counts
    assert sum(c[2] for c in counts) > 0 and sum(c[5] for c in counts) > 0   # read, evicted
    files = SharedDir(os.path.join(shared, "snapshots", os.listdir(os.path.join(shared, "snapshots"))[0]),
                      capacity, IDENTITY)
    held, used = files.usage()
    # The bound holds, and eviction racing on three hosts did not empty the tier: what is
    # left is more than the bound minus two entries.
    assert used <= capacity and used > capacity - 2 * one, (held, used)
    assert not [n for n in os.listdir(files.path) if n.startswith(".")]   # no temporary left


@contextlib.contextmanager
def tiny_disk(path, size: str):
    """A real file system that fills up: a tmpfs of `size` (needs root, as CI runs)."""
    os.makedirs(path)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_fails_the_publish_leaves_nothing_and_keeps_what_was_published(hosts, tmp_path):
    with tiny_disk(tmp_path / "disk", "64k") as disk:
        a = Host(tmp_path, "a", str(disk / "team"))   # its bound is far above the disk's size
        try:
            first = [1] * 3
            a.store(first)
            published = a.tier.files.names()
            grown = [2] * 3000
            snap = a.cache.store(grown, saver(grown))
            for _ in range(40):   # fill the disk with files until a publish fails
                if not a.tier.publish(snap):
                    break
                grown.append(3)
                snap = a.cache.store(grown, saver(grown))
            assert a.tier.files.counters.publish_failed == 1
            assert not [n for n in os.listdir(a.tier.files.path) if n.startswith(".")]
            b = Host(tmp_path, "b", str(disk / "team"))
            assert b.restore(first + [0]).n_tokens == 3 and published[0] in b.tier.files.names()
            b.cache.close()
        finally:
            a.cache.close()


def test_the_policy_publishes_and_fetches_only_what_pays():
    policy = SnapshotPolicy()
    assert policy.worth_publishing(1) and policy.worth_fetching(1)   # nothing measured: do it
    policy.prefilled(100, 0.1)          # 1 ms a position
    policy.saved_state(1000, 0.01)
    policy.loaded_state(0.01)
    policy.published(0.05)
    policy.fetched(0.03)
    assert policy.costs.publish_break_even() == 90 and policy.costs.fetch_break_even() == 40
    assert not policy.worth_publishing(89) and policy.worth_publishing(90)
    assert not policy.worth_fetching(39) and policy.worth_fetching(40)
    assert not policy.worth_publishing(0) and not policy.worth_fetching(0)


def test_a_stored_response_is_found_by_another_host_and_deleted_for_all(tmp_path):
    shared = SharedDir(str(tmp_path / "responses"), 1 << 20)
    a, b = ResponseStore(shared=shared), ResponseStore(shared=SharedDir(shared.path, 1 << 20))
    response = {"id": "resp_abc", "output": [{"type": "reasoning", "id": "rs_1",
                                              "content": [{"type": "reasoning_text", "text": "t"}]}]}
    a.put(response, [{"role": "user", "content": "hi"}], [{"type": "message"}])
    got = b.get("resp_abc")
    assert got.response == response and got.conversation == [{"role": "user", "content": "hi"}]
    assert b.reasoning("rs_1") == "t"
    assert b.get("../etc/passwd") is None and b.get("resp_none") is None
    assert b.delete("resp_abc") and not os.listdir(shared.path)
    assert not b.delete("resp_abc")


def test_a_damaged_stored_response_is_counted_and_not_used(tmp_path):
    shared = SharedDir(str(tmp_path), 1 << 20)
    ResponseStore(shared=shared).put({"id": "resp_x", "output": []}, [], [])
    with open(shared.file("resp_x"), "r+b") as f:
        f.seek(-DIGEST - 3, os.SEEK_END)
        f.write(b"!")
    other = SharedDir(str(tmp_path), 1 << 20)
    assert ResponseStore(shared=other).get("resp_x") is None and other.counters.damaged == 1


def test_a_reply_remembered_on_one_host_is_recalled_on_another(tmp_path):
    rendered = [Segment("hello", False), Segment("<end>", True)]
    a = ReplyMemory(shared=SharedDir(str(tmp_path), 1 << 20, IDENTITY))
    b = ReplyMemory(shared=SharedDir(str(tmp_path), 1 << 20, IDENTITY))
    other_model = ReplyMemory(shared=SharedDir(str(tmp_path), 1 << 20, "other"))
    a.remember(rendered, [5, 6, 7, 8], "thought")
    got = b.recall(rendered)
    assert list(got.ids) == [5, 6, 7, 8] and got.reasoning == "thought" and len(b) == 1
    assert other_model.recall(rendered) is None and other_model.shared.counters.foreign == 1
    assert b.recall([Segment("other", False)]) is None


def test_concurrent_threads_of_one_host_share_one_tier(hosts):
    a = hosts("a")
    b = hosts("b")
    errors = []

    def publish(n):
        try:
            for k in range(30):
                a.store([n, k, 1])
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(a.tier.files.names()) == 120
    assert all(b.restore([n, k, 1, 0]).n_tokens == 3 for n in range(4) for k in range(0, 30, 7))


def test_a_teams_hosts_sign_reasoning_with_one_key(tmp_path, monkeypatch):
    monkeypatch.setattr(seal, "_KEY", seal._KEY)   # restored after the test
    path = str(tmp_path / "seal.key")
    keys = []

    def host():
        seal.use_shared_key(path)
        keys.append(seal._KEY)

    threads = [threading.Thread(target=host) for _ in range(8)]   # hosts starting at once
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(keys) == 8 and len(set(keys)) == 1 and os.listdir(tmp_path) == ["seal.key"]
    signature = seal.sign("thought")
    seal._KEY = b"\0" * 32                  # a host of another team
    assert not seal.verify("thought", signature)
    seal.use_shared_key(path)               # one of this team
    assert seal.verify("thought", signature)
    with open(path, "wb") as f:
        f.write(b"short")
    with pytest.raises(ValueError):
        seal.use_shared_key(path)


@pytest.mark.parametrize("flags, message", [
    (["--no-prefix-cache"], "--shared-cache needs the prefix cache"),
    (["--shared-cache-size", "0"], "capacity must be positive"),
    ([], "Not a directory"),
])
def test_a_shared_tier_that_cannot_be_used_stops_the_start(flags, message, lib_path, k3_container,
                                                           tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    shared = str(blocker / "team") if message == "Not a directory" else str(tmp_path / "team")
    done = run_cli(k3_container, "--port", "0", "--prefix-cache-dir", str(tmp_path / "local"),
                   "--shared-cache", shared, *flags, lib_path=lib_path)
    assert done.returncode == 1 and message in done.stderr, done.stderr


def test_a_damaged_longest_snapshot_gives_way_to_the_next_longest(hosts):
    a, b = hosts("a"), hosts("b")
    a.store([1, 2, 3])
    a.store([1, 2, 3, 4, 5])
    longest = a.tier.files.file(a.tier.longest([1, 2, 3, 4, 5, 6], 5)[1])
    with open(longest, "r+b") as f:
        f.seek(-DIGEST - 1, os.SEEK_END)
        f.write(b"?")
    assert b.restore([1, 2, 3, 4, 5, 6]).n_tokens == 3
    assert b.tier.files.counters.damaged == 1 and b.tier.files.counters.read == 1


def test_a_dead_writers_temporary_file_goes_once_stale_and_a_live_ones_stays(tmp_path):
    files = SharedDir(str(tmp_path), 1 << 20)
    dead, live = tmp_path / ".tmp-gone-1-1-aa", tmp_path / ".tmp-here-2-2-bb"
    dead.write_bytes(b"x" * 100)
    live.write_bytes(b"y" * 100)
    os.utime(dead, (1, 1))                     # untouched for far more than STALE_SECONDS
    assert files.usage() == (0, 0)             # neither is published
    assert not dead.exists() and live.exists()


def test_a_reply_or_response_no_host_wrote_is_a_plain_miss(tmp_path):
    shared = SharedDir(str(tmp_path), 1 << 20, IDENTITY)
    assert ReplyMemory(shared=shared).recall([Segment("never said", False)]) is None
    assert ResponseStore(shared=shared).get("resp_never") is None
    assert shared.counters.missing == 0 and shared.counters.read == 0


def warm_lines(server) -> list[str]:
    """The server's --warm log lines, up to its last."""
    lines = []
    while not lines or not lines[-1].startswith("warm     done"):
        line = server.proc.stdout.readline()
        assert line, "the server stopped before its warm was done"
        lines.append(line.strip())
    return lines


def test_a_second_hosts_warm_finds_the_preamble_done(lib_path, k3_container, tmp_path, monkeypatch):
    # A clock where prefill costs far more than a publish: every checkpoint is published (at
    # the reference engine's own speed, one sparing a few dozen positions is not worth it).
    monkeypatch.setenv("WASTE_DELAY_MS", "2")
    warm = tmp_path / "preamble.json"
    warm.write_text(json.dumps({"messages": [
        {"role": "system", "content": "You are careful. " + " ".join(f"r{i}" for i in range(300))},
        {"role": "user", "content": "hi"}]}))
    team = ["--shared-cache", str(tmp_path / "team"), "--warm", str(warm)]
    done = []
    for host in ("a", "b"):
        with serve(k3_container, lib_path, tmp_path, *team,
                   "--prefix-cache-dir", str(tmp_path / host)) as server:
            found = [re.search(r"(\d+) positions checkpointed \((\d+) were already cached\)", line)
                     for line in warm_lines(server)]
            done.append(next((int(m.group(1)), int(m.group(2))) for m in found if m))
    (held_a, cached_a), (held_b, cached_b) = done
    assert held_a == held_b > 300 and cached_a == 0
    assert cached_b == held_b   # all of it from the shared tier: nothing warmed twice


def test_a_server_publishes_and_a_damaged_file_reaches_metrics_not_the_engine(lib_path, k3_container,
                                                                              tmp_path, monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", "2")
    team = tmp_path / "team"
    chat = {"messages": [{"role": "user", "content": " ".join(f"q{i}" for i in range(150))}],
            "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"}
    with serve(k3_container, lib_path, tmp_path, "--shared-cache", str(team),
               "--prefix-cache-dir", str(tmp_path / "a")) as a:
        assert any(line.startswith(f"shared   {team}: snapshots") for line in a.banner), a.banner
        assert call(a.port, "POST", "/v1/chat/completions", chat).status == 200
        wait_idle(a.port)
        now = scrape(a.port)
    published = now[("serve_shared_files_total", (("event", "published"), ("what", "snapshots")))]
    # (a progress snapshot a later one superseded is unpublished again)
    assert 1 <= now[("serve_shared_files", (("what", "snapshots"),))] <= published
    assert now[("serve_snapshot_publish_seconds", ())] > 0
    assert now[("serve_shared_files_total", (("event", "published"), ("what", "replies")))] == 1
    files = list((team / "snapshots").glob("*/*.snap"))
    for path in files:   # every published state damaged in its middle
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xde\xad")
    with serve(k3_container, lib_path, tmp_path, "--shared-cache", str(team),
               "--prefix-cache-dir", str(tmp_path / "b")) as b:
        reply = call(b.port, "POST", "/v1/chat/completions", chat)
        assert reply.status == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        now = scrape(b.port)
    damaged = now[("serve_shared_files_total", (("event", "damaged"), ("what", "snapshots")))]
    assert damaged >= 1
    assert now[("serve_shared_files_total", (("event", "read"), ("what", "snapshots")))] == 0
    # Each file B found damaged was removed (and may be replaced by B's own whole one); the rest
    # wait, damaged, for the next host that tries them.
    still_damaged = [p for p in (team / "snapshots").glob("*/*.snap") if not whole(p)]
    assert len(still_damaged) <= len(files) - damaged


def whole(path) -> bool:
    """Does a shared file pass every check a host makes?"""
    with open(path, "rb") as f:
        f.seek(len(b"serve-shared 1\n"))
        header = json.loads(f.read(int.from_bytes(f.read(4), "little")))
    return SharedDir(str(path.parent), 1 << 30, header["identity"]).read_whole(path.name) is not None


def test_a_file_larger_than_the_whole_tier_is_not_published(tmp_path):
    files = SharedDir(str(tmp_path), 1000)
    assert files.publish("small", "test", {}, [b"x" * 100], 100)
    assert not files.publish("big", "test", {}, [b"x" * 1000], 1000)
    assert files.names() == ["small"] and files.counters.evicted == 0
