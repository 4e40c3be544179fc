"""A turn never prefills again what the model just said.

After a reply the state holding it is saved, and when the client sends the
reply back its history uses the ids the model generated, so the next turn
restores the previous turn's whole prompt and reply. Reuse is measured
through usage.prompt_tokens_details.cached_tokens; answers are compared with
a server that has no prefix cache (and so prefills everything) replaying the
same conversation.
"""
from __future__ import annotations

import threading

import pytest

from scripted import (ScriptedEngine, call, data_url, settling, real_service, scripted_service, serving, tiny_png,
                      xtml_answer)
from serve.formats.xtml import render as xtml
from serve.engine.binding import UnencodableText, WasteError
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

CHAT = "/v1/chat/completions"
GREEDY = {"temperature": 0, "seed": 5, "max_tokens": 24}
SLACK = 2   # positions a turn may prefill again of the previous prompt and reply
THINKING = {True: {}, False: {"reasoning_effort": "none"}}


def ask(port: int, messages: list, **fields) -> dict:
    resp = call(port, "POST", CHAT, {"messages": messages, **GREEDY, **fields})
    assert resp.status == 200, resp.body
    return resp.json()


def as_received(body: dict) -> dict:
    """The assistant message a client that keeps everything sends back."""
    return dict(body["choices"][0]["message"])


def without_reasoning(body: dict) -> dict:
    """The assistant message of a client that drops reasoning_content, as most do."""
    return {k: v for k, v in as_received(body).items() if k != "reasoning_content"}


def chat(port: int, turns: int, returned=as_received, idle=lambda: None, **fields) -> list[dict]:
    """A chat whose client resends the history with each reply as `returned` gives it back;
    `idle()` runs between a reply and the next turn."""
    messages, bodies = [], []
    for n in range(turns):
        messages.append({"role": "user", "content": f"Turn {n}: what do the tides owe the moon?"})
        bodies.append(ask(port, messages, **fields))
        messages.append(returned(bodies[-1]))
        idle()
    return bodies


def reused(bodies: list[dict]) -> list[tuple[int, int]]:
    """(cached, previous prompt + reply) for every turn after the first."""
    return [(now["usage"]["prompt_tokens_details"]["cached_tokens"],
             before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"])
            for before, now in zip(bodies, bodies[1:])]


def assert_reused(bodies: list[dict]) -> None:
    """Each turn restored the previous prompt and reply (and, once the idle engine has
    evaluated it, the closing markup of a reply cut short), never its own new message."""
    for (cached, previous), now in zip(reused(bodies), bodies[1:]):
        assert previous - SLACK <= cached < now["usage"]["prompt_tokens"]


def cold_and_warm(lib_path, container, tmp_path, turns: int, returned=as_received, options=None,
                  **fields) -> tuple[list[dict], list[dict]]:
    """The same chat on a server without a prefix cache, then on one with it."""
    options = options or {}
    with real_service(lib_path, container, reply_memory=ReplyMemory(), **options) as cold, \
            serving(cold) as srv:
        expected = chat(srv.port, turns, returned, **fields)
    cache = PrefixCache(64 << 20, parent_dir=str(tmp_path))
    try:
        with real_service(lib_path, container, reply_memory=ReplyMemory(), prefix_cache=cache,
                          **options) as warm, serving(warm) as srv:
            got = chat(srv.port, turns, returned, warm.settle, **fields)
    finally:
        cache.close()
    return expected, got


def choices(bodies: list[dict]) -> list:
    return [b["choices"] for b in bodies]


@pytest.mark.parametrize("thinking", [True, False])
def test_each_turn_reuses_the_previous_prompt_and_reply(lib_path, k3_container, tmp_path, thinking):
    expected, got = cold_and_warm(lib_path, k3_container, tmp_path, 4, **THINKING[thinking])
    assert choices(got) == choices(expected)
    assert_reused(got)
    # Nothing of the kind without the cache, so the figures above are this feature's.
    assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for b in expected)


def test_replies_serve_decodes_itself_are_reused_too(lib_path, k3_container, tmp_path):
    # logprobs are computed by serve's own loop over waste_eval, which leaves the reply's
    # last token unevaluated: the snapshot after the reply holds the tokens before it.
    expected, got = cold_and_warm(lib_path, k3_container, tmp_path, 3, logprobs=True)
    assert all(b["choices"][0]["logprobs"] for b in got)
    assert choices(got) == choices(expected)
    assert_reused(got)


def test_a_reply_cut_by_max_tokens_mid_character_still_matches(lib_path, k3_container, tmp_path):
    # The demo model's replies stop at max_tokens, and a greedy one splits characters:
    # the client sees U+FFFD where the reply parser replaced the bytes.
    expected, got = cold_and_warm(lib_path, k3_container, tmp_path, 3, max_tokens=17)
    assert any(b["choices"][0]["finish_reason"] == "length" for b in got)
    assert any("\ufffd" in (b["choices"][0]["message"].get("reasoning_content") or "") for b in got)
    assert choices(got) == choices(expected)
    assert_reused(got)


def test_a_reply_cut_by_a_stop_string_reuses_what_the_client_saw(lib_path, k3_container, tmp_path):
    fields = THINKING[False]
    with real_service(lib_path, k3_container, reply_memory=ReplyMemory()) as probe, serving(probe) as srv:
        content = chat(srv.port, 1, **fields)[0]["choices"][0]["message"]["content"]
    # A stop string from the middle of what the model writes first, found nowhere earlier.
    at = next(p for p in range(len(content) // 2, len(content) - 3)
              if content.find(content[p:p + 3]) == p and "\ufffd" not in content[p:p + 3])
    expected, got = cold_and_warm(lib_path, k3_container, tmp_path, 3, stop=[content[at:at + 3]], **fields)
    assert got[0]["choices"][0]["message"]["content"] == content[:at]
    assert choices(got) == choices(expected)
    assert_reused(got)


def test_keep_reasoning_reuses_replies_whose_reasoning_the_client_dropped(lib_path, k3_container, tmp_path):
    options = {"keep_reasoning": True}
    expected, got = cold_and_warm(lib_path, k3_container, tmp_path, 4, without_reasoning, options)
    assert all(b["choices"][0]["message"].get("reasoning_content") for b in got)
    assert choices(got) == choices(expected)
    assert_reused(got)


def test_without_keep_reasoning_the_match_ends_where_the_reasoning_began(lib_path, k3_container, tmp_path):
    cache = PrefixCache(64 << 20, parent_dir=str(tmp_path))
    with real_service(lib_path, k3_container, reply_memory=ReplyMemory(), prefix_cache=cache) as warm, \
            serving(warm) as srv:
        bodies = chat(srv.port, 3, without_reasoning)
        opening = len(warm.engine.tokenize_segments(xtml.generation_prompt(True)))
    cache.close()
    # The previous prompt ends with the reply's opening; its think element is empty in
    # the history sent back, so only the conversation before that opening is restored.
    for before, now in zip(bodies, bodies[1:]):
        assert now["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            before["usage"]["prompt_tokens"] - opening


# ---- the scripted engine: replies that end the way K3's do ---------------------------

THOUGHT = ["Let me", " look", " that up", "."]
CALL_REPLY = (THOUGHT + ["<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>",
                         "<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>",
                         "<|open|>", 'call tool="lookup" index="1"', "<|sep|>",
                         "<|open|>", 'argument key="word" type="string"', "<|sep|>", "tide",
                         "<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>",
                         "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>",
                         "<|end_of_msg|>"])
ANSWER_REPLY = xtml_answer("The rise", " and fall", " of the sea.", thinking=["It", " says", " so."])
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


def scripted(tmp_path, replies, **options):
    engine = ScriptedEngine(replies)
    cache = PrefixCache(1 << 20, parent_dir=str(tmp_path))
    return engine, scripted_service(engine, prefix_cache=cache, reply_memory=ReplyMemory(), **options)


def test_a_tool_loop_reuses_the_call_and_the_answer(tmp_path):
    scripts = [CALL_REPLY, ANSWER_REPLY, ANSWER_REPLY]
    engine, service = scripted(tmp_path, scripts)
    with serving(service) as srv:
        messages = [{"role": "user", "content": "What is a tide?"}]
        first = ask(srv.port, messages, tools=TOOLS, max_tokens=200)
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        call_id = first["choices"][0]["message"]["tool_calls"][0]["id"]
        messages += [as_received(first),
                     {"role": "tool", "tool_call_id": call_id, "content": "the rise and fall of the sea"}]
        second = ask(srv.port, messages, tools=TOOLS, max_tokens=200)
        messages += [as_received(second), {"role": "user", "content": "Thanks."}]
        third = ask(srv.port, messages, tools=TOOLS, max_tokens=200)
    service.options.prefix_cache.close()
    assert second["choices"][0]["message"]["content"] == "The rise and fall of the sea."
    for n, (cached, previous) in enumerate(reused([first, second, third])):
        # Token-exact: each prompt begins with everything the engine held after the last reply,
        # although the scripted tokenizer would spell every multi-byte piece byte by byte.
        held = engine.prompts[n] + [engine.piece_id(p) for p in scripts[n]]
        assert engine.prompts[n + 1][:len(held)] == held
        assert cached == previous == len(held)


def test_the_stop_token_is_generated_not_cancelled(tmp_path):
    # K3 closes its message, then writes <|end_of_msg|>: generation is let run to that
    # stop token, so the state is not reset and can be saved.
    engine, service = scripted(tmp_path, [ANSWER_REPLY])
    with serving(service) as srv:
        body = ask(srv.port, [{"role": "user", "content": "Tides?"}], max_tokens=200)
    service.options.prefix_cache.close()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert not engine.results[0].cancelled
    assert body["usage"]["completion_tokens"] == len(ANSWER_REPLY)


def test_anything_after_the_closed_message_but_the_stop_token_is_cancelled(tmp_path):
    chatty = ANSWER_REPLY[:-1] + ["more", "and more", "<|end_of_msg|>"]
    engine, service = scripted(tmp_path, [chatty])
    with serving(service) as srv:
        body = ask(srv.port, [{"role": "user", "content": "Tides?"}], max_tokens=200)
    service.options.prefix_cache.close()
    assert body["choices"][0]["message"]["content"] == "The rise and fall of the sea."
    assert engine.results[0].cancelled and engine.results[0].n_tokens == len(ANSWER_REPLY)


def cut_and_settled(port: int, service, stop: str) -> tuple[dict, list]:
    """A first turn cut by `stop`, the snapshot the idle engine makes after it (made now,
    if its thread has not), and the messages of the next turn."""
    messages = [{"role": "user", "content": "Tides?"}]
    first = ask(port, messages, stop=[stop], max_tokens=200)
    service.settle()
    return first, messages + [as_received(first), {"role": "user", "content": "And then?"}]


def test_a_reply_cut_by_a_stop_string_is_reused_up_to_the_cut(tmp_path):
    engine, service = scripted(tmp_path, [ANSWER_REPLY])
    with serving(service) as srv:
        first, messages = cut_and_settled(srv.port, service, "fall")
        second = ask(srv.port, messages, stop=["fall"], max_tokens=200)
    service.options.prefix_cache.close()
    assert first["choices"][0]["message"]["content"] == "The rise and "
    # The model's ids reach the last token wholly before the cut ("The rise"); " and fall"
    # went into the state but the client never saw "fall", so it is tokenized anew.
    kept = ANSWER_REPLY[:ANSWER_REPLY.index(" and fall")]
    held = engine.prompts[0] + [engine.piece_id(p) for p in kept]
    assert engine.prompts[1][:len(held)] == held
    assert engine.prompts[1][len(held)] != engine.piece_id(" and fall")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert cached == before_the_new_turn(engine, messages) >= previous - SLACK


def before_the_new_turn(engine: ScriptedEngine, messages: list) -> int:
    """Positions of the last prompt before its new user message and generation prompt."""
    new_turn = xtml.build_chat_segments([messages[-1]], thinking=True)
    return len(engine.prompts[-1]) - len(engine.tokenize(xtml.render_text(new_turn), markup=True))


def test_a_reply_cut_by_max_tokens_is_closed_while_the_engine_is_idle(tmp_path):
    engine, service = scripted(tmp_path, [ANSWER_REPLY])
    with serving(service) as srv:
        messages = [{"role": "user", "content": "Tides?"}]
        first = ask(srv.port, messages, max_tokens=10)   # into the answer, its closing unwritten
        service.settle()
        messages += [as_received(first), {"role": "user", "content": "And then?"}]
        second = ask(srv.port, messages, max_tokens=200)
    service.options.prefix_cache.close()
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["message"]["content"] == "The rise"
    held = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert engine.prompts[1][:held] == engine.prompts[0] + [engine.piece_id(p) for p in ANSWER_REPLY[:10]]
    assert cached == before_the_new_turn(engine, messages) > held


def test_a_deferred_snapshot_yields_to_a_waiting_request(tmp_path):
    engine, service = scripted(tmp_path, [ANSWER_REPLY])
    in_settle, go_on = threading.Event(), threading.Event()

    settled: list[int] = []

    def pace(chunk: int) -> None:
        if settling():
            settled.append(chunk)
            in_settle.set()   # the idle engine evaluates the reply's state after the reply
            go_on.wait(10)

    engine.before_eval = pace
    second: list = []
    with serving(service) as srv:
        messages = [{"role": "user", "content": "Tides?"}]
        first = ask(srv.port, messages, stop=["fall"], max_tokens=200)
        assert in_settle.wait(10)
        messages += [as_received(first), {"role": "user", "content": "And then?"}]
        waiting = threading.Thread(target=lambda: second.append(ask(srv.port, messages, max_tokens=200)))
        waiting.start()
        while not len(service.queue):   # until the request queues behind the settling engine
            waiting.join(0.01)
        go_on.set()
        waiting.join(10)
    service.options.prefix_cache.close()
    assert second and second[0]["choices"][0]["message"]["content"]
    # One chunk, then the request that was waiting had the engine; the settling stopped
    # there, snapshotting the position it had evaluated (at K3's costs a token pays for
    # it), which the waiting request restored.
    assert len(settled) == 1
    assert second[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(engine.prompts[0]) - len(
        engine.tokenize_segments(xtml.generation_prompt(True))) + 1


def test_a_deferred_snapshot_that_cannot_be_saved_costs_only_the_reuse(tmp_path):
    engine, service = scripted(tmp_path, [ANSWER_REPLY])

    def save_fails(path: str) -> None:
        raise WasteError(-1, "WASTE_E_IO", "I/O error", "no space left on device", "waste_state_save")

    engine.save_state = save_fails
    with serving(service) as srv:
        first, messages = cut_and_settled(srv.port, service, "fall")
        second = ask(srv.port, messages, max_tokens=200)
    service.options.prefix_cache.close()
    assert first["choices"][0]["message"]["content"] == "The rise and "
    assert second["choices"][0]["message"]["content"] == "The rise and fall of the sea."
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert engine.calls.count("eval") > 1   # the deferred snapshot was evaluated, then not saved


def test_a_reply_that_cannot_be_rendered_alone_is_tokenized_as_text(tmp_path):
    # An image in an assistant message needs the request's image prompts: it is never a
    # remembered reply's rendering, and the request goes on as usual.
    engine, service = scripted(tmp_path, [ANSWER_REPLY], vision=True)
    picture = {"type": "image_url", "image_url": {"url": data_url(tiny_png())}}
    with serving(service) as srv:
        first = ask(srv.port, [{"role": "user", "content": "Tides?"}], max_tokens=200)
        reply = as_received(first)
        reply["content"] = [{"type": "text", "text": reply["content"]}, picture]
        second = ask(srv.port, [{"role": "user", "content": "Tides?"}, reply,
                                {"role": "user", "content": "Again?"}], max_tokens=200)
    service.options.prefix_cache.close()
    assert second["choices"][0]["message"]["content"] == "The rise and fall of the sea."
    assert engine.piece_id(" and fall") not in engine.prompts[1]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_reply_no_prompt_can_carry_is_not_settled(tmp_path):
    # The model wrote a NUL, which no C string carries. Its own id can stand in history,
    # but a stop string cuts that token, so the text left must be tokenized: the next turn
    # is refused, and the deferred snapshot gives up quietly.
    engine, service = scripted(tmp_path, [xtml_answer("a\0b", " and fall", thinking=["So."])])
    plain = engine.tokenize

    def tokenize(text: str, **options) -> list[int]:
        if "\0" in text:
            raise UnencodableText("text contains a NUL character")
        return plain(text, **options)

    engine.tokenize = tokenize
    with serving(service) as srv:
        first, messages = cut_and_settled(srv.port, service, "b")
        refused = call(srv.port, "POST", CHAT, {"messages": messages, **GREEDY})
        again = ask(srv.port, messages[:1])
    service.options.prefix_cache.close()
    assert first["choices"][0]["message"]["content"] == "a\0"
    assert refused.status == 400 and "cannot be tokenized" in refused.body.decode()
    assert again["choices"][0]["message"]["content"] == "a\0b and fall"
