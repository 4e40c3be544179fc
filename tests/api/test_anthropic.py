"""The Anthropic Messages API, through the official `anthropic` client and raw sockets."""
from __future__ import annotations

import json

import anthropic
import pytest

from agents import (CLAUDE_CODE_HEADERS, claude_code_billing, claude_code_first_message,
                    claude_code_request)
from scripted import (ScriptedEngine, call, data_url, raw_exchange, real_server_with_cache,
                      real_service, scripted_service, serving, status_of, tiny_png, wait_idle, waiting_in_line,
                      xtml_answer, xtml_tool_call)
from serve.dialects import seal
from serve.formats.xtml import render as xtml
from serve.snapshots.reply_memory import ReplyMemory

MESSAGES = "/v1/messages"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"]}}]
OFF = {"type": "disabled"}


def client_for(port: int, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0,
                               timeout=60)


@pytest.fixture(scope="module")
def real(lib_path, k3_container, tmp_path_factory):
    with real_server_with_cache(lib_path, k3_container, tmp_path_factory.mktemp("cache")) as (
            service, srv), client_for(srv.port) as client:
        yield client, service, srv


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_text(engine: ScriptedEngine, n: int = -1) -> str:
    return engine.detokenize(engine.prompts[n]).decode()


# ---- the official client on the reference engine ------------------------------------


def test_blocking_and_streaming_give_the_same_message(real):
    client, _, _ = real
    done = client.messages.create(model="any-name", max_tokens=8, messages=ASK, temperature=0,
                                  thinking=OFF)
    assert done.type == "message" and done.role == "assistant" and done.id.startswith("msg_")
    assert done.model == "real" and done.stop_reason == "max_tokens" and done.stop_sequence is None
    assert [block.type for block in done.content] == ["text"] and text_of(done)
    assert done.usage.output_tokens == 8
    with client.messages.stream(model="claude-haiku", max_tokens=8, messages=ASK, temperature=0,
                                thinking=OFF) as stream:
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(done)
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 8
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert total == done.usage.input_tokens + done.usage.cache_read_input_tokens


def test_thinking_on_gives_a_signed_thinking_block_and_off_gives_none(real):
    client, _, _ = real
    budget = {"type": "enabled", "budget_tokens": 2048}
    on = client.messages.create(model="m", max_tokens=6, messages=ASK, temperature=0, thinking=budget)
    thinking = on.content[0]
    assert thinking.type == "thinking" and thinking.thinking
    assert seal.verify(thinking.thinking, thinking.signature)
    off = client.messages.create(model="m", max_tokens=6, messages=ASK, temperature=0, thinking=OFF)
    assert all(block.type != "thinking" for block in off.content)
    with client.messages.stream(model="m", max_tokens=6, messages=ASK, temperature=0,
                                thinking=budget) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "thinking"
    assert streamed.content[0].signature == thinking.signature   # the same text, greedy


def test_count_tokens_is_the_prompt_generation_would_read(real):
    client, _, _ = real
    fields = dict(model="m", messages=ASK, tools=TOOLS, system="Be brief.", thinking=OFF)
    counted = client.messages.count_tokens(**fields)
    done = client.messages.create(max_tokens=2, **fields)
    assert counted.input_tokens == done.usage.input_tokens + done.usage.cache_read_input_tokens


def test_multi_turn_reuses_the_prefix_and_brings_back_signed_thinking(real):
    client, service, _ = real
    thinking = {"type": "enabled", "budget_tokens": 1024}
    generation_prompt = len(service.engine.tokenize_segments(xtml.generation_prompt(True)))
    messages = [{"role": "user", "content": "Plan a trip to the tides."}]
    previous_history = None
    for turn in range(3):
        reply = client.messages.create(model="m", max_tokens=5, messages=messages, thinking=thinking,
                                       temperature=0, system="You plan trips.")
        prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
        if previous_history is not None:
            assert reply.usage.cache_read_input_tokens >= previous_history
        previous_history = prompt - generation_prompt
        messages = messages + [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                               {"role": "user", "content": f"And step {turn + 2}?"}]
    # The thinking that comes back signed is in the prompt; forged, it is left out.
    assert messages[-2]["content"][0]["type"] == "thinking"
    signed = client.messages.count_tokens(model="m", messages=messages, thinking=thinking).input_tokens
    forged = json.loads(json.dumps(messages))
    forged[-2]["content"][0]["signature"] = seal.sign("something else")
    left_out = client.messages.count_tokens(model="m", messages=forged, thinking=thinking).input_tokens
    reasoning = messages[-2]["content"][0]["thinking"]
    assert signed - left_out == len(service.engine.tokenize(reasoning))


def test_a_tool_loop_on_the_reference_engine_reuses_the_prefix_from_turn_two(real):
    # With tool_choice auto the random model calls no tools: each turn, the client adds
    # the call it "ran" to the reply it got, as a tool loop's history reads. (A forced
    # tool_choice puts a note after the conversation, which no next turn repeats.)
    client, service, _ = real
    generation_prompt = len(service.engine.tokenize_segments(xtml.generation_prompt(False)))
    messages = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]
    previous_history = None
    for turn, city in enumerate(["Paris", "Oslo", "Rome"]):
        reply = client.messages.create(model="m", max_tokens=4, messages=messages, tools=TOOLS,
                                       thinking=OFF, temperature=0)
        usage = reply.usage
        if previous_history is not None:
            assert usage.cache_read_input_tokens >= previous_history
        previous_history = usage.input_tokens + usage.cache_read_input_tokens - generation_prompt
        use = {"type": "tool_use", "id": f"toolu_{turn}", "name": "get_weather", "input": {"city": city}}
        messages = messages + [
            {"role": "assistant", "content": [b.model_dump() for b in reply.content] + [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": f"{city}: 18 degrees"}]}]


def test_a_forced_call_on_the_reference_engine_goes_round_trip(real):
    # A named tool_choice makes the random model make that one call (constrained decoding);
    # one at most, or now and then it chains calls past max_tokens (Messages has no seed).
    client, _, _ = real
    with client.messages.stream(model="m", max_tokens=400, messages=ASK, tools=TOOLS, thinking=OFF,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                temperature=1.5) as stream:
        called = stream.get_final_message()
    (use,) = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    assert called.stop_reason == "tool_use"
    answer = client.messages.create(model="m", max_tokens=8, tools=TOOLS, thinking=OFF,
                                    tool_choice={"type": "none"}, messages=ASK + [
                                        {"role": "assistant", "content": [use.model_dump()]},
                                        {"role": "user", "content": [{"type": "tool_result",
                                                                      "tool_use_id": use.id,
                                                                      "content": "18 degrees"}]}])
    # The random model may close its response at once (seen 1 in ~4,500: close, "response",
    # sep, close), so an empty answer is a faithful one; a tool call never is, under "none".
    assert all(block.type == "text" for block in answer.content)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens >= 1


# ---- tools, on a scripted reply -------------------------------------------------------


def test_tool_round_trip_blocking_and_streaming():
    engine = ScriptedEngine([xtml_tool_call("get_weather", {"city": "Paris"}), xtml_answer("Sunny."),
                             xtml_tool_call("get_weather", {"city": "Paris"})])
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        first = client.messages.create(model="m", max_tokens=100, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "any"})
        (use,) = first.content
        assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
        assert use.input == {"city": "Paris"} and first.stop_reason == "tool_use"
        followup = ASK + [{"role": "assistant", "content": [use.model_dump()]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "18 degrees and sunny"}]}]
        second = client.messages.create(model="m", max_tokens=100, messages=followup, tools=TOOLS)
        assert text_of(second) == "Sunny." and second.stop_reason == "end_turn"
        rendered = prompt_text(engine)
        assert '<|open|>call tool="get_weather" index="1"<|sep|>' in rendered
        assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>18 degrees and sunny' \
               in rendered
        with client.messages.stream(model="m", max_tokens=100, messages=ASK, tools=TOOLS) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"
    # tool_choice any reaches the prompt as K3's required tool choice.
    assert "tool_choice=required" in prompt_text(engine, 0)


def test_tool_result_error_images_and_system_blocks_reach_the_prompt():
    engine = ScriptedEngine([xtml_answer("ok")])
    messages = [ASK[0], {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                     "content": [{"type": "text", "text": "service down"}]},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": data_url(tiny_png()).split(",", 1)[1]}},
                    {"type": "text", "text": "What now?"}]},
                ]
    with serving(scripted_service(engine, thinking=False, vision=True)) as srv:
        resp = call(srv.port, "POST", MESSAGES, {
            "model": "m", "max_tokens": 10, "messages": messages, "tools": TOOLS,
            "system": [{"type": "text", "text": "First."}, {"type": "text", "text": "Second."}]})
    assert resp.status == 200, resp.body
    rendered = prompt_text(engine)
    assert "First.\n\nSecond." in rendered
    assert "Error:\n\nservice down" in rendered
    assert rendered.index("service down") < rendered.index("<|media_begin|>") < rendered.index("What now?")


def test_a_users_text_before_the_tool_results_of_a_call_is_accepted():
    # Anthropic wants the results first; the model reads the same turn either way.
    engine = ScriptedEngine([xtml_answer("ok")])
    messages = [ASK[0], {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain"},
                    {"type": "text", "text": "Also:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}]}]
    with serving(scripted_service(engine, thinking=False)) as srv:
        resp = call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 10,
                                                 "messages": messages, "tools": TOOLS})
    assert resp.status == 200, resp.body
    assert prompt_text(engine).index("rain") < prompt_text(engine).index("Also:") \
        < prompt_text(engine).index("sun")


# ---- the stream's grammar -------------------------------------------------------------


def test_stream_event_order_is_anthropics():
    reply = ["mull", "ing", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>",
             "Let me look."] + xtml_tool_call("get_weather", {"city": "Oslo"})
    engine = ScriptedEngine([reply])
    with serving(scripted_service(engine, thinking=True, prefill_chunk=16)) as srv:
        resp = call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 100, "stream": True,
                                                 "messages": [{"role": "user", "content": "y" * 200}],
                                                 "tools": TOOLS})
    assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
    events = resp.named_events()
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    # Three blocks, each opened, said in deltas (how many: as the tokens were taken in
    # batches, serve/http/sinks.py) and closed; then the message's end.
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    opened = [i for i, name in enumerate(names) if name == "content_block_start"]
    closed = [i for i, name in enumerate(names) if name == "content_block_stop"]
    assert len(opened) == len(closed) == 3 and opened[0] == 1 and closed[-1] == len(names) - 3
    assert opened[1:] == [b + 1 for b in closed[:-1]]   # one block after the other
    blocks = [list(range(a + 1, b)) for a, b in zip(opened, closed)]
    assert all(blocks)
    assert all(names[k] == "content_block_delta" for block in blocks for k in block)
    # Prefill progress is comments; pings go with heartbeats, and none was due in this reply.
    assert resp.comments()
    data = [d for _, d in events]
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] == len(engine.prompts[0])   # known before prefill
    thinking = [data[k]["delta"] for k in blocks[0]]
    assert [d["type"] for d in thinking[:-1]] == ["thinking_delta"] * (len(thinking) - 1)
    assert "".join(d["thinking"] for d in thinking[:-1]) == "mulling"
    assert thinking[-1] == {"type": "signature_delta", "signature": seal.sign("mulling")}
    assert data[opened[1]]["content_block"] == {"type": "text", "text": ""}
    assert "".join(data[k]["delta"]["text"] for k in blocks[1]) == "Let me look."
    tool = data[opened[2]]["content_block"]
    assert tool["type"] == "tool_use" and tool["name"] == "get_weather" and tool["input"] == {}
    partial = "".join(data[k]["delta"]["partial_json"] for k in blocks[2])
    assert json.loads(partial) == {"city": "Oslo"}
    for index, (a, b) in enumerate(zip(opened, closed)):
        assert {d["index"] for d in data[a:b + 1]} == {index}
    delta = data[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["input_tokens"] == len(engine.prompts[0]) and delta["usage"]["output_tokens"]


def test_stop_sequence_is_reported():
    engine = ScriptedEngine([xtml_answer("one ", "two ", "three")])
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        done = client.messages.create(model="m", max_tokens=50, messages=ASK,
                                      stop_sequences=["three", "two"])
    assert text_of(done) == "one " and done.stop_reason == "stop_sequence" and done.stop_sequence == "two"


# ---- what Claude Code sends -----------------------------------------------------------


def test_a_claude_code_session_is_accepted_and_reuses_its_prefix(snapshot_cache):
    engine = ScriptedEngine([xtml_tool_call("Tool3", {"option_0": "src"}),
                             xtml_tool_call("Tool5", {"option_0": "README"}), xtml_answer("Done.")],
                            ctx_max=200_000)
    lines: list[str] = []
    service = scripted_service(engine, prefix_cache=snapshot_cache, log=lines.append)
    messages = [claude_code_first_message("Tidy up the README.")]
    opening = len(engine.tokenize(xtml.render_text(xtml.generation_prompt(True)), markup=True))
    previous = None
    with serving(service, api_key="sk-local", log=lines.append) as srv:
        for turn in range(3):
            body = claude_code_request(messages, cch=f"{turn:03d}f{turn}")   # a new one each turn
            resp = call(srv.port, "POST", MESSAGES + "?beta=true", body,
                        headers={**CLAUDE_CODE_HEADERS, "x-api-key": "sk-local"})
            assert resp.status == 200, resp.body
            events = [data for name, data in resp.named_events() if name != "ping"]
            usage = events[-2]["usage"]
            if previous is not None:
                assert usage["cache_read_input_tokens"] >= previous
            previous = usage["input_tokens"] + usage["cache_read_input_tokens"] - opening
            blocks = {d["index"]: d["content_block"] for d in events if d["type"] == "content_block_start"}
            for d in events:
                if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
                    blocks[d["index"]].setdefault("json", "")
                    blocks[d["index"]]["json"] += d["delta"]["partial_json"]
            content = [{"type": "tool_use", "id": b["id"], "name": b["name"], "input": json.loads(b["json"])}
                       if b["type"] == "tool_use" else b for b in blocks.values()]
            results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "file contents " * 50}
                       for b in content if b["type"] == "tool_use"]
            messages = messages + [{"role": "assistant", "content": content},
                                   {"role": "system", "content": "The user switched branches."},
                                   {"role": "user", "content": results + [{"type": "text", "text": "go on"}]}]
        assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert len(json.dumps(body["tools"])) > 64_000
    rendered = prompt_text(engine)
    assert "Now the system is invoked with `thinking_effort=high`." in rendered
    assert rendered.count("<|open|>message role=\"system\"<|sep|>The user switched branches.") == 2
    assert "<system-reminder>\nToday's date is 2026-12-01.\n</system-reminder>\n\nTidy up" in rendered
    assert "web_search" not in rendered
    assert [line for line in lines if "tools left out" in line] == [
        "/v1/messages: tools left out (the server cannot run them): web_search (web_search_20250305)"] * 3
    assert "x-anthropic-billing-header" not in rendered
    assert [line for line in lines if "billing" in line] == [
        "/v1/messages: system[0] is Claude Code's billing header, which changes on every request: "
        "it is left out of the prompt (logged once)"]


def test_requests_differing_only_in_the_billing_header_share_their_whole_prefix(
        lib_path, k3_container, snapshot_cache):
    with real_service(lib_path, k3_container, thinking=False, prefix_cache=snapshot_cache,
                      reply_memory=ReplyMemory()) as service, serving(service) as srv, \
            client_for(srv.port) as client:
        billing_header_is_no_prompt(client, srv.port)


def billing_header_is_no_prompt(client: anthropic.Anthropic, port: int) -> None:
    system = [{"type": "text", "text": "You review code."}]
    messages = [{"role": "user", "content": "Is this loop right? for i in range(10): pass"}]
    # Long enough that the state after the reply is worth a snapshot (serve/service/settle.py).
    first = client.messages.create(model="m", max_tokens=40, messages=messages, temperature=0,
                                   system=[claude_code_billing("a81f0")] + system)
    wait_idle(port)   # the reply's state is settled for the next turn
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": "And with a while loop?"}]
    second = client.messages.create(model="m", max_tokens=6, messages=messages, temperature=0,
                                    system=[claude_code_billing("c03d9")] + system)
    # Everything before the new message came from a snapshot: the first prompt and its reply.
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= before
    # The header is not in the prompt at all: counted with it or without, the same.
    counted = [client.messages.count_tokens(model="m", messages=messages, system=head + system)
               for head in ([claude_code_billing("77777")], [])]
    assert counted[0].input_tokens == counted[1].input_tokens
    only = client.messages.count_tokens(model="m", messages=messages,
                                        system=[claude_code_billing("12345")])
    alone = client.messages.count_tokens(model="m", messages=messages)
    assert only.input_tokens == alone.input_tokens   # a header alone leaves no system turn


def test_max_tokens_beyond_the_context_is_capped_not_refused():
    engine = ScriptedEngine([xtml_answer("fine")], ctx_max=300)
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        done = client.messages.create(model="m", max_tokens=32000, messages=ASK)
    assert text_of(done) == "fine" and engine.params[0].max_tokens == 300 - len(engine.prompts[0])


# ---- errors -----------------------------------------------------------------------------


def anthropic_error(resp, status: int, kind: str) -> str:
    assert resp.status == status, resp.body
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize("change, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"model": None}, "model"),
    ({"temperature": 5}, "temperature"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ({"messages": ASK + [{"role": "assistant", "content": "Sure"}]}, "messages[1]"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),   # no tools to call
    ({"tools": TOOLS, "messages": ASK + [   # a call whose result never comes
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {}}]},
        {"role": "user", "content": "And tomorrow?"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0].content[1].source"),
])
def test_bad_fields_are_named_in_anthropics_error_shape(change, field):
    body = {"model": "m", "max_tokens": 10, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with serving(scripted_service()) as srv:
        message = anthropic_error(call(srv.port, "POST", MESSAGES, body), 400, "invalid_request_error")
        assert call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 5, "messages": ASK}).status == 200
    assert field in message


def test_remote_image_urls_are_refused_naming_the_source():
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://example.com/cat.png"}}]}]
    with serving(scripted_service(vision=True)) as srv:
        message = anthropic_error(call(srv.port, "POST", MESSAGES,
                                       {"model": "m", "max_tokens": 5, "messages": messages}),
                                  400, "invalid_request_error")
    assert message.startswith("messages[0].content[0].source: remote image URLs are not fetched")


def test_the_official_client_raises_its_own_errors():
    with serving(scripted_service(), api_key="secret") as srv:
        with client_for(srv.port, "wrong") as bad, pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model="m", max_tokens=5, messages=ASK)
        assert caught.value.body["error"]["type"] == "authentication_error"
        with client_for(srv.port, "secret") as good:
            with pytest.raises(anthropic.BadRequestError) as caught:
                good.messages.create(model="m", max_tokens=5, messages=ASK, temperature=7)
            assert caught.value.body["error"]["type"] == "invalid_request_error"
            assert good.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
        # Bearer still works on the Anthropic paths.
        resp = call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 5, "messages": ASK},
                    headers={"Authorization": "Bearer secret"})
        assert resp.status == 200


def test_http_level_errors_are_anthropic_shaped():
    with serving(scripted_service()) as srv:
        anthropic_error(call(srv.port, "GET", MESSAGES), 405, "invalid_request_error")
        anthropic_error(call(srv.port, "POST", MESSAGES + "/batches", {}), 404, "not_found_error")
        anthropic_error(call(srv.port, "POST", MESSAGES, b"{nope"), 400, "invalid_request_error")
        raw = raw_exchange(srv.port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 99999999999\r\n\r\n", shut_write=True)
        assert status_of(raw) == 413 and b'"request_too_large"' in raw


def test_engine_failures_are_api_errors_before_and_after_the_stream_starts():
    engine = ScriptedEngine([xtml_answer("a", "b", "c")])

    def fail(n: int) -> None:
        if n == 1:
            raise RuntimeError("the disk went away")

    engine.before_token = fail
    lines: list[str] = []
    with serving(scripted_service(engine, thinking=False), log=lines.append) as srv:
        body = {"model": "m", "max_tokens": 10, "messages": ASK}
        message = anthropic_error(call(srv.port, "POST", MESSAGES, body), 500, "api_error")
        assert message.startswith("internal error (request id req-")   # the details are logged
        events = call(srv.port, "POST", MESSAGES, {**body, "stream": True}).named_events()
        assert [name for name, _ in events] == ["message_start", "content_block_start",
                                                "content_block_delta", "error"]
        assert events[-1][1]["error"]["type"] == "api_error"
        assert events[-1][1]["error"]["message"].startswith("internal error (request id req-")
        assert sum("internal error: RuntimeError: the disk went away" in line for line in lines) == 2
        engine.before_token = None
        assert call(srv.port, "POST", MESSAGES, body).status == 200


def test_a_queued_request_opens_its_stream_and_says_where_it_waits():
    # Interface 2: the service calls sink.queued(ahead) while a request waits for the engine.
    service = waiting_in_line(scripted_service(ScriptedEngine([xtml_answer("ok")]), thinking=False),
                              2, 1)
    with serving(service) as srv:
        resp = call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 10, "messages": ASK,
                                                 "stream": True})
    assert resp.comments() == ["queue 2", "queue 1"]
    events = resp.named_events()
    names = [name for name, _ in events]
    # message_start waits for the prompt, so it says its size (no heartbeat was due here).
    assert names[0] == "message_start" and names.count("message_start") == 1
    assert "ping" not in names and names[-1] == "message_stop"
    assert events[0][1]["message"]["usage"]["input_tokens"] == events[-2][1]["usage"]["input_tokens"]
    assert resp.body.index(b": queue 1") < resp.body.index(b"event: message_start")


def test_an_unanswered_tool_use_is_refused_in_anthropics_words():
    """The refusal names the client's message and the call, not OpenAI's tool_call_id."""
    messages = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}},
                                          {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                                           "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sun"}]},
        {"role": "assistant", "content": "Paris is sunny."},
        {"role": "user", "content": "And Lyon?"}]
    with serving(scripted_service()) as srv:
        message = anthropic_error(call(srv.port, "POST", MESSAGES, {
            "model": "m", "max_tokens": 5, "tools": TOOLS, "messages": messages}),
            400, "invalid_request_error")
    assert message.startswith("messages[1] calls tools whose results never come (toolu_2)"), message
    assert "tool_call_id" not in message and "tool message" not in message
