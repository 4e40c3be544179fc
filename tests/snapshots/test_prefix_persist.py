"""Snapshots that outlive the server: restarts, shared preambles, identity, --warm.

The guarantee is the same as without persistence: a restored state answers
exactly as a fresh prefill would, and a snapshot is only ever restored into
the model and engine build that wrote it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from cache_calls import lookup
from served import cli_server, run_cli
from conftest import make_container
from scripted import (ScriptedEngine, SlowEnginePolicy, call, real_service, scrape, scripted_service,
                      serving, wait_idle, xtml_answer)
from serve.dialects.openai_request import parse_chat_request
from serve.snapshots.identity import SMALL_FILE, container_digest, state_identity
from serve.service.prefill import prefill
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy
from serve.app.warm import dialect_of, Warmer

CHAT = "/v1/chat/completions"
ANSWER_ONLY = {"temperature": 0, "seed": 3, "max_tokens": 8, "reasoning_effort": "none"}
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{n}", "description": f"Tool number {n} of the agent",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                     "depth": {"type": "integer"}}}}}
         for n in range(6)]


def project(directory: str, question: str = "List the files.") -> list[dict]:
    return [{"role": "system", "content": f"You are a coding agent. The project is in {directory}."},
            {"role": "user", "content": question}]


def ask(port: int, messages: list, **fields) -> dict:
    resp = call(port, "POST", CHAT, {"messages": messages, **ANSWER_ONLY, **fields})
    assert resp.status == 200, resp.body
    return resp.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@contextmanager
def persistent(lib_path, container, directory: Path, **options) -> Iterator:
    """A real service whose cache lives in `directory` under the engine's real identity."""
    def cache_for(lib, engine) -> PrefixCache:
        return PrefixCache(64 << 20, str(directory), identity=state_identity(lib, engine, container))
    with real_service(lib_path, container, prefix_cache_for=cache_for, **options) as service:
        cache = service.options.prefix_cache
        try:
            with serving(service) as srv:
                yield service, srv.port
        finally:
            cache.close()


def tools_end(service) -> int:
    """Where the tool declarations end in a prompt (thinking off, no effort)."""
    return len(service.engine.tokenize_segments(service.chat_format.render(
        [], tools=TOOLS, thinking=False, add_generation_prompt=False).segments))


def test_a_restarted_server_restores_and_answers_the_same(lib_path, k3_container, tmp_path):
    messages = project("/home/a")
    with real_service(lib_path, k3_container) as cold, serving(cold) as srv:
        expected = ask(srv.port, messages, tools=TOOLS)
    with persistent(lib_path, k3_container, tmp_path) as (_, port):
        first = ask(port, messages, tools=TOOLS)
    assert cached(first) == 0
    with persistent(lib_path, k3_container, tmp_path) as (service, port):
        again = ask(port, messages, tools=TOOLS)
        stats = service.options.prefix_cache.stats()
        assert stats["hits"] == 1 and stats["restored_tokens"] == cached(again)
        history = again["usage"]["prompt_tokens"] - len(
            service.engine.tokenize_segments(service.chat_format.generation_prompt(False)))
    assert again["choices"] == expected["choices"]
    assert cached(again) == history and again["waste"]["cached_tokens"] == history


def test_another_project_restores_the_tools_checkpoint(lib_path, k3_container, tmp_path):
    other = project("/home/b")
    with real_service(lib_path, k3_container) as cold, serving(cold) as srv:
        expected = ask(srv.port, other, tools=TOOLS)
    with persistent(lib_path, k3_container, tmp_path) as (_, port):
        ask(port, project("/home/a"), tools=TOOLS)
    with persistent(lib_path, k3_container, tmp_path) as (service, port):
        got = ask(port, other, tools=TOOLS)
        boundary = tools_end(service)
        # And the same project with another question restores its system prompt.
        same = ask(port, project("/home/b", "Read the README."), tools=TOOLS)
    assert cached(got) == boundary and got["choices"] == expected["choices"]
    assert cached(same) > boundary


def test_notes_after_the_conversation_do_not_stop_the_next_turn_reusing_it(lib_path, k3_container,
                                                                          tmp_path):
    # tool_choice's note follows the conversation, where the next turn's messages go: the
    # conversation before the note is checkpointed, or no turn with a note would reuse anything.
    first = project("/home/a")
    with real_service(lib_path, k3_container) as cold, serving(cold) as srv:
        reply = ask(srv.port, first, tools=TOOLS, tool_choice="none")["choices"][0]["message"]
        second = [*first, {"role": "assistant", "content": reply["content"]},
                  {"role": "user", "content": "And the tests?"}]
        expected = ask(srv.port, second, tools=TOOLS, tool_choice="none")
    with persistent(lib_path, k3_container, tmp_path) as (service, port):
        ask(port, first, tools=TOOLS, tool_choice="none")
        got = ask(port, second, tools=TOOLS, tool_choice="none")
        before_note = len(service.engine.tokenize_segments(service.chat_format.render(
            first, tools=TOOLS, thinking=False, add_generation_prompt=False).segments))
    assert cached(got) >= before_note and got["choices"] == expected["choices"]


def test_another_container_never_restores(lib_path, k3_container, tmp_path):
    twin = make_container(tmp_path / "twin.waste", "--seed", "99")   # same shapes, other weights
    messages = project("/home/a")
    with real_service(lib_path, twin) as cold, serving(cold) as srv:
        expected = ask(srv.port, messages, tools=TOOLS)
    cache_dir = tmp_path / "cache"
    with persistent(lib_path, k3_container, cache_dir) as (_, port):
        ask(port, messages, tools=TOOLS)
    with persistent(lib_path, twin, cache_dir) as (service, port):
        got = ask(port, messages, tools=TOOLS)
        assert len(service.options.prefix_cache) > 3   # both models' snapshots, in one budget
    assert cached(got) == 0 and got["choices"] == expected["choices"]


class FakeLibrary:
    def __init__(self, path: Path, version: str = "0.6.8", build: str = "avx2"):
        self.path, self._version, self._build = path, version, build

    def version(self) -> str:
        return self._version

    def version_number(self) -> int:
        return 608

    def build_info(self) -> str:
        return self._build


def test_the_identity_covers_what_changes_a_state(lib_path, k3_container, tmp_path):
    model = Path(shutil.copytree(k3_container, tmp_path / "m.waste"))
    engine = SimpleNamespace(info=SimpleNamespace(ctx_max=4096))
    base = state_identity(FakeLibrary(lib_path), engine, model)
    assert state_identity(FakeLibrary(lib_path), engine, model) == base
    assert state_identity(FakeLibrary(lib_path, version="0.6.9"), engine, model) != base
    assert state_identity(FakeLibrary(lib_path, build="avx512"), engine, model) != base
    assert state_identity(FakeLibrary(lib_path), SimpleNamespace(info=SimpleNamespace(ctx_max=8192)),
                          model) != base
    (model / "usage.waste").write_bytes(b"learned at runtime")   # the hotlist is no identity
    assert state_identity(FakeLibrary(lib_path), engine, model) == base
    digest = container_digest(model)
    for name in ("tokenizer.model", "specials.json", "manifest.json", "experts/layer-002.bank"):
        path = model / name
        kept = path.read_bytes()
        with open(path, "r+b") as f:   # one byte, at the start of the file
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 1]))
        assert container_digest(model) != digest, name
        path.write_bytes(kept)
    weights = model / "trunk.bin"
    assert weights.stat().st_size > SMALL_FILE      # sampled, not read whole
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size - 1)
        f.write(b"\x7f")
    assert container_digest(model) != digest


def test_a_cache_written_by_another_engine_build_is_ignored(lib_path, k3_container, tmp_path):
    def foreign_cache(lib, engine) -> PrefixCache:
        fake = state_identity(FakeLibrary(lib_path, version="9.9.9"), engine, k3_container)
        return PrefixCache(64 << 20, str(tmp_path), identity=fake)
    with real_service(lib_path, k3_container, prefix_cache_for=foreign_cache) as service, \
            serving(service) as srv:
        ask(srv.port, project("/home/a"), tools=TOOLS)
        service.options.prefix_cache.close()
    with persistent(lib_path, k3_container, tmp_path) as (_, port):
        assert cached(ask(port, project("/home/a"), tools=TOOLS)) == 0


def test_a_foreign_state_that_the_engine_refuses_is_dropped(lib_path, k3_container, tmp_path):
    # A state file from another model under a valid entry: the engine refuses
    # it, the entry goes, and the request is prefilled from scratch.
    twin = make_container(tmp_path / "twin.waste", "--seed", "7")
    messages = project("/home/a")
    with persistent(lib_path, twin, tmp_path / "twin-cache") as (service, port):
        ask(port, messages, tools=TOOLS)
        foreign = lookup(service.options.prefix_cache,
            service.engine.tokenize_segments(service.chat_format.render(
                messages, tools=TOOLS, thinking=False).segments))
    with persistent(lib_path, k3_container, tmp_path / "cache") as (service, port):
        first = ask(port, messages, tools=TOOLS)
        cache = service.options.prefix_cache
        snap = lookup(cache, service.engine.tokenize_segments(service.chat_format.render(
            messages, tools=TOOLS, thinking=False).segments))
        assert snap.n_tokens == foreign.n_tokens
        with open(foreign.path, "rb") as src:   # the other model's state, with a valid meta
            state = src.read()
        cache.drop(snap)
        cache.store(snap.tokens, lambda path: Path(path).write_bytes(state))
        again = ask(port, messages, tools=TOOLS)
        assert again["choices"] == first["choices"]
        assert cached(again) < snap.n_tokens   # restored at most an earlier checkpoint
        # and the history's snapshot was written again, by this model this time
        assert Path(lookup(cache, list(snap.tokens) + [0]).path).read_bytes() != state


def test_a_killed_server_is_reclaimed_and_its_snapshots_reused(lib_path, k3_container, tmp_path):
    flags = (str(k3_container), "--lib", str(lib_path), "--usage", str(tmp_path / "usage.waste"),
             "--prefix-cache-dir", str(tmp_path / "cache"))
    with cli_server(*flags) as (proc, port, banner):
        assert "reclaimed" not in "\n".join(banner)
        first = ask(port, project("/home/a"), tools=TOOLS)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert any(name.startswith("work-") for name in os.listdir(tmp_path / "cache"))
    with cli_server(*flags) as (proc, port, banner):
        assert "reclaimed 1 left by dead processes" in next(b for b in banner if b.startswith("prefix"))
        again = ask(port, project("/home/a"), tools=TOOLS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert cached(first) == 0 and cached(again) > 0 and again["choices"] == first["choices"]
    assert not any(name.startswith("work-") for name in os.listdir(tmp_path / "cache"))


# -- checkpoints and what is not snapshotted ---------------------------------------------


def test_a_fixed_spacing_checkpoints_every_multiple_and_keeps_them(k3_engine, tmp_path):
    # --prefix-cache-spacing: the multiples are kept, so prompts sharing a long prefix find them.
    cache = PrefixCache(64 << 20, str(tmp_path))
    tokens = k3_engine.tokenize("the tide comes in and goes out " * 120, add_bos=True)
    assert len(tokens) > 700
    k3_engine.reset()
    prefill(k3_engine, tokens, len(tokens) - 1, cache=cache, snapshot_at=[150], chunk=64,
            policy=SnapshotPolicy(spacing=256))
    stored = sorted(lookup(cache, tokens[:n + 1]).n_tokens for n in (150, 256, 512))
    assert stored == [150, 256, 512] and len(cache) == len(tokens[:-1]) // 256 + 1
    k3_engine.reset()
    cache.close()


def test_a_short_prompt_that_shares_nothing_is_not_snapshotted(tmp_path):
    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "x" * 300}]
    turn = long + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "y"}]

    def entries_after_each(min_tokens: int) -> list[int]:
        cache = PrefixCache(1 << 20, str(tmp_path / str(min_tokens)))
        service = scripted_service(ScriptedEngine([xtml_answer("ok")]), thinking=False,
                                   prefix_cache=cache,
                                   snapshot_policy=SlowEnginePolicy(min_tokens=min_tokens))
        counts = []
        with serving(service) as srv:
            for messages in (short, long, turn):
                body = call(srv.port, "POST", CHAT, {"messages": messages}).json()
                counts.append(len(cache))
        service.close()
        cache.close()
        assert cached(body) > 0   # the last turn restored
        return counts

    every, some = entries_after_each(0), entries_after_each(200)
    # The short prompt's conversation is not saved (the snapshot after its reply,
    # which a next turn would use, still is); the long one's is, and so is that of
    # a short turn that restored something.
    assert some[0] == every[0] - 1
    assert [b - a for a, b in zip(some, some[1:])] == [b - a for a, b in zip(every, every[1:])]


# -- warming ------------------------------------------------------------------------------


def test_health_says_how_far_the_warm_got_and_requests_are_served_meanwhile():
    service = scripted_service(ScriptedEngine([xtml_answer("ok")]))
    service.warming = {"requests_done": 0, "requests": 1, "prefilled": 512, "prompt_tokens": 9000}
    with serving(service) as srv:
        health = call(srv.port, "GET", "/health")
        assert health.status == 200
        assert {**health.json(), "work": None} == {
            "status": "ok", "warming": service.warming, "idle": False, "busy": False, "queue": 0,
            "deferred": False, "work": None}
        assert call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]}).status == 200
        service.warming = None
        assert {**call(srv.port, "GET", "/health").json(), "work": None} == {
            "status": "ok", "warming": None, "idle": True, "busy": False, "queue": 0,
            "deferred": False, "work": None}


def warm_lines(proc) -> list[str]:
    """The server's stdout up to and including the `warm     done` line."""
    lines: list[str] = []
    while not lines or not lines[-1].startswith("warm     done"):
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        lines.append(line.strip())
    return lines


def test_warm_start_checkpoints_the_preamble(lib_path, k3_container, tmp_path):
    saved = tmp_path / "request.json"
    saved.write_text(json.dumps({"model": "k3", "messages": project("/home/a"), "tools": TOOLS,
                                 "reasoning_effort": "none", "stream": True}))
    cache_dir = tmp_path / "cache"
    with cli_server(str(k3_container), "--lib", str(lib_path), "--usage", str(tmp_path / "u"),
                    "--prefix-cache-dir", str(cache_dir), "--warm", str(saved),
                    "--warm", str(saved)) as (proc, port, banner):
        lines = warm_lines(proc)
        assert "2 of 2 warmed" in lines[-1]
        assert any(f"1/2 {saved}:" in line and "checkpointed (0 were already cached)" in line
                   for line in lines)
        assert any(f"2/2 {saved}:" in line and "checkpointed (0 were" not in line for line in lines)
        assert call(port, "GET", "/health").json()["status"] == "ok"
        # Another question in the same project prefills only the question.
        body = ask(port, project("/home/a", "Fix the failing test."), tools=TOOLS)
        assert cached(body) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_the_warmer_reports_what_it_could_not_warm(tmp_path):
    engine = ScriptedEngine([xtml_answer("ok")], ctx_max=200)
    cache = PrefixCache(1 << 20, str(tmp_path))
    service = scripted_service(engine, thinking=False, prefix_cache=cache, prefill_chunk=16)
    requests = [("long.json", {"messages": [{"role": "user", "content": "x" * 400}]}),
                ("image.json", {"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}),
                ("ok.json", {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}]})]
    lines: list[str] = []
    warmer = Warmer(service, [(name, parse_chat_request(body)) for name, body in requests],
                    lines.append)
    assert service.warming["requests"] == 3 and service.warming["requests_done"] == 0
    warmer.start()
    warmer.join()
    assert service.warming is None and warmer.failed == 2
    assert "1/3 long.json: not warmed: the prompt is" in lines[0]
    assert "2/3 image.json: not warmed: a conversation with images" in lines[1]
    assert lines[2].endswith("3/3 ok.json: 16/111 positions")   # each chunk's progress
    assert "3/3 ok.json:" in lines[-2] and "checkpointed (0 were already cached)" in lines[-2]
    assert lines[-1] == "warm     done: 1 of 3 warmed; serving"
    assert len(cache) == 2      # the end of the system message, and of the conversation
    # Stopped (a shutdown) before it starts: nothing is warmed, and the log says it was cut short.
    stopped = Warmer(service, [("ok.json", parse_chat_request(requests[2][1]))], lines.append)
    stopped.stop()
    stopped.start()
    stopped.join()
    assert service.warming is None
    assert lines[-1].startswith("warm     cut short by shutdown: 0 of 1 warmed; request 1 stopped at")
    cache.close()


SENTENCE = "The harbour master kept a ledger of every ship that passed the breakwater. "


def warming_server(lib_path, container, tmp_path, saved: Path):
    """A server warming `saved` at a scaled clock: a 512-position chunk lasts about 3 s."""
    return cli_server(str(container), "--lib", str(lib_path), "--usage", str(tmp_path / "u"),
                      "--prefix-cache-dir", str(tmp_path / "cache"), "--warm", str(saved),
                      env={**os.environ, "WASTE_DELAY_MS": "5"})


def warmed_past(port: int, positions: int) -> dict:
    """/health's warm progress, once it is past `positions`."""
    deadline = time.monotonic() + 120
    while True:
        warming = call(port, "GET", "/health").json()["warming"]
        assert warming is not None, "the warm ended before the test could see it"
        if warming["prefilled"] >= positions:
            return warming
        assert time.monotonic() < deadline, warming
        time.sleep(0.05)


def preamble(tmp_path: Path, sentences: int) -> Path:
    saved = tmp_path / "preamble.json"   # about 33 positions a sentence
    saved.write_text(json.dumps({"messages": [{"role": "system", "content": SENTENCE * sentences},
                                              {"role": "user", "content": "Ready?"}],
                                 "reasoning_effort": "none"}))
    return saved


def test_a_request_during_a_warm_is_answered_and_the_warm_redoes_nothing(lib_path, k3_container,
                                                                          tmp_path):
    saved = preamble(tmp_path, 75)   # five chunks
    with warming_server(lib_path, k3_container, tmp_path, saved) as (proc, port, _):
        warmed_past(port, 512)    # the second chunk runs: at least two are left after it
        reply = call(port, "POST", "/v1/completions",
                     {"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=120)
        assert reply.status == 200, reply.body
        assert call(port, "GET", "/health").json()["warming"] is not None   # answered mid-warm
        lines = warm_lines(proc)
        assert lines[-1] == "warm     done: 1 of 1 warmed; serving"
        held = int(re.search(r"(\d+) positions checkpointed \(0 were", lines[-2]).group(1))
        done = [int(m.group(1)) for m in map(re.compile(r": (\d+)/\d+ positions").search, lines) if m]
        assert done == sorted(set(done)) and done[-1] == held   # resumed, never went back
        wait_idle(port)
        evaluated = scrape(port)[("serve_engine_evaluated_tokens_total", ())]
        usage = reply.json()["usage"]
        assert evaluated == held + usage["prompt_tokens"] + usage["completion_tokens"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_a_warm_cut_short_by_shutdown_says_so_and_the_next_start_resumes_it(lib_path, k3_container,
                                                                             tmp_path):
    saved = preamble(tmp_path, 45)   # three chunks
    with warming_server(lib_path, k3_container, tmp_path, saved) as (proc, port, _):
        warmed_past(port, 512)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read().splitlines()
    assert not any(line.startswith("warm     done") for line in out), out
    assert any(line.startswith("warm     cut short by shutdown: 0 of 1 warmed; request 1 stopped at")
               for line in out), out
    with warming_server(lib_path, k3_container, tmp_path, saved) as (proc, port, _):
        lines = warm_lines(proc)
        already = int(re.search(r"\((\d+) were already cached\)", lines[-2]).group(1))
        assert already >= 512     # where the first start stopped, checkpointed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def anthropic_body(directory: str, question: str) -> dict:
    """The shape Claude Code sends: system blocks, input_schema tools, max_tokens."""
    return {"model": "k3", "max_tokens": 8, "thinking": {"type": "disabled"},
            "system": [{"type": "text", "text": f"You are a coding agent in {directory}."}],
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in TOOLS],
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}


def responses_body(directory: str, question: str) -> dict:
    """The shape Codex sends: a developer message in `input`, flat function tools."""
    return {"model": "k3", "reasoning": {"effort": "none"}, "max_output_tokens": 8,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": f"You work in {directory}."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": question}]}]}


def test_warm_tells_the_three_apis_apart():
    assert dialect_of({"messages": project("/a"), "tools": TOOLS}) == "chat"
    assert dialect_of(anthropic_body("/a", "hi")) == "anthropic"
    assert dialect_of({"model": "k3", "max_tokens": 9, "system": "s", "messages": []}) == "anthropic"
    assert dialect_of(responses_body("/a", "hi")) == "responses"
    assert dialect_of({"model": "k3", "input": "hello"}) == "responses"


def test_warm_start_takes_anthropic_and_responses_bodies(lib_path, k3_container, tmp_path):
    saved_messages, saved_responses = tmp_path / "messages.json", tmp_path / "responses.json"
    saved_messages.write_text(json.dumps(anthropic_body("/home/a", "List the files.")))
    saved_responses.write_text(json.dumps(responses_body("/home/b", "List the files.")))
    with cli_server(str(k3_container), "--lib", str(lib_path), "--usage", str(tmp_path / "u"),
                    "--prefix-cache-dir", str(tmp_path / "cache"), "--warm", str(saved_messages),
                    "--warm", str(saved_responses)) as (proc, port, banner):
        lines = warm_lines(proc)
        assert "2 of 2 warmed" in lines[-1], lines
        # Each dialect's next question restores what its saved body warmed.
        message = call(port, "POST", "/v1/messages", anthropic_body("/home/a", "Fix the test.")).json()
        assert message["usage"]["cache_read_input_tokens"] > 0, message
        response = call(port, "POST", "/v1/responses", responses_body("/home/b", "Fix the test.")).json()
        assert response["usage"]["input_tokens_details"]["cached_tokens"] > 0, response
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_warm_refuses_what_it_cannot_use(lib_path, k3_container, tmp_path):
    responses = tmp_path / "responses.json"
    responses.write_text(json.dumps({"model": "k3", "input": 7}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": "not a list"}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for path, reason in ((tmp_path / "missing.json", "No such file"), (broken, "Expecting"),
                         (responses, "input"), (bad, "messages")):
        done = run_cli(str(k3_container), "--warm", str(path), lib_path=lib_path)
        assert done.returncode == 1 and f"--warm {path}" in done.stderr and reason in done.stderr
    saved = tmp_path / "ok.json"
    saved.write_text(json.dumps({"messages": project("/home/a")}))
    done = run_cli(str(k3_container), "--warm", str(saved), "--no-prefix-cache", lib_path=lib_path)
    assert done.returncode == 1 and "--warm needs the prefix cache" in done.stderr


def test_an_unusable_cache_directory_stops_the_start(lib_path, k3_container, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    done = run_cli(str(k3_container), "--prefix-cache-dir", str(tmp_path / "link"),
                   lib_path=lib_path)
    assert done.returncode == 1 and "prefix cache:" in done.stderr and "symlink" in done.stderr
