"""A key per person on three hosts sharing a snapshot tier, behind the router: what one
person's requests leave, on any host or in the shared tier, answers only them; the router
keeps each person's conversations apart. Skipped only without HAProxy."""
from __future__ import annotations

import re

from scripted import wait_idle
from team import DIALECTS, bearer, cached, keys_file, secret
from test_cluster import needs_router, send, start  # noqa: F401 - start is a fixture
from test_shared_cluster import CLOCK, published


def snapshot_names(cluster) -> set[str]:
    return {p.name for p in (cluster.dir / "shared" / "snapshots").glob("*/*.snap")}


@needs_router
def test_another_keys_right_guess_restores_nothing_on_any_host(start, k3_container, tmp_path):
    keys = keys_file(tmp_path / "keys", "alice", "bob", "carol", "dave")
    cluster = start(k3_container, k3_container, k3_container,
                    env={**CLOCK, "SERVE_ASK_KEY": keys["alice"]},
                    serve_args=f"--api-keys {tmp_path / 'keys'}")
    hosts = [cluster.hosts[name][0] for name in ("h1", "h2", "h3")]
    for dialect in DIALECTS:
        pre = secret(dialect.name)
        before = snapshot_names(cluster)
        # alice on h1: what it saves is published for the team.
        assert cached(hosts[0], dialect, keys["alice"], pre) == 0
        wait_idle(hosts[0])
        alices = snapshot_names(cluster) - before
        assert alices, f"{dialect.name}: nothing published"
        # A colleague's right guess, a first one on each host: nothing restored, local or
        # shared (a colleague's second would restore their own first's).
        for guesser, port in zip(("bob", "carol", "dave"), hosts):
            assert cached(port, dialect, keys[guesser], pre) == 0, (dialect.name, guesser)
            wait_idle(port)
        theirs = snapshot_names(cluster) - before - alices
        # alice's retry on another host restores what h1 published.
        assert cached(hosts[1], dialect, keys["alice"], pre) > 0, dialect.name
        # Two salts under one key are apart across hosts too.
        assert cached(hosts[0], dialect, keys["alice"], pre, cache_salt="one") == 0
        wait_idle(hosts[0])
        assert cached(hosts[2], dialect, keys["alice"], pre, cache_salt="one") > 0
        assert cached(hosts[2], dialect, keys["alice"], pre, cache_salt="two") == 0
        # The shared tier's listing shows no prefix alice and a colleague both hold: the
        # same tokens are hashed from each one's own seed, anchors and keys alike.
        assert theirs
        anchors = lambda names: {name.split("-")[0] for name in names}   # noqa: E731
        assert not anchors(alices) & anchors(theirs)
    assert published(cluster)


@needs_router
def test_the_router_keeps_each_persons_conversation_apart(start, k3_container, tmp_path):
    keys = keys_file(tmp_path / "keys", "alice", "bob")
    cluster = start(k3_container, k3_container, k3_container,
                    env={"SERVE_ASK_KEY": keys["bob"]}, serve_args=f"--api-keys {tmp_path / 'keys'}")
    body = {"model": "k3", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}],
            "reasoning_effort": "none"}
    session = {"x-claude-code-session-id": "the-same-session"}
    homes = {}
    for who in ("alice", "bob"):
        reply = send(cluster.port, "/v1/chat/completions", body, {**session, **bearer(keys[who])})
        assert reply.status == 200, reply.body[-300:]
        homes[who] = cluster.host_of(reply.headers)
        for _ in range(2):   # later turns stay on the person's own host
            again = send(cluster.port, "/v1/chat/completions", body,
                         {**session, **bearer(keys[who])})
            assert cluster.host_of(again.headers) == homes[who]
    refused = send(cluster.port, "/v1/chat/completions", body, {**session, **bearer("wrong")})
    assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    # The same session id is two conversations (a hash of each key before it), and the
    # router's log holds no key.
    log = cluster.router_log()
    conversations = set(re.findall(r" 200 conv=([0-9A-F]{16}-the-same-session)", log))
    assert len(conversations) == 2, log[-2000:]
    assert all(key not in log for key in keys.values())
