"""Ollama's API through the official `ollama` client, on the reference engine's containers (random
weights): the listings, chat and generate streamed and blocking, format, think, options, images,
and errors. Each reply is compared with the same request through /v1/chat/completions or
/v1/completions: one internal request, whatever the dialect."""
from __future__ import annotations

import base64
import json

import jsonschema
import ollama
import pytest

from scripted import call, raw_exchange, real_service, serving, tiny_png

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(lib_path, k3_container):
    lines: list[str] = []
    with real_service(lib_path, k3_container, thinking=False) as service, \
            serving(service, log=lines.append) as server:
        server.lines = lines
        yield server


@pytest.fixture(scope="module")
def client(srv):
    with ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=120) as opened:
        yield opened


def openai_chat(port: int, **body) -> dict:
    resp = call(port, "POST", CHAT, body)
    assert resp.status == 200, resp.body
    return resp.json()["choices"][0]


def ollama_error(resp, status: int, names: str = "") -> str:
    """An error in Ollama's shape: {"error": message}, the message naming the field."""
    assert resp.status == status, resp.body
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert names in body["error"]
    return body["error"]


# ---- the listings -----------------------------------------------------------------------

def test_list_show_ps_and_version_describe_the_served_model(client, srv):
    (listed,) = client.list().models
    assert listed.model == "real:latest" and listed.details.format == "waste"
    assert listed.details.family == srv.service.engine.info.arch
    shown = client.show("real")
    assert client.show("real:latest") == shown
    context = srv.service.engine.info.ctx_max
    assert shown.modelinfo[f"{listed.details.family}.context_length"] == context
    assert shown.capabilities == ["completion", "tools", "thinking"]   # K3, no vision tower
    (loaded,) = client.ps().models
    assert loaded.model == "real:latest" and loaded.context_length == context
    version = call(srv.port, "GET", "/api/version").json()
    assert version["version"].count(".") == 2 and version["serve"]


# ---- chat -------------------------------------------------------------------------------

def test_chat_blocking_and_streamed_are_the_chat_completion_of_the_same_request(client, srv):
    options = {"num_predict": 8, "seed": 3, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    done = client.chat(model="real", messages=ASK, options=options)
    assert done.done and done.done_reason == "length" and done.eval_count == 8
    assert done.message.role == "assistant" and done.message.content
    assert done.prompt_eval_count > 0 and done.prompt_eval_duration > 0 and done.eval_duration > 0
    assert done.total_duration >= done.prompt_eval_duration + done.eval_duration
    same = openai_chat(srv.port, messages=ASK, max_tokens=8, seed=3, temperature=0.7, top_k=20,
                       top_p=0.9)
    assert done.message.content == same["message"]["content"]
    parts = list(client.chat(model="real", messages=ASK, options=options, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == done.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8
    assert parts[-1].message.content == ""


def test_tools_are_the_chat_completions_tools(client, srv):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    done = client.chat(model="real", messages=ASK, tools=tools,
                       options={"num_predict": 10, "seed": 4})
    same = openai_chat(srv.port, messages=ASK, tools=tools, max_tokens=10, seed=4)
    assert done.message.content == (same["message"]["content"] or "")
    assert done.prompt_eval_count == call(srv.port, "POST", CHAT, {
        "messages": ASK, "tools": tools, "max_tokens": 1}).json()["usage"]["prompt_tokens"]


def test_the_stream_is_ndjson_and_is_the_default(srv):
    resp = call(srv.port, "POST", "/api/chat", {"model": "real", "messages": ASK,
                                                "options": {"num_predict": 3}})
    assert resp.status == 200 and resp.headers["content-type"] == "application/x-ndjson"
    lines = resp.body.decode().split("\n")
    assert lines[-1] == "" and all(json.loads(line) for line in lines[:-1])
    final = json.loads(lines[-2])
    assert final["done"] is True and final["waste"]["completion_tokens"] == 3
    blocking = call(srv.port, "POST", "/api/chat", {"model": "real", "messages": ASK,
                                                    "stream": False, "options": {"num_predict": 3}})
    assert blocking.headers["content-type"] == "application/json"


def test_options_are_honoured_refused_or_accepted_without_effect(client, srv):
    base = {"num_predict": 12, "seed": 5}
    text = client.chat(model="real", messages=ASK, options=base).message.content
    assert client.chat(model="real", messages=ASK, options={**base, "seed": 6}).message.content != text
    assert client.chat(model="real", messages=ASK, options={**base, "temperature": 0}).message.content \
        == openai_chat(srv.port, messages=ASK, max_tokens=12, temperature=0)["message"]["content"]
    stop = text.strip()[2:5]
    cut = client.chat(model="real", messages=ASK, options={**base, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.message.content
    assert text.startswith(cut.message.content)
    # Samplers serve does not have: refused unless neutral; load-time options change nothing.
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="real", messages=ASK, options={**base, "repeat_penalty": 1.3})
    assert refused.value.status_code == 400 and "options.repeat_penalty" in refused.value.error
    neutral = {"repeat_penalty": 1.0, "presence_penalty": 0, "mirostat": 0, "num_thread": 2,
               "num_gpu": 1, "use_mmap": True, "num_keep": 4, "num_ctx": 2048}
    assert client.chat(model="real", messages=ASK, options={**base, **neutral}).message.content == text
    client.chat(model="real", messages=ASK, options={**base, "frobnicate": 1})
    assert any("options.frobnicate" in line for line in srv.lines)


def test_num_ctx_above_the_served_context_is_a_400(client, srv):
    context = srv.service.engine.info.ctx_max
    assert client.chat(model="real", messages=ASK, options={"num_ctx": context,
                                                            "num_predict": 1}).done
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="real", messages=ASK, options={"num_ctx": context + 1})
    assert caught.value.status_code == 400
    assert "options.num_ctx" in caught.value.error and str(context) in caught.value.error


def test_format_json_and_a_schema_are_enforced(client):
    done = client.chat(model="real", messages=ASK, format=SCHEMA,
                       options={"num_predict": 60, "seed": 1, "temperature": 1.0})
    assert done.done_reason == "stop"
    jsonschema.validate(json.loads(done.message.content), SCHEMA)
    streamed = list(client.chat(model="real", messages=ASK, format=SCHEMA, stream=True,
                                options={"num_predict": 60, "seed": 2, "temperature": 1.0}))
    jsonschema.validate(json.loads("".join(p.message.content for p in streamed)), SCHEMA)
    loose = client.generate(model="real", prompt="Reply in JSON.", format="json",
                            options={"num_predict": 200, "seed": 4})
    if loose.done_reason == "stop":   # a random model may write one long object
        assert isinstance(json.loads(loose.response), dict)
    else:
        assert loose.response.lstrip().startswith("{")


@pytest.mark.parametrize("think, reasoning", [(True, "on"), (False, "off"), ("low", "low"),
                                              ("medium", "high"), ("high", "high"), ("max", "max")])
def test_think_maps_onto_the_reasoning_effort(srv, think, reasoning):
    body = {"model": "real", "messages": ASK, "think": think, "stream": False,
            "options": {"num_predict": 6, "seed": 2}}
    reply = call(srv.port, "POST", "/api/chat", body).json()
    assert reply["waste"]["reasoning"] == reasoning
    effort = {True: None, False: "none"}.get(think, think)
    same = openai_chat(srv.port, messages=ASK, max_tokens=6, seed=2,
                       **({"reasoning_effort": effort} if effort else {}))
    if think is True:   # the server's default is off here: only think asks for reasoning
        assert same["message"].get("reasoning_content") is None
    else:
        assert reply["message"].get("thinking") == same["message"].get("reasoning_content")
    if think is not False:
        assert reply["message"]["thinking"] and reply["message"]["content"] == ""


def test_generate_is_a_chat_of_its_system_and_prompt_or_raw_a_completion(client, srv):
    options = {"num_predict": 6, "seed": 7}
    done = client.generate(model="real", prompt="The lighthouse", system="Be brief.",
                           options=options)
    same = openai_chat(srv.port, max_tokens=6, seed=7, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The lighthouse"}])
    assert done.response == same["message"]["content"] and done.eval_count == 6
    raw = client.generate(model="real", prompt="The lighthouse", raw=True, options=options)
    completion = call(srv.port, "POST", COMPLETIONS, {"prompt": "The lighthouse", "max_tokens": 6,
                                                      "seed": 7}).json()["choices"][0]
    assert raw.response == completion["text"]
    streamed = list(client.generate(model="real", prompt="The lighthouse", raw=True,
                                    options=options, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done


def test_logprobs_ride_on_the_pieces_they_belong_to(client, srv):
    done = client.chat(model="real", messages=ASK, logprobs=True, top_logprobs=2,
                       options={"num_predict": 5, "seed": 1})
    assert len(done.logprobs) == done.eval_count   # every token is answer text here
    assert all(len(entry.top_logprobs) == 2 for entry in done.logprobs)
    body = call(srv.port, "POST", "/api/chat", {"model": "real", "messages": ASK, "stream": False,
                                                "logprobs": True, "options": {"num_predict": 5,
                                                                              "seed": 1}}).json()
    text = bytes(b for entry in body["logprobs"] for b in entry["bytes"]).decode("utf-8", "replace")
    assert text == body["message"]["content"] == done.message.content
    parts = list(client.chat(model="real", messages=ASK, logprobs=True, stream=True,
                             options={"num_predict": 5, "seed": 1}))
    assert [e.token for p in parts for e in p.logprobs or []] == [e.token for e in done.logprobs]


def test_a_chat_with_no_messages_loads_the_model(srv):
    for keep_alive in ("5m", 0, -1):
        for path, body in (("/api/chat", {"messages": []}), ("/api/generate", {})):
            reply = call(srv.port, "POST", path, {"model": "real", "keep_alive": keep_alive,
                                                  **body}).json()
            assert reply["done"] is True and reply["done_reason"] == "load"


# ---- images -----------------------------------------------------------------------------

def test_images_are_the_chat_completions_image_parts(lib_path, k3_vision_container):
    png = tiny_png(8, 8)
    with real_service(lib_path, k3_vision_container, vision=True, thinking=False) as service, \
            serving(service) as srv, ollama.Client(host=f"http://127.0.0.1:{srv.port}") as client:
        assert "vision" in client.show("real").capabilities
        options = {"num_predict": 5, "seed": 9}
        seen = client.chat(model="real", options=options, messages=[
            {"role": "user", "content": "What is this?", "images": [png]}])
        same = openai_chat(srv.port, max_tokens=5, seed=9, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                       + base64.b64encode(png).decode()}},
            {"type": "text", "text": "What is this?"}]}])
        assert seen.message.content == same["message"]["content"]
        plain = client.chat(model="real", options=options, messages=[
            {"role": "user", "content": "What is this?"}])
        assert seen.prompt_eval_count > plain.prompt_eval_count   # the image's positions
        described = client.generate(model="real", prompt="What is this?", images=[png],
                                    options=options)
        assert described.response == seen.message.content
        bad = call(srv.port, "POST", "/api/chat", {"model": "real", "messages": [
            {"role": "user", "content": "x", "images": ["bm90IGFuIGltYWdl"]}]})
        ollama_error(bad, 400, "messages[0].images[0]")
        ollama_error(call(srv.port, "POST", "/api/generate", {"model": "real", "prompt": "x",
                                                              "images": ["%%%"]}), 400, "images[0]")


def test_images_need_a_vision_tower(srv):
    resp = call(srv.port, "POST", "/api/chat", {"model": "real", "messages": [
        {"role": "user", "content": "x", "images": [base64.b64encode(tiny_png()).decode()]}]})
    ollama_error(resp, 400, "messages[0]")


# ---- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, names", [
    ("/api/chat", {"messages": ASK}, "model is required"),
    ("/api/chat", {"model": "real", "messages": "hi"}, "messages"),
    ("/api/chat", {"model": "real", "messages": [{"role": "user", "content": 3}]},
     "messages[0].content"),
    ("/api/chat", {"model": "real", "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/api/chat", {"model": "real", "messages": ASK, "options": {"temperature": "hot"}},
     "options.temperature"),
    ("/api/chat", {"model": "real", "messages": ASK, "options": {"num_predict": "many"}},
     "options.num_predict"),
    ("/api/chat", {"model": "real", "messages": ASK, "options": [1]}, "options"),
    ("/api/chat", {"model": "real", "messages": ASK, "think": "extreme"}, "think"),
    ("/api/chat", {"model": "real", "messages": ASK, "format": 3}, "format"),
    ("/api/chat", {"model": "real", "messages": ASK, "format": "yaml"}, "format"),
    ("/api/chat", {"model": "real", "messages": ASK, "stream": "yes"}, "stream"),
    ("/api/chat", {"model": "real", "messages": ASK, "keep_alive": "forever"}, "keep_alive"),
    ("/api/chat", {"model": "real", "messages": ASK, "top_logprobs": 21}, "top_logprobs"),
    ("/api/chat", {"model": "real", "messages": ASK, "tools": "get_weather"}, "tools"),
    ("/api/chat", {"model": "real", "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, *ASK]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/api/generate", {"model": "real", "prompt": 3}, "prompt"),
    ("/api/generate", {"model": "real", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/api/generate", {"model": "real", "prompt": "x", "context": [1, 2]}, "context"),
    ("/api/generate", {"model": "real", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "real", "prompt": "x", "raw": True, "system": "s"}, "system"),
    ("/api/generate", {"model": "real", "prompt": "x", "raw": True, "format": "json"}, "format"),
    ("/api/generate", {"model": "real", "prompt": "x", "raw": True, "think": True}, "think"),
    ("/api/show", {}, "model is required"),
])
def test_bad_requests_are_400s_in_ollamas_shape_naming_the_field(srv, path, body, names):
    for stream in (None, True):   # refused before a stream opens, streamed or not
        sent = body if stream is None else {**body, "stream": body.get("stream", stream)}
        ollama_error(call(srv.port, "POST", path, sent), 400, names)


def test_errors_of_the_transport_are_in_ollamas_shape_too(srv):
    ollama_error(call(srv.port, "POST", "/api/chat", b"{nope"), 400)
    ollama_error(call(srv.port, "POST", "/api/pull", {"model": "llama3"}), 404, "/api/pull")
    ollama_error(call(srv.port, "GET", "/api/chat"), 405)
    raw = raw_exchange(srv.port, b"POST /api/chat HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 99999999999\r\n\r\n", shut_write=True)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and set(json.loads(body)) == {"error"}


def test_the_client_raises_ollamas_errors(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="real", messages=[{"role": "user", "content": "x"}], think="extreme")
    assert caught.value.status_code == 400 and "think" in caught.value.error


def test_a_model_with_no_chat_format_still_answers_a_raw_generate(lib_path, plain_container):
    with real_service(lib_path, plain_container) as service, serving(service) as srv, \
            ollama.Client(host=f"http://127.0.0.1:{srv.port}") as client:
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model="real", messages=ASK)
        assert caught.value.status_code == 400 and "no usable chat format" in caught.value.error
        assert client.show("real").capabilities == ["completion"]
        raw = client.generate(model="real", prompt="The", raw=True, options={"num_predict": 3})
        assert raw.done and raw.eval_count == 3


def test_smollm2_answers_through_the_ollama_client(lib_path, smollm2):
    """A real chat model (ChatML, no reasoning channel): greedy, the same words as chat
    completions; `think` is accepted and left unused."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with real_service(lib_path, smollm2) as service, serving(service) as srv, \
            ollama.Client(host=f"http://127.0.0.1:{srv.port}") as client:
        # serve's generic call format: tools with the grammar (structured output is on here)
        assert client.show("real").capabilities == ["completion", "tools"]
        done = client.chat(model="real", messages=question, think=True,
                           options={"temperature": 0, "num_predict": 16})
        same = openai_chat(srv.port, messages=question, temperature=0, max_tokens=16)
        assert done.message.content == same["message"]["content"] and "Paris" in done.message.content
        assert done.message.thinking is None
        reply = call(srv.port, "POST", "/api/generate", {
            "model": "real", "prompt": "What is the capital of France?", "stream": False,
            "think": "high", "options": {"temperature": 0, "num_predict": 16}}).json()
        assert reply["response"] == done.message.content
        assert reply["waste"]["reasoning"] == "unsupported"


def test_tools_are_no_capability_where_a_request_with_them_is_refused(lib_path,
                                                                      kimi_linear_container):
    # chat.json's calls need the grammar, which needs the engine's logits to decode with.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with real_service(lib_path, kimi_linear_container, eval_logits=False) as service, \
            serving(service) as srv, ollama.Client(host=f"http://127.0.0.1:{srv.port}") as client:
        assert "tools" not in client.show("real").capabilities
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model="real", messages=ASK, tools=tools)
        assert caught.value.status_code == 400 and "structured output" in caught.value.error
