"""`POST /v1/quote` and count_tokens' quote: what a request would cost before its first
token, from serve's own tokenizer and the snapshot lookup, without the engine."""
from __future__ import annotations

import pytest

from scripted import call, real_service, serving, wait_idle
from served import serve
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

USER = [{"role": "user", "content": "Weather in Paris?"}]
BODIES = {"chat": {"model": "m", "messages": USER, "max_tokens": 4},
          "messages": {"model": "m", "messages": USER, "max_tokens": 4},
          "responses": {"model": "m", "input": USER, "max_output_tokens": 4}}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def real(lib_path, k3_container, tmp_path_factory):
    """Thinking off, a prefix cache, and the reply memory that lets a second turn restore
    all of the first (its reply as generated, not as re-tokenized)."""
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path_factory.mktemp("cache")))
    try:
        with real_service(lib_path, k3_container, thinking=False, prefix_cache=cache,
                          reply_memory=ReplyMemory()) as service, serving(service) as srv:
            yield service, srv
    finally:
        cache.close()


def quote(port: int, dialect: str, body: dict) -> dict:
    resp = call(port, "POST", f"/v1/quote?dialect={dialect}", body)
    assert resp.status == 200, resp.body
    return resp.json()


def prompt_positions(usage: dict) -> int:
    """The prompt's positions, by a reply's usage in any of the three dialects."""
    if "prompt_tokens" in usage:
        return usage["prompt_tokens"]
    if "input_tokens_details" in usage:
        return usage["input_tokens"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


@pytest.mark.parametrize("dialect", list(BODIES))
def test_a_quote_names_the_positions_its_request_then_takes(real, dialect):
    _, srv = real
    body = {**BODIES[dialect], "messages" if dialect != "responses" else "input":
            [{"role": "user", "content": f"A quote in {dialect}, please."}]}
    quoted = quote(srv.port, dialect, body)
    assert quoted["object"] == "quote" and quoted["restorable"] == 0
    assert quoted["to_prefill"] == quoted["positions"] > 0
    assert quoted["restorable_local"] == quoted["restorable_shared"] == 0
    resp = call(srv.port, "POST", PATHS[dialect], body)
    assert resp.status == 200, resp.body
    assert prompt_positions(resp.json()["usage"]) == quoted["positions"]


def test_the_second_turn_is_quoted_restorable_and_then_restored(real):
    service, srv = real
    first = call(srv.port, "POST", "/v1/chat/completions",
                 {"model": "m", "messages": USER, "max_tokens": 6, "temperature": 0}).json()
    service.settle()   # the first turn's state is stored in idle time
    second = {"model": "m", "max_tokens": 2, "messages": [
        *USER, first["choices"][0]["message"], {"role": "user", "content": "And in Rome?"}]}
    quoted = quote(srv.port, "chat", second)
    assert quoted["restorable"] == quoted["restorable_local"] >= first["usage"]["prompt_tokens"]
    assert quoted["to_prefill"] == quoted["positions"] - quoted["restorable"]
    rate = service.policy.costs.token_seconds
    load = service.policy.costs.load_seconds
    assert quoted["first_token_seconds"] == pytest.approx(quoted["to_prefill"] * rate + load,
                                                          abs=1e-3)
    done = call(srv.port, "POST", "/v1/chat/completions", second).json()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == quoted["restorable"]
    assert done["usage"]["prompt_tokens"] == quoted["positions"]


def test_count_tokens_carries_the_quote(real):
    _, srv = real
    resp = call(srv.port, "POST", "/v1/messages/count_tokens", {"model": "m", "messages": USER})
    assert resp.status == 200
    counted = resp.json()
    assert counted["waste"]["positions"] == counted["input_tokens"] > 0
    assert counted["waste"]["to_prefill"] == counted["input_tokens"] - counted["waste"]["restorable"]


@pytest.mark.parametrize("target, body, param", [
    ("/v1/quote?dialect=gemini", BODIES["chat"], "dialect"),
    ("/v1/quote", {"model": "m", "messages": []}, "messages"),
    ("/v1/quote?dialect=responses", {"model": "m", "input": USER, "reasoning": 5}, "reasoning"),
    ("/v1/quote?dialect=messages", {"model": "m", "messages": USER}, "max_tokens"),
])
def test_a_quote_of_a_body_that_would_be_refused_is_refused_alike(real, target, body, param):
    _, srv = real
    resp = call(srv.port, "POST", target, body)
    assert resp.status == 400 and param in resp.body.decode(), resp.body


def test_a_second_turn_on_another_host_is_quoted_restorable_from_the_shared_tier(
        lib_path, k3_container, tmp_path, monkeypatch):
    """Host A answers the first turn and publishes its state to the team's tier; host B, with
    nothing local, quotes the second turn as restorable from the shared tier, then restores
    that much (its cached_tokens)."""
    monkeypatch.setenv("WASTE_DELAY_MS", "2")   # a prefill dear enough for a publish to pay
    team = ["--shared-cache", str(tmp_path / "team")]
    ask = [{"role": "user", "content": " ".join(f"q{i}" for i in range(150))}]
    chat = {"model": "m", "messages": ask, "max_tokens": 4, "temperature": 0,
            "reasoning_effort": "none"}
    with serve(k3_container, lib_path, tmp_path, *team, "--prefix-cache-dir",
               str(tmp_path / "a")) as a:
        first = call(a.port, "POST", "/v1/chat/completions", chat).json()
        wait_idle(a.port)   # published in idle time
    second = {**chat, "messages": [*ask, first["choices"][0]["message"],
                                   {"role": "user", "content": "And then?"}]}
    with serve(k3_container, lib_path, tmp_path, *team, "--prefix-cache-dir",
               str(tmp_path / "b")) as b:
        quoted = quote(b.port, "chat", second)
        assert quoted["restorable_local"] == 0
        assert quoted["restorable"] == quoted["restorable_shared"] >= first["usage"]["prompt_tokens"]
        done = call(b.port, "POST", "/v1/chat/completions", second).json()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == quoted["restorable"]
    assert done["usage"]["prompt_tokens"] == quoted["positions"]
