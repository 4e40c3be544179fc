"""The official `openai` client against the server: the shapes must parse as OpenAI's own."""
from __future__ import annotations

import json

import openai
import pytest

from scripted import ScriptedEngine, real_service, scripted_service, serving, xtml_tool_call

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client_for(port: int, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def real(lib_path, k3_container):
    with real_service(lib_path, k3_container, thinking=False) as service, serving(service) as srv:
        client = client_for(srv.port)
        yield client
        client.close()


def test_models(real):
    (model,) = real.models.list().data
    assert model.id == "real" and model.owned_by == "serve"
    assert real.models.retrieve("real").id == "real"
    with pytest.raises(openai.NotFoundError):
        real.models.retrieve("gpt-4")


def test_plain_chat_blocking_and_streaming(real):
    done = real.chat.completions.create(model="real", messages=ASK, max_tokens=8, temperature=0, seed=3)
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert done.usage.completion_tokens == 8 and done.usage.total_tokens == (
        done.usage.prompt_tokens + done.usage.completion_tokens)
    stream = real.chat.completions.create(model="real", messages=ASK, max_tokens=8, temperature=0,
                                          seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completions(real):
    done = real.completions.create(model="real", prompt="The lighthouse", max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 6


def test_bad_request_is_an_openai_error(real):
    with pytest.raises(openai.BadRequestError) as caught:
        real.chat.completions.create(model="real", messages=ASK, temperature=5)
    assert caught.value.body["param"] == "temperature"


def test_tool_calls_blocking_and_streaming():
    engine = ScriptedEngine([xtml_tool_call("get_weather", {"city": "Paris"})])
    with serving(scripted_service(engine, thinking=False)) as srv, client_for(srv.port) as client:
        done = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS)
        (tool_call,) = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls"
        assert tool_call.function.name == "get_weather"
        assert json.loads(tool_call.function.arguments) == {"city": "Paris"}

        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta
            for part in delta.tool_calls or []:
                slot = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or part.id
                slot["name"] += part.function.name or ""
                slot["arguments"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert calls[0]["id"] and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_api_key_through_the_client():
    with serving(scripted_service(), api_key="secret") as srv:
        with client_for(srv.port, "wrong") as bad, pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with client_for(srv.port, "secret") as good:
            assert good.models.list().data[0].id == "scripted"
