"""POST /v1/chat/completions over real sockets, scripted engine: shapes, fields, finish reasons, chat formats."""
from __future__ import annotations

import json

import pytest

from scripted import (KIMI_LINEAR_SPECIALS, ScriptedEngine, ScriptedLibrary, assert_error, call,
                      engine, scripted_service, server, serving, xtml_answer)
from serve.formats.format_choice import NoChatFormat
from serve.service.facade import Service, ServiceOptions
from test_tool_calls import TOOLS

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# ---- chat -------------------------------------------------------------------

def test_blocking_chat_shape(server, engine):
    body = call(server.port, "POST", CHAT, {"model": "anything", "messages": USER}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "scripted" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello",
                                 "reasoning_content": "Let me think."}
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(engine.prompts[0])
    assert usage["completion_tokens"] == engine.results[0].n_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    waste = body["waste"]
    assert set(waste) == {"prompt_tokens", "completion_tokens", "experts_hit", "experts_missed",
                          "expert_hit_rate", "bytes_read", "io_ms", "direct_io", "ms", "first_token_ms",
                          "decode_ms", "tokens_per_second",
                          "context_full", "cached_tokens", "constrained", "mask_ms", "mask_changed",
                          "reasoning", "work", "behind_chores_ms", "reasoning_tokens",
                          "reasoning_budget", "reasoning_ended"}
    assert waste["reasoning"] == "on"   # K3 thinking by default, no effort named
    # "Let me ", "think.": two tokens (its <|close|> is not one); the model closed it itself
    assert (waste["reasoning_tokens"], waste["reasoning_ended"]) == (2, "model")
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert (waste["work"], waste["behind_chores_ms"]) == ("interactive", 0)
    assert waste["constrained"] is False and waste["mask_changed"] == 0
    n = usage["completion_tokens"]
    assert (waste["experts_hit"], waste["experts_missed"]) == (3 * n, n)
    assert waste["expert_hit_rate"] == pytest.approx(0.75)
    assert waste["bytes_read"] == 4096 * n and waste["context_full"] is False
    assert waste["io_ms"] == pytest.approx(0.5 * n)   # the scripted engine's half a ms a token


def test_thinking_off_has_no_reasoning_content(engine):
    engine.replies = [xtml_answer("Just ", "this")]
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Just this"}
    assert [s.text for s in engine.segments[-3:]] == ["<|open|>", "response", "<|sep|>"]


def test_stream_is_byte_exact(server):
    resp = call(server.port, "POST", CHAT, {"messages": USER, "stream": True,
                                            "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
    events = resp.events()
    rid, created = events[0]["id"], events[0]["created"]
    assert rid.startswith("chatcmpl-")

    def chunk(delta, finish=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "scripted",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    usage = events[-2]
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"]["completion_tokens"] == usage["waste"]["completion_tokens"] > 0
    # A token a chunk, or a few gathered into one (a reader that takes the log in batches):
    # the pieces, as they came, say the reasoning and then the answer, each whole.
    said = [next(iter(e["choices"][0]["delta"].items())) for e in events[1:-3]]
    kinds = [kind for kind, _ in said]
    assert kinds == sorted(kinds, reverse=True) and set(kinds) == {"reasoning_content", "content"}
    assert "".join(text for kind, text in said if kind == "reasoning_content") == "Let me think."
    assert "".join(text for kind, text in said if kind == "content") == "Hello"
    expected = [chunk({"role": "assistant", "content": ""}),
                *(chunk({kind: text}) for kind, text in said), chunk({}, "stop"), usage]
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in expected)
    assert resp.body == wire + b"data: [DONE]\n\n"


def test_stream_without_usage_has_no_usage_chunk(server):
    events = call(server.port, "POST", CHAT, {"messages": USER, "stream": True}).events()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_sampling_fields_reach_the_engine(server, engine):
    resp = call(server.port, "POST", CHAT, {"messages": USER, "temperature": 0.5, "top_p": 0.9,
                                            "top_k": 7, "seed": 42, "max_tokens": 9})
    assert resp.status == 200
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (0.5, 0.9, 7, 42, 9)
    assert list(p.stop_tokens) == [engine.specials["<|end_of_msg|>"]]
    call(server.port, "POST", CHAT, {"messages": USER, "max_completion_tokens": 5})
    assert engine.params[-1].max_tokens == 5


def test_unknown_fields_and_off_values_are_accepted(server):
    """Fields serve does not know, and the off values clients send unasked (Open-WebUI's
    penalties of 0, an empty logit_bias), even where serve's decoder is off (a script has no
    logits): tests/api/test_field_lists.py has the fields that do something."""
    resp = call(server.port, "POST", CHAT, {"messages": USER, "frequency_penalty": 0,
                                            "presence_penalty": 0.0, "user": "u1",
                                            "logit_bias": {}, "extra_knob": 3})
    assert resp.status == 200


@pytest.mark.parametrize("fields,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]},
     "messages[0].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
     "messages[1].reasoning_content"),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "name": 5, "content": "r"}]},
     "messages[0].name"),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "tool": ["f"], "content": "r"}]},
     "messages[0].tool"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "developer", "content": "x", "name": ["n"]}]}, "messages[0].name"),
    ({"messages": [*USER, {"role": "assistant", "content": "x", "reasoning": {"r": 1}}]},
     "messages[1].reasoning"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": 5}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"),   # too big for a float: not an overflow
    ({"top_p": 10 ** 400}, "top_p"),
    ({"top_k": 2 ** 31}, "top_k"),                 # the engine's top_k is a C int
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "s"}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"n": 2}, "n"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
])
def test_invalid_fields_are_named(server, engine, fields, param):
    body = {"messages": USER, **fields}
    assert_error(call(server.port, "POST", CHAT, body), 400, param=param)
    assert engine.prompts == []  # refused before anything ran


def test_tool_call_arguments_nested_too_deeply_are_a_400(server, engine):
    call_ = {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "[" * 40000 + "]" * 40000}}
    body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call_]}]}
    assert_error(call(server.port, "POST", CHAT, body), 400, param="messages")
    assert engine.prompts == []


def test_developer_role_is_system(server, engine):
    resp = call(server.port, "POST", CHAT, {"messages": [{"role": "developer", "content": "be brief"},
                                                         *USER]})
    assert resp.status == 200
    assert [s.text for s in engine.segments[:4]] == ["<|open|>", "message", " role", '="']
    assert engine.segments[4].text == "system"


def test_an_unknown_effort_is_refused_naming_the_values(server):
    err = assert_error(call(server.port, "POST", CHAT, {"messages": USER, "reasoning_effort": "huge"}),
                       400, param="reasoning_effort")
    assert all(value in err["message"] for value in ("minimal", "medium", "xhigh", "max"))


@pytest.mark.parametrize("effort,thinking,level", [
    ("low", True, "low"), ("medium", True, "high"), ("high", True, "high"), ("xhigh", True, "max"),
    ("max", True, "max"), ("none", False, None), ("minimal", False, None), ("off", False, None),
    (None, True, None)])
def test_reasoning_effort_switches_the_think_channel(server, engine, effort, thinking, level):
    body = {"messages": USER} if effort is None else {"messages": USER, "reasoning_effort": effort}
    assert call(server.port, "POST", CHAT, body).status == 200
    texts = [s.text for s in engine.segments]
    assert texts[-2] == ("think" if thinking else "response")
    said = [t for t in texts if "thinking_effort=" in t]
    assert said == ([] if level is None else [said[0]])
    assert level is None or f"`thinking_effort={level}`" in said[0]


def test_no_thinking_default_is_overridden_by_request(engine):
    with serving(scripted_service(engine, thinking=False)) as srv:
        call(srv.port, "POST", CHAT, {"messages": USER})
        assert engine.segments[-2].text == "response"
        call(srv.port, "POST", CHAT, {"messages": USER, "reasoning_effort": "high"})
        assert engine.segments[-2].text == "think"


def test_every_request_starts_from_a_reset_engine(server, engine):
    for _ in range(3):
        call(server.port, "POST", CHAT, {"messages": USER})
    call(server.port, "POST", "/v1/completions", {"prompt": "x"})
    assert engine.resets == 4


# ---- finish reasons and context ----------------------------------------------

def test_length_when_max_tokens_is_reached(server, engine):
    body = call(server.port, "POST", CHAT, {"messages": USER, "max_tokens": 3}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_max_tokens_is_capped_by_the_room_left(engine):
    small = ScriptedEngine([xtml_answer("a", "b")], ctx_max=80)
    with serving(scripted_service(small)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 1000}).json()
    room = 80 - len(small.prompts[0])
    assert 0 < room < 1000 and small.params[0].max_tokens == room
    assert body["choices"][0]["finish_reason"] == "stop"   # the two-token answer fits


def test_length_when_the_context_fills(engine):
    engine.replies = [xtml_answer(*["word "] * 40)]
    engine.context_full_after = 5
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 100}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["waste"]["context_full"] is True and body["usage"]["completion_tokens"] == 5


def test_prompt_longer_than_context(engine):
    small = ScriptedEngine(ctx_max=20)
    with serving(scripted_service(small)) as srv:
        assert_error(call(srv.port, "POST", CHAT, {"messages": USER}), 400,
                     code="context_length_exceeded")
        assert_error(call(srv.port, "POST", "/v1/completions", {"prompt": "y" * 50}), 400,
                     code="context_length_exceeded")
        assert call(srv.port, "POST", "/v1/completions", {"prompt": "y"}).status == 200
    assert len(small.prompts) == 1


# ---- other chat formats ---------------------------------------------------------

KIMI_CHAT = {"system": ["<|im_system|>system<|im_middle|>", "<|im_end|>"],
             "user": ["<|im_user|>user<|im_middle|>", "<|im_end|>"],
             "assistant": ["<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"],
             "open": "<|im_assistant|>assistant<|im_middle|>"}


def test_template_format_serves_plain_chat_and_refuses_the_rest(tmp_path):
    (tmp_path / "chat.json").write_text(json.dumps(KIMI_CHAT))
    engine = ScriptedEngine([["Hi", " there", "<|im_end|>"]], specials=KIMI_LINEAR_SPECIALS)
    with serving(scripted_service(engine, model_dir=str(tmp_path))) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER}).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
        assert body["choices"][0]["finish_reason"] == "stop"
        assert call(srv.port, "GET", "/v1/models").json()["data"][0]["waste"]["chat_format"] == "chat.json"
        # Tools on chat.json need a grammar, and a scripted engine has no logits to mask.
        assert_error(call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS}), 400,
                     param="tools", code="structured_output_unavailable")
        # An effort is accepted, and reported unused: the template has no reasoning channel.
        effort = call(srv.port, "POST", CHAT, {"messages": USER, "reasoning_effort": "high"}).json()
        assert effort["waste"]["reasoning"] == "unsupported"
        assert_error(call(srv.port, "POST", CHAT, {"messages": USER,
                                                   "response_format": {"type": "json_object"}}),
                     400, param="response_format")
        tool_turn = [*USER, {"role": "tool", "tool_call_id": "c", "content": "x"}]
        assert_error(call(srv.port, "POST", CHAT, {"messages": tool_turn}), 400, param="messages[1]")
    assert len(engine.prompts) == 2


def test_no_chat_format_keeps_the_other_endpoints():
    engine = ScriptedEngine([["more", " text"]])
    service = Service(engine, ScriptedLibrary(), NoChatFormat(["no XTML markers", "chat.json: missing"]),
                      ServiceOptions(model_id="plain"))
    with serving(service) as srv:
        err = assert_error(call(srv.port, "POST", CHAT, {"messages": USER}), 400,
                           code="unsupported_chat_format")
        assert "no XTML markers" in err["message"] and "chat.json: missing" in err["message"]
        assert call(srv.port, "GET", "/health").status == 200
        assert call(srv.port, "GET", "/v1/models").json()["data"][0]["waste"]["chat_format"] == "none"
        body = call(srv.port, "POST", "/v1/completions", {"prompt": "some"}).json()
        assert body["choices"][0]["text"] == "more text"


def test_context_full_when_max_tokens_was_lowered_to_the_room_left():
    long = xtml_answer(*["word "] * 40, thinking=["hm"])
    with serving(scripted_service(ScriptedEngine([long]))) as srv:
        prompt = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 1}).json()
    room = 5
    engine = ScriptedEngine([long], ctx_max=prompt["usage"]["prompt_tokens"] + room)
    with serving(scripted_service(engine)) as srv:
        cut = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 100}).json()
        asked = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": room - 2}).json()
    assert engine.params[0].max_tokens == room   # lowered to the room left
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == room
    assert cut["waste"]["context_full"] is True
    # Cut by the client's own max_tokens, with room to spare: the context is not full.
    assert asked["choices"][0]["finish_reason"] == "length" and asked["waste"]["context_full"] is False


def test_a_field_the_server_does_not_read_is_named_once_in_the_log(engine):
    lines: list[str] = []
    with serving(scripted_service(engine), log=lines.append) as srv:
        for _ in range(2):
            assert call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 1,
                                                "extra_body": {"reasoning_effort": "none"},
                                                "user": "ann"}).status == 200
    named = [line for line in lines if "extra_body" in line]
    assert len(named) == 1 and named[0].startswith("/v1/chat/completions:")
    assert named[0].endswith("(named once): extra_body")   # `user` is a field the server knows


def test_a_template_that_cannot_carry_tools_says_why_unless_they_are_left_out(tmp_path):
    no_system = {key: value for key, value in KIMI_CHAT.items() if key != "system"}
    (tmp_path / "chat.json").write_text(json.dumps(no_system))
    engine = ScriptedEngine([["Hi", "<|im_end|>"]], specials=KIMI_LINEAR_SPECIALS)
    with serving(scripted_service(engine, model_dir=str(tmp_path))) as srv:
        err = assert_error(call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS}), 400,
                           param="tools")
        assert "no system turn to declare them in" in err["message"]
        left_out = call(srv.port, "POST", CHAT, {"messages": USER, "tools": TOOLS,
                                                 "tool_choice": "none"})
        assert left_out.status == 200, left_out.body
