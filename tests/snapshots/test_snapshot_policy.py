"""Snapshots placed by measured cost: the rule, its measurements, and what it gives with default flags.

The rule is checked on given costs; the measurements on the reference engine
at a scaled K3 clock (WASTE_DELAY_MS), where a position costs far more than a
save, as on K3; and a six-turn short chat with default flags, at the
reference engine's own speed and at the scaled clock, reuses on every turn.
"""
from __future__ import annotations

import pytest

from scripted import SlowEnginePolicy, call, scrape, wait_idle
from cache_calls import lookup
from served import serve
from serve.engine.binding import Engine, EngineConfig, load_library
from serve.service.prefill import prefill
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import PROGRESS_FACTOR, Costs, SnapshotPolicy
from test_abandoned_prefill import SENTENCE


def measured(token: float, save: float, load: float) -> SnapshotPolicy:
    policy = SnapshotPolicy()
    policy.prefilled(100, 100 * token)
    policy.saved_state(1_000_000, save)
    policy.loaded_state(load)
    return policy


def test_a_checkpoint_pays_when_it_spares_more_than_a_save_and_a_load():
    policy = measured(token=0.001, save=0.005, load=0.002)   # 7 positions cost a save and a load
    assert policy.costs.break_even() == 7
    assert not policy.worth("checkpoint", 6) and policy.worth("checkpoint", 8)
    assert not policy.worth("reply", 6) and policy.worth("stopped", 8)
    # A checkpoint with no snapshot before it is what lets the next turn reuse anything.
    assert policy.worth("checkpoint", 1, first=True) and not policy.worth("reply", 1, first=True)


def test_a_progress_snapshot_waits_for_ten_saves_worth_of_prefill():
    policy = measured(token=0.001, save=0.005, load=0.002)
    assert policy.costs.spacing() == PROGRESS_FACTOR * 5 == 50
    assert not policy.worth("progress", 49) and policy.worth("progress", 51)
    # At K3's costs (two seconds a position, a fraction of one a save) everything pays.
    k3 = measured(token=2.0, save=0.3, load=0.3)
    assert k3.costs.spacing() == 2 and k3.worth("checkpoint", 1) and k3.worth("progress", 2)


def test_nothing_measured_yet_means_save_and_measure():
    assert SnapshotPolicy().worth("progress", 1) and SnapshotPolicy().worth("reply", 1)
    assert not SnapshotPolicy().worth("checkpoint", 0)


def test_costs_are_moving_averages_of_what_was_measured():
    policy = SnapshotPolicy()
    policy.prefilled(10, 1.0)
    policy.prefilled(10, 2.0)
    assert policy.costs.token_seconds == pytest.approx(0.1 + 0.3 * 0.1)
    assert Costs().spacing() is None and Costs().break_even() is None


def test_the_overrides_are_the_old_fixed_rules():
    fixed = SnapshotPolicy(min_tokens=512, spacing=4096)
    assert fixed.worth("progress", 1)              # placed at the multiples by the prefill
    assert not fixed.snapshots_at_all(restored=0, upto=511)
    assert fixed.snapshots_at_all(restored=1, upto=100) and fixed.snapshots_at_all(0, 512)
    assert "--prefix-cache-spacing" in fixed.describe() and "--prefix-cache-min" in fixed.describe()
    assert "measured" in SnapshotPolicy().describe()
    with pytest.raises(ValueError):
        SnapshotPolicy(spacing=0)


def test_a_prefill_keeps_only_its_latest_progress_snapshot(k3_engine, tmp_path):
    cache = PrefixCache(64 << 20, str(tmp_path))
    tokens = k3_engine.tokenize(SENTENCE * 25, add_bos=True)
    assert len(tokens) > 700
    k3_engine.reset()
    done = prefill(k3_engine, tokens, 700, cache=cache, snapshot_at=[150], chunk=64,
                   policy=SlowEnginePolicy())
    # The checkpoint, and the progress snapshot at the last chunk boundary (150 + 8 * 64): the
    # ones at the boundaries before it were dropped as each later one held all they did.
    assert done.saved == 662 and len(cache) == 2
    assert [lookup(cache, tokens[:n + 1]).n_tokens for n in (150, 500, 662)] == [150, 150, 662]
    k3_engine.reset()
    cache.close()


def test_measured_at_a_scaled_k3_clock_every_chunk_is_insured(monkeypatch, lib_path, k3_container,
                                                                 tmp_path):
    monkeypatch.setenv("WASTE_DELAY_MS", "20")   # a 32-position chunk: 0.64 s, far above a save
    cache = PrefixCache(64 << 20, str(tmp_path))
    policy = SnapshotPolicy()
    with Engine(load_library(str(lib_path)), k3_container, EngineConfig()) as engine:
        tokens = engine.tokenize(SENTENCE * 8, add_bos=True)
        prefill(engine, tokens, len(tokens) - 1, cache=cache, snapshot_at=[100], chunk=32,
                policy=policy)
    costs = policy.costs
    assert costs.token_seconds >= 0.020 and costs.save_seconds > 0 and costs.snapshot_bytes > 0
    boundaries = (len(tokens) - 2) // 32            # chunk ends strictly inside the prompt
    assert policy.saved["checkpoint"] == 1 and policy.saved["progress"] >= boundaries - 1
    assert costs.spacing() < 32 and costs.break_even() < 32
    cache.close()


def short_chat(port: int, turns: int = 6) -> list[dict]:
    messages, usages = [], []
    for n in range(turns):
        messages.append({"role": "user", "content": f"Turn {n}: why is the sea salty?"})
        resp = call(port, "POST", "/v1/chat/completions",
                    {"messages": messages, "max_tokens": 8, "temperature": 0,
                     "reasoning_effort": "none"}, timeout=120)
        assert resp.status == 200, resp.body
        body = resp.json()
        usages.append(body["usage"])
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return usages


@pytest.mark.parametrize("clock", [None, "20"], ids=["reference-speed", "scaled-k3-clock"])
def test_a_six_turn_short_chat_reuses_on_every_turn_with_default_flags(clock, monkeypatch, lib_path,
                                                                       k3_container, tmp_path):
    if clock:
        monkeypatch.setenv("WASTE_DELAY_MS", clock)
    with serve(k3_container, lib_path, tmp_path) as server:
        assert any(line.startswith("snapshot by measured cost") for line in server.banner)
        usages = short_chat(server.port)
        now = scrape(server.port)
    assert all(u["prompt_tokens"] < 512 for u in usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    if clock:
        # Where a position costs far more than a save, each turn restores at least the whole
        # previous prompt (and, settled in idle time, the reply).
        assert all(c >= before["prompt_tokens"] for c, before in zip(cached[1:], usages)), cached
    assert now[("serve_snapshot_save_seconds", ())] > 0
    assert now[("serve_prefill_seconds_per_token", ())] > 0
    assert now[("serve_snapshots_total", (("kind", "checkpoint"),))] >= 1


def test_the_banner_names_the_overrides(lib_path, k3_container, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--prefix-cache-min", "512",
               "--prefix-cache-spacing", "4096") as server:
        (line,) = [b for b in server.banner if b.startswith("snapshot")]
    assert "every 4,096 positions (--prefix-cache-spacing)" in line
    assert "under 512 positions that restored nothing (--prefix-cache-min)" in line


def test_a_reply_cut_by_the_room_left_saves_nothing_for_a_next_turn(monkeypatch, lib_path,
                                                                     k3_container, tmp_path):
    """max_tokens lowered to the room left in the context, and all of it used: no next turn
    fits, so the state after the reply is not worth a snapshot, however slow the clock."""
    monkeypatch.setenv("WASTE_DELAY_MS", "5")   # a position costs far more than a save
    body = {"messages": [{"role": "user", "content": SENTENCE * 2}], "temperature": 0,
            "reasoning_effort": "none"}
    with serve(k3_container, lib_path, tmp_path, "--ctx", "160") as server:
        roomy = call(server.port, "POST", "/v1/chat/completions", {**body, "max_tokens": 4},
                     timeout=120).json()
        wait_idle(server.port)
        before = scrape(server.port)
        full = call(server.port, "POST", "/v1/chat/completions", {**body, "max_tokens": 1000},
                    timeout=120).json()
        wait_idle(server.port)
        after = scrape(server.port)
    reply = ("serve_snapshots_total", (("kind", "reply"),))
    # The same prompt with room to spare does save the state after its reply.
    assert roomy["waste"]["context_full"] is False and before[reply] >= 1
    assert full["choices"][0]["finish_reason"] == "length" and full["waste"]["context_full"] is True
    assert full["usage"]["prompt_tokens"] + full["usage"]["completion_tokens"] == 160
    assert after[reply] == before[reply]
