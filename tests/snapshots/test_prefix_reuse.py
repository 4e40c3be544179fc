"""Prefix reuse and chunked prefill, through the server.

The guarantee under test: with snapshots on, answers are exactly those of a
server that prefills every request from scratch, whatever the order of the
requests, while the repeated part of a conversation is not prefilled again.
"""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from scripted import (ScriptedEngine, call, data_url, real_service, scripted_service, serving,
                      tiny_png, wait_idle, xtml_answer)
from cache_calls import lookup
from serve.formats.xtml import render as xtml
from serve.engine.binding import WasteError
from serve.snapshots.cache import PrefixCache

CHAT = "/v1/chat/completions"
ANSWER_ONLY = {"temperature": 0, "seed": 3, "max_tokens": 8, "reasoning_effort": "none"}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(64 << 20, parent_dir=str(tmp_path))
    yield c
    c.close()


def ask(port: int, messages: list, **fields) -> dict:
    resp = call(port, "POST", CHAT, {"messages": messages, **ANSWER_ONLY, **fields})
    assert resp.status == 200, resp.body
    return resp.json()


def answer(body: dict) -> dict:
    return body["choices"][0]["message"]


def conversation(port: int, turns: int) -> list[list[dict]]:
    """The prompts of a chat whose every turn resends the history with the last reply."""
    prompts, messages = [], []
    for n in range(turns):
        messages = messages + [{"role": "user", "content": f"Question number {n}: why the tides?"}]
        prompts.append(messages)
        messages = messages + [{"role": "assistant", "content": answer(ask(port, messages))["content"]}]
    return prompts


def generation_prompt_tokens(service, thinking: bool) -> int:
    return len(service.engine.tokenize_segments(xtml.generation_prompt(thinking)))


def test_answers_equal_a_cold_server_in_any_order(lib_path, k3_container, cache):
    with real_service(lib_path, k3_container) as cold, serving(cold) as srv:
        prompts = conversation(srv.port, 4)
        expected = [ask(srv.port, p) for p in prompts]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 2, 3, 0, 1]):
        with real_service(lib_path, k3_container, prefix_cache=cache) as warm, serving(warm) as srv:
            for i in order:
                got = ask(srv.port, prompts[i])
                assert got["choices"] == expected[i]["choices"]
                assert got["usage"]["prompt_tokens"] == expected[i]["usage"]["prompt_tokens"]


def test_next_turn_prefills_only_what_is_new(lib_path, k3_container, cache):
    with real_service(lib_path, k3_container, prefix_cache=cache) as service, serving(service) as srv:
        first = [{"role": "user", "content": "Name a colour."}]
        one = ask(srv.port, first)
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        history = one["usage"]["prompt_tokens"] - generation_prompt_tokens(service, False)
        second = first + [answer(one), {"role": "user", "content": "Another one."}]
        two = ask(srv.port, second)
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == history
        assert two["waste"]["cached_tokens"] == history
        # The same turn streamed reports it on the usage chunk too.
        resp = call(srv.port, "POST", CHAT, {"messages": second, **ANSWER_ONLY, "stream": True,
                                             "stream_options": {"include_usage": True}})
        usage = resp.events()[-2]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= history


def test_tool_loop_reuses_the_prompt_before_the_call(lib_path, k3_container, cache):
    with real_service(lib_path, k3_container, prefix_cache=cache) as service, serving(service) as srv:
        asked = [{"role": "user", "content": "Look up 'tide'."}]
        first = ask(srv.port, asked, tools=TOOLS)
        history = first["usage"]["prompt_tokens"] - generation_prompt_tokens(service, False)
        call_turn = {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"word": "tide"}'}}]}
        result = {"role": "tool", "tool_call_id": "call_1", "content": "the rise and fall of the sea"}
        second = ask(srv.port, asked + [call_turn, result], tools=TOOLS)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == history


def test_a_snapshot_that_fails_to_load_is_dropped(lib_path, k3_container, cache):
    first = [{"role": "user", "content": "Count to three."}]
    with real_service(lib_path, k3_container) as cold, serving(cold) as srv:
        reply = answer(ask(srv.port, first))
        later = first + [reply, {"role": "user", "content": "And to four?"}]
        expected = ask(srv.port, later)
    with real_service(lib_path, k3_container, prefix_cache=cache) as warm, serving(warm) as srv:
        ask(srv.port, first)
        damaged = set(os.listdir(cache.directory))
        assert damaged   # the history, and (with its reply) the state after generation
        for name in damaged:
            with open(os.path.join(cache.directory, name, "state"), "r+b") as f:
                f.write(b"not a state")
        got = ask(srv.port, later)
        assert got["choices"] == expected["choices"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The damaged snapshots the new turn tried are gone; its own took their place.
        assert damaged.isdisjoint(os.listdir(cache.directory))
        assert lookup(cache, list(range(3))) is None


def test_images_invalidate_reuse_past_their_position(lib_path, k3_vision_container, cache):
    picture = [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": data_url(tiny_png(20, 12))}}]}]
    with real_service(lib_path, k3_vision_container, vision=True) as cold, serving(cold) as srv:
        reply = answer(ask(srv.port, picture))
        later = picture + [reply, {"role": "user", "content": "Describe it again."}]
        expected = ask(srv.port, later)
    with real_service(lib_path, k3_vision_container, vision=True, prefix_cache=cache) as warm, \
            serving(warm) as srv:
        ask(srv.port, picture)
        assert len(cache) == 0   # the history ends after the image: no snapshot of it
        got = ask(srv.port, later)
        assert got["choices"] == expected["choices"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def long_prompt() -> list[dict]:
    return [{"role": "user", "content": "x" * 300}]   # ~330 ids on the scripted tokenizer


def test_stream_shows_prefill_progress_as_comments():
    engine = ScriptedEngine([xtml_answer("ok")])
    lines: list[str] = []
    service = scripted_service(engine, prefill_chunk=64, log=lines.append)
    with serving(service) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": long_prompt(), "stream": True})
    total = len(engine.prompts[0])
    progress = [c.split(" ", 2) for c in resp.comments()]
    assert progress and all(word == "prefill" for word, _, _ in progress)
    done = [int(frac.split("/")[0]) for _, frac, _ in progress]
    assert all(int(frac.split("/")[1]) == total for _, frac, _ in progress)
    # ... and what a client reads: the same counts, and an estimate at the measured rate
    reports = [json.loads(report) for _, _, report in progress]
    assert [(r["positions"], r["restored"], r["evaluated"]) for r in reports] == \
        [(total, 0, d) for d in done]
    # (what is left at the rate, counted from the chunk's end: the comment goes out just after)
    for r, d in zip(reports, done):
        at_chunk = (total - d) * service.policy.costs.token_seconds
        assert at_chunk - 1.0 < r["first_token_seconds"] <= at_chunk + 1e-3, (r, at_chunk)
    assert done == sorted(done) and done[0] == 64 and done[-1] == total - 1
    assert engine.evals[:-1] == [64] * (len(engine.evals) - 1)
    # Each log line names the request it belongs to.
    rid = resp.headers["x-request-id"]
    assert [line for line in lines if " prefill " in line] == [f"{rid} prefill {d}/{total}" for d in done]
    # The comments come after the role chunk, before the answer, and disturb nothing.
    events = resp.events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert resp.body.rindex(b": prefill ") < resp.body.index(b'"finish_reason": "stop"')
    assert events[-1] == "[DONE]"


def test_short_prompts_send_no_progress():
    service = scripted_service(ScriptedEngine([xtml_answer("ok")]))
    with serving(service) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                             "stream": True})
    assert resp.comments() == [] and resp.events()[-1] == "[DONE]"


@pytest.mark.parametrize("finish", [True, False])
def test_client_that_leaves_during_prefill_stops_it_at_the_next_chunk(finish, tmp_path):
    # Without a prefix cache there is nothing to finish the prefill for; with one and
    # --no-finish-abandoned, it is not finished either.
    engine = ScriptedEngine([xtml_answer("ok")])
    in_prefill, client_closed = threading.Event(), threading.Event()

    def pace(chunk: int) -> None:
        if chunk == 1:
            in_prefill.set()
            client_closed.wait(10)

    engine.before_eval = pace
    cache = None if finish else PrefixCache(1 << 20, parent_dir=str(tmp_path))
    # Attaching off: with it on, the job goes on for its client's return whatever the cache.
    service = scripted_service(engine, prefill_chunk=16, prefix_cache=cache, finish_abandoned=finish,
                               attach=False)
    with serving(service) as srv:
        body = (b'{"stream": true, "messages": [{"role": "user", "content": "' + b"y" * 300 + b'"}]}')
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert in_prefill.wait(10)
        sock.close()
        client_closed.set()
        engine.before_eval = None
        # The next request runs once the abandoned one has let go of the engine.
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200
        wait_idle(srv.port)
    if cache is not None:
        cache.close()
    chunks_needed = -(-(300 + 30) // 16)
    abandoned = len(engine.evals) - 1   # the second request fits one chunk
    assert 2 <= abandoned < chunks_needed
    assert len(engine.prompts) == 1     # the abandoned request never reached generate


def test_an_image_after_a_cached_prefix_still_reaches_the_model(lib_path, k3_vision_container, cache):
    # Restoring a snapshot resets the engine's image queue, and an engine may
    # consume its queue on any eval: the image must be queued after both.
    first = [{"role": "user", "content": "Hello there."}]
    with real_service(lib_path, k3_vision_container, vision=True) as cold, serving(cold) as srv:
        reply = answer(ask(srv.port, first))
        later = first + [reply, {"role": "user", "content": [
            {"type": "text", "text": "And this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(tiny_png(30, 20))}}]}]
        expected = ask(srv.port, later)
    with real_service(lib_path, k3_vision_container, vision=True, prefix_cache=cache) as warm, \
            serving(warm) as srv:
        ask(srv.port, first)
        got = ask(srv.port, later)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert got["choices"] == expected["choices"]


def test_a_snapshot_that_cannot_be_saved_does_not_fail_the_request(tmp_path):
    # Snapshots only spare later requests work: a full disk must not cost this answer.
    engine = ScriptedEngine([xtml_answer("still answered")])

    def save_fails(path: str) -> None:
        with open(path, "w") as f:
            f.write("half a snapshot")
        raise WasteError(-1, "WASTE_E_IO", "I/O error", "no space left on device", "waste_state_save")

    engine.save_state = save_fails
    cache = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    try:
        with serving(scripted_service(engine, thinking=False, prefix_cache=cache)) as srv:
            resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]})
        assert resp.status == 200, resp.body
        assert answer(resp.json())["content"] == "still answered"
        assert len(cache) == 0 and os.listdir(cache.directory) == []
    finally:
        cache.close()


def test_images_are_queued_after_the_last_prefill_eval(tmp_path):
    engine = ScriptedEngine([xtml_answer("ok")])
    service = scripted_service(engine, vision=True, prefill_chunk=8,
                               prefix_cache=PrefixCache(1 << 20, parent_dir=str(tmp_path)))
    with serving(service) as srv:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "z" * 100},
            {"type": "image_url", "image_url": {"url": data_url(tiny_png())}}]}]
        assert call(srv.port, "POST", CHAT, {"messages": messages}).status == 200
    service.options.prefix_cache.close()
    calls = engine.calls
    # Queued once to validate and count it, dropped, the text prefilled in chunks,
    # queued again, and nothing evaluated between that and generate.
    first_eval = calls.index("eval")
    assert "image_add" in calls[:first_eval] and calls[first_eval - 1] == "image_clear"
    assert calls.count("eval") > 1 and calls[-2:] == ["image_add", "generate"]

