"""A key per person (--api-keys): the file, the keygen command, each dialect's 401, /metrics,
the log line, SIGHUP, and no key material anywhere the server writes or answers."""
from __future__ import annotations

import base64
import hashlib
import signal
import threading
import time
from pathlib import Path

import pytest

from scripted import call, scripted_service, serving, wait_idle
from served import run_cli, serve
from serve.app.keygen import PREFIX
from serve.http.auth import Keys
from serve.http.keyring import KeyFileError, KeyRing, line_for, parse
from team import DIALECTS, bearer, keys_file, secret

CHAT = "/v1/chat/completions"
OPENAI_401 = {"error": {"message": "missing or wrong API key (send Authorization: Bearer <key>)",
                        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
ANTHROPIC_401 = {"type": "error", "error": {
    "type": "authentication_error",
    "message": "missing or wrong API key (send Authorization: Bearer <key>)"}}


# ---- the file and the command ------------------------------------------------------------

def test_the_file_takes_names_and_hashes_and_skips_blanks_and_comments():
    text = f"# team\n\n  {line_for('alice', 'k1')}\n\t\n{line_for('bob.s@x', 'k2')}  # ignored?\n"
    with pytest.raises(KeyFileError, match="line 5"):
        parse(text, "keys")   # a comment after the hash is not a line's
    entries = parse(text.replace("  # ignored?", ""), "keys")
    assert [name for name, _ in entries] == ["alice", "bob.s@x"]
    assert entries[0][1] == hashlib.sha256(b"k1").digest()


@pytest.mark.parametrize("line, why", [
    ("alice sha256:abc", "NAME sha256:HEX"),
    ("alice deadbeef" + "0" * 56, "NAME sha256:HEX"),
    ("al ice sha256:" + "0" * 64, "NAME sha256:HEX"),
    ("sk-serve-plaintext-key", "NAME sha256:HEX"),
])
def test_a_line_that_is_not_a_name_and_a_hash_is_refused_without_echoing_it(line, why):
    with pytest.raises(KeyFileError) as refused:
        parse(line, "keys")
    assert why in str(refused.value) and line not in str(refused.value)


def test_a_name_or_a_key_twice_is_refused():
    with pytest.raises(KeyFileError, match="name appears"):
        parse(f"{line_for('a', 'k1')}\n{line_for('a', 'k2')}", "keys")
    with pytest.raises(KeyFileError, match="same key"):
        parse(f"{line_for('a', 'k1')}\n{line_for('b', 'k1')}", "keys")


def test_keygen_prints_the_line_and_the_key_apart(tmp_path):
    made = run_cli("keygen", "alice")
    assert made.returncode == 0, made.stderr
    line = made.stdout.strip()
    key = made.stderr.rsplit(" ", 1)[1].strip()
    assert key.startswith(PREFIX) and len(key) > 40 and key not in made.stdout
    assert line == line_for("alice", key)
    (tmp_path / "keys").write_text(line + "\n")
    assert KeyRing(str(tmp_path / "keys")).name_of(key) == "alice"
    assert run_cli("keygen", "alice").stdout != made.stdout   # a new key each time
    for bad in ((), ("two", "names"), ("not a name",)):
        refused = run_cli("keygen", *bad)
        assert refused.returncode == 2 and "usage" in refused.stderr


# ---- answers -----------------------------------------------------------------------------

@pytest.fixture
def people(tmp_path):
    keys = keys_file(tmp_path / "keys", "alice", "bob")
    return keys, Keys(key="unnamed-key", ring=KeyRing(str(tmp_path / "keys")))


def test_each_dialect_answers_a_wrong_key_as_its_clients_expect(people):
    keys, ring = people
    with serving(scripted_service(), keys=ring) as srv:
        for dialect in DIALECTS:
            for headers in ({}, dialect.headers("wrong"), dialect.headers(keys["alice"] + "x"),
                            {"Authorization": f"Basic {keys['alice']}"}):
                resp = call(srv.port, "POST", dialect.path, dialect.body("hi", "q"),
                            headers=headers)
                expected = ANTHROPIC_401 if dialect.name == "messages" else OPENAI_401
                assert (resp.status, resp.json()) == (401, expected), (dialect.name, headers)
        # The key before the 404, so that endpoints cannot be enumerated.
        assert call(srv.port, "GET", "/v1/nothing").status == 401
        assert call(srv.port, "GET", "/v1/nothing", headers=bearer(keys["bob"])).status == 404


def test_every_person_and_the_unnamed_key_are_let_in_as_their_clients_send_keys(people):
    keys, ring = people
    with serving(scripted_service(), keys=ring) as srv:
        for key in (keys["alice"], keys["bob"], "unnamed-key"):
            for headers in (bearer(key), {"Authorization": f"bEaReR {key}"}, {"x-api-key": key}):
                assert call(srv.port, "GET", "/v1/models", headers=headers).status == 200


def test_health_stays_open_and_metrics_needs_a_key_unless_opened(people):
    keys, ring = people
    with serving(scripted_service(), keys=ring) as srv:
        assert call(srv.port, "GET", "/health").status == 200
        assert call(srv.port, "GET", "/").status == 200   # the page, which then asks for a key
        assert (call(srv.port, "GET", "/metrics").json()) == OPENAI_401
        assert call(srv.port, "GET", "/metrics", headers=bearer(keys["bob"])).status == 200
    with serving(scripted_service(), keys=ring, metrics_open=True) as srv:
        assert call(srv.port, "GET", "/metrics").status == 200
        assert call(srv.port, "GET", "/v1/models").status == 401   # only /metrics opened


def test_with_no_key_nothing_is_asked():
    with serving(scripted_service()) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200 and call(srv.port, "GET", "/metrics").status == 200


# ---- a server of the team ------------------------------------------------------------------

def key_forms(key: str) -> list[bytes]:
    """The key as bytes, hex and base64 (both alphabets, padded or not)."""
    raw = key.encode()
    forms = [raw, raw.hex().encode(), base64.b64encode(raw), base64.urlsafe_b64encode(raw)]
    return forms + [f.rstrip(b"=") for f in forms[2:]]


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def test_a_team_server_reads_its_keys_again_on_sighup_and_never_writes_a_key(
        lib_path, k3_container, tmp_path, monkeypatch):
    keys_path = tmp_path / "keys"
    keys = keys_file(keys_path, "alice", "bob")
    monkeypatch.setenv("WASTE_DELAY_MS", "4")   # the running request is still running at SIGHUP
    with serve(k3_container, lib_path, tmp_path, "--api-keys", str(keys_path),
               "--shared-cache", str(tmp_path / "shared")) as srv:
        assert any(line.startswith("keys     2 people") for line in srv.banner)
        long = {"messages": [{"role": "system", "content": secret("chat")},
                             {"role": "user", "content": "hi"}], "max_tokens": 4,
                "reasoning_effort": "none"}
        running: dict = {}
        thread = threading.Thread(target=lambda: running.update(
            resp=call(srv.port, "POST", CHAT, long, headers=bearer(keys["bob"]), timeout=300)))
        thread.start()
        deadline = time.monotonic() + 60
        while not call(srv.port, "GET", "/health").json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # bob leaves the team and carol joins, while bob's request runs.
        carol = keys_file(tmp_path / "next", "alice", "carol")
        keys_path.write_text((tmp_path / "next").read_text().replace(
            line_for("alice", carol["alice"]), line_for("alice", keys["alice"])))
        assert "resp" not in running   # still running when the file is read again
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "people read again" not in srv.log():
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        thread.join(300)
        assert running["resp"].status == 200, running["resp"].body   # not dropped
        assert call(srv.port, "GET", "/v1/models", headers=bearer(keys["bob"])).status == 401
        assert call(srv.port, "GET", "/v1/models", headers=bearer("wrong")).status == 401
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for key in (keys["alice"], carol["carol"]):
            assert call(srv.port, "POST", CHAT, short, headers=bearer(key), timeout=120).status == 200
        # A file that no longer parses keeps the keys read before.
        keys_path.write_text("carol sk-pasted-in-by-mistake\n")
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "the keys read before are kept" not in srv.log():
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        assert call(srv.port, "GET", "/v1/models", headers=bearer(carol["carol"])).status == 200
        wait_idle(srv.port)
        metrics = call(srv.port, "GET", "/metrics", headers=bearer(keys["alice"])).body
        health = call(srv.port, "GET", "/health").body
        log = srv.log()
    # The log names each person's requests, and /metrics counts them, by name.
    assert "person=alice" in log and "person=carol" in log and "person=bob" in log
    assert b'serve_person_generated_tokens_total{person="carol"}' in metrics
    assert b'serve_person_waits_total{person="bob",class="interactive"} 1' in metrics
    # No key, in any form, in what it answered or wrote (its keys file holds only hashes).
    written = files_under(tmp_path / "prefix", tmp_path / "shared")
    assert any("snapshots" in str(p) for p in written)   # it did write: the search means something
    everything = [("log", log.encode()), ("metrics", metrics), ("health", health),
                  *((str(p), p.read_bytes()) for p in written)]
    for key in (*keys.values(), *carol.values()):
        for form in key_forms(key):
            assert [where for where, data in everything if form in data] == []


def test_a_keys_file_that_cannot_be_read_stops_the_start(lib_path, k3_container, tmp_path):
    missing = run_cli(str(k3_container), "--api-keys", str(tmp_path / "none"), lib_path=lib_path)
    assert missing.returncode == 1 and "--api-keys" in missing.stderr
    (tmp_path / "keys").write_text("alice sk-serve-a-key-pasted-where-its-hash-belongs\n")
    pasted = run_cli(str(k3_container), "--api-keys", str(tmp_path / "keys"), lib_path=lib_path)
    assert pasted.returncode == 1 and "line 1" in pasted.stderr
    assert "sk-serve-a-key" not in pasted.stderr + pasted.stdout
