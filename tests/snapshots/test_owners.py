"""What the server remembers answers only the key that made it, through real sockets on the
real engine: prefix snapshots in every dialect (the issue's probe: a secret system prompt
another key guesses right), cache_salt within one key, stored responses, reply memory and
reasoning signatures."""
from __future__ import annotations

import json

import pytest

from scripted import ScriptedEngine, call, real_service, scripted_service, serving, xtml_answer
from served import cli_server, run_cli
from serve.http.auth import Keys
from serve.http.keyring import KeyRing
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory
from team import DIALECTS, ask, bearer, cached, keys_file, secret
from test_prefix_persist import warm_lines


@pytest.fixture(scope="module")
def team(lib_path, k3_container, tmp_path_factory):
    """One host, a prefix cache and reply memory, and the keys of alice and bob."""
    tmp = tmp_path_factory.mktemp("owners")
    keys = keys_file(tmp / "keys", "alice", "bob")
    cache = PrefixCache(256 << 20, parent_dir=str(tmp / "prefix"))
    try:
        with real_service(lib_path, k3_container, prefix_cache=cache, reply_memory=ReplyMemory(),
                          keep_reasoning=True) as service, \
                serving(service, keys=Keys(ring=KeyRing(str(tmp / "keys")))) as srv:
            yield srv, keys
    finally:
        cache.close()


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_another_keys_right_guess_restores_nothing(team, dialect):
    srv, keys = team
    pre = secret(dialect.name)
    first = ask(srv.port, dialect, keys["alice"], pre)
    assert first.status == 200, first.body
    # bob sends exactly what alice sent: the right guess, every token of it.
    assert cached(srv.port, dialect, keys["bob"], pre) == 0
    # alice's retry restores what her first request left.
    assert cached(srv.port, dialect, keys["alice"], pre) > 0
    # bob's own retry is his to reuse, as alice's is hers.
    assert cached(srv.port, dialect, keys["bob"], pre) > 0


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_two_salts_under_one_key_are_apart(team, dialect):
    srv, keys = team
    pre = secret(dialect.name, "salted")
    alice = keys["alice"]
    assert cached(srv.port, dialect, alice, pre, cache_salt="one") == 0
    assert cached(srv.port, dialect, alice, pre, cache_salt="two") == 0
    assert cached(srv.port, dialect, alice, pre) == 0                 # unsalted: apart too
    assert cached(srv.port, dialect, alice, pre, cache_salt="one") > 0
    assert cached(srv.port, dialect, keys["bob"], pre, cache_salt="one") == 0   # not bob's


@pytest.mark.parametrize("salt", ["", 7, ["x"]])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400(team, salt):
    srv, keys = team
    for dialect in DIALECTS:
        resp = ask(srv.port, dialect, keys["alice"], "hi", cache_salt=salt)
        assert resp.status == 400, (dialect.name, resp.body)
        assert "cache_salt" in resp.body.decode()


def _same_length_missing(response_id: str) -> str:
    """An id of the same shape and length that was never made."""
    return response_id[:-4] + ("zzzz" if not response_id.endswith("zzzz") else "yyyy")


def test_another_keys_stored_response_is_answered_as_one_that_does_not_exist(team):
    srv, keys = team
    made = call(srv.port, "POST", "/v1/responses", {"input": "hello", "max_output_tokens": 2},
                headers=bearer(keys["alice"]), timeout=120)
    assert made.status == 200, made.body
    rid = made.json()["id"]
    missing = _same_length_missing(rid)
    for path, method in (("/v1/responses/{}", "GET"), ("/v1/responses/{}/input_items", "GET"),
                         ("/v1/responses/{}", "DELETE"), ("/v1/responses/{}/cancel", "POST")):
        theirs = call(srv.port, method, path.format(rid), headers=bearer(keys["bob"]))
        nobodys = call(srv.port, method, path.format(missing), headers=bearer(keys["bob"]))
        assert theirs.status == nobodys.status == 404, (path, theirs.body)
        assert theirs.body == nobodys.body.replace(missing.encode(), rid.encode())
        assert set(theirs.headers) == set(nobodys.headers)
    # As previous_response_id too: the same 400 as for an id never made.
    follow = {"input": "and then?", "max_output_tokens": 2}
    theirs = call(srv.port, "POST", "/v1/responses", {**follow, "previous_response_id": rid},
                  headers=bearer(keys["bob"]))
    nobodys = call(srv.port, "POST", "/v1/responses", {**follow, "previous_response_id": missing},
                   headers=bearer(keys["bob"]))
    assert theirs.status == nobodys.status == 400
    assert theirs.body == nobodys.body.replace(missing.encode(), rid.encode())
    # bob's DELETE above took nothing of alice's.
    mine = call(srv.port, "GET", f"/v1/responses/{rid}", headers=bearer(keys["alice"]))
    assert mine.status == 200 and mine.json()["id"] == rid
    chained = call(srv.port, "POST", "/v1/responses", {**follow, "previous_response_id": rid},
                   headers=bearer(keys["alice"]), timeout=120)
    assert chained.status == 200, chained.body


def test_remembered_reasoning_is_given_back_to_its_owner_only(tmp_path):
    # A scripted reply: what the reply's reasoning is, word for word, is the point here.
    keys = keys_file(tmp_path / "keys", "alice", "bob")
    engine = ScriptedEngine([xtml_answer("Spring tides.", thinking=["The moon ", "pulls."]),
                             xtml_answer("ok"), xtml_answer("ok")])
    service = scripted_service(engine, reply_memory=ReplyMemory(), keep_reasoning=True)
    question = {"role": "user", "content": "What do the tides owe the moon?"}
    with serving(service, keys=Keys(ring=KeyRing(str(tmp_path / "keys")))) as srv:
        first = call(srv.port, "POST", "/v1/chat/completions", {"messages": [question]},
                     headers=bearer(keys["alice"])).json()["choices"][0]["message"]
        assert first["reasoning_content"] == "The moon pulls."
        # The reply as most clients send it back: without its reasoning.
        turn_two = {"messages": [question, {"role": "assistant", "content": first["content"]},
                                 {"role": "user", "content": "Why?"}]}
        for who in ("alice", "bob"):
            resp = call(srv.port, "POST", "/v1/chat/completions", turn_two,
                        headers=bearer(keys[who]))
            assert resp.status == 200, resp.body
    hers, his = (engine.detokenize(prompt) for prompt in engine.prompts[1:])
    # --keep-reasoning puts alice's remembered reasoning back into her prompt; bob, sending
    # her reply back word for word, gets none of it.
    assert b"The moon pulls." in hers and b"The moon pulls." not in his


def test_a_thinking_signature_verifies_for_its_owner_only(team):
    srv, keys = team
    question = [{"role": "user", "content": "What do the tides owe the moon?"}]
    made = call(srv.port, "POST", "/v1/messages",
                {"model": "m", "max_tokens": 24, "temperature": 0, "messages": question,
                 "thinking": {"type": "enabled", "budget_tokens": 1024}},
                headers={"x-api-key": keys["alice"]}, timeout=120).json()
    thinking = [b for b in made["content"] if b["type"] == "thinking"]
    assert thinking and thinking[0]["thinking"] and thinking[0]["signature"]
    history = [*question, {"role": "assistant", "content": made["content"]},
               {"role": "user", "content": "Why?"}]

    def count(key: str) -> int:
        resp = call(srv.port, "POST", "/v1/messages/count_tokens",
                    {"model": "m", "messages": history,
                     "thinking": {"type": "enabled", "budget_tokens": 1024}},
                    headers={"x-api-key": key})
        assert resp.status == 200, resp.body
        return resp.json()["input_tokens"]
    # alice's signature lets her thinking back into the prompt; under bob's key it does not
    # verify, and the thinking is left out.
    assert count(keys["alice"]) > count(keys["bob"])


# ---- sharing, opt-in -----------------------------------------------------------------------

def test_a_shared_namespace_holds_the_warmed_preamble_for_every_key(lib_path, k3_container,
                                                                     tmp_path):
    keys = keys_file(tmp_path / "keys", "alice", "bob")
    team_preamble = secret("team", "the tools everyone declares")
    saved = tmp_path / "warm.json"
    saved.write_text(json.dumps({"messages": [{"role": "system", "content": team_preamble},
                                              {"role": "user", "content": "Ready?"}],
                                 "reasoning_effort": "none"}))
    chat = DIALECTS[0]
    with cli_server(str(k3_container), "--lib", str(lib_path), "--usage", str(tmp_path / "u"),
                    "--prefix-cache-dir", str(tmp_path / "cache"), "--warm", str(saved),
                    "--api-keys", str(tmp_path / "keys"), "--shared-namespace", "team"
                    ) as (proc, port, banner):
        assert any("namespace 'team' shared by all" in line for line in banner)
        assert "1 of 1 warmed" in warm_lines(proc)[-1]
        # Both restore the team's preamble (the first request of each: nothing of theirs yet).
        for who in ("alice", "bob"):
            assert cached(port, chat, keys[who], team_preamble, question="Go.") > 0
        # What either sends beyond it stays theirs.
        mine = secret("chat", "alice's own")
        assert cached(port, chat, keys["alice"], mine) == 0
        assert cached(port, chat, keys["bob"], mine) == 0


def test_warming_for_named_keys_needs_a_shared_namespace(lib_path, k3_container, tmp_path):
    keys_file(tmp_path / "keys", "alice")
    saved = tmp_path / "warm.json"
    saved.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    refused = run_cli(str(k3_container), "--warm", str(saved), "--api-keys", str(tmp_path / "keys"),
                      lib_path=lib_path)
    assert refused.returncode == 1 and "--shared-namespace" in refused.stderr
