"""Structured output as clients use it (openai's parse(), instructor), and the server without
its optional packages."""
from __future__ import annotations

import json
import os
from typing import Literal

import instructor
import openai
import pytest
from pydantic import BaseModel, Field

from scripted import assert_error, call, real_service, serving
from serve.formats.grammar import ENABLE_HINT
from served import cli_server

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Describe a city."}]
HOT = {"temperature": 1.5, "seed": 7, "max_tokens": 600}
NO_THINKING = {"reasoning_effort": "none"}


class Place(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["town", "city", "village"]
    population: int = Field(ge=0, le=10_000_000)


class Trip(BaseModel):
    start: Place
    stops: list[Place] = Field(max_length=2)
    by_train: bool


@pytest.fixture(scope="module")
def client(lib_path, k3_container):
    with real_service(lib_path, k3_container) as service, serving(service) as srv:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused",
                           max_retries=0, timeout=60) as c:
            yield c


@pytest.mark.parametrize("model", [Place, Trip])
def test_openai_parse_gets_a_parsed_object(client, model):
    done = client.chat.completions.parse(model="real", messages=ASK, response_format=model,
                                         extra_body=NO_THINKING, **HOT)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, model), done.choices[0]
    assert done.choices[0].finish_reason == "stop"


def test_instructor_gets_a_valid_object(client):
    # instructor's default mode: the model as a tool, forced with a named tool_choice.
    patched = instructor.from_openai(client)
    place = patched.chat.completions.create(model="real", messages=ASK, response_model=Place,
                                            max_retries=0, extra_body=NO_THINKING, **HOT)
    assert isinstance(place, Place)
    json_mode = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    trip = json_mode.chat.completions.create(model="real", messages=ASK, response_model=Trip,
                                             max_retries=0, extra_body=NO_THINKING, **HOT)
    assert isinstance(trip, Trip)


def hiding(tmp_path, *modules: str) -> dict:
    """An environment in which importing `modules` fails, as if they were not installed."""
    for name in modules:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} hidden by the test')\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_without_llguidance_structure_is_off_and_says_how_to_enable_it(lib_path, k3_container, tmp_path):
    with cli_server(str(k3_container), "--lib", str(lib_path),
                    env=hiding(tmp_path, "llguidance")) as (_, port, banner):
        (line,) = [line for line in banner if line.startswith("struct")]
        assert "structured output off (logprobs on)" in line and ENABLE_HINT in line
        strict = {"type": "json_schema", "json_schema": {"name": "a", "strict": True,
                                                         "schema": {"type": "object"}}}
        err = assert_error(call(port, "POST", CHAT, {"messages": ASK, "response_format": strict}), 400,
                           param="response_format.json_schema.strict",
                           code="structured_output_unavailable")
        assert ENABLE_HINT in err["message"]
        # Not strict: the prompt's note is all there is, and the reply says so.
        loose = call(port, "POST", CHAT, {"messages": ASK, "max_tokens": 3, "seed": 1,
                                          "response_format": {"type": "json_object"}}).json()
        assert loose["waste"]["constrained"] is False
        logprobs = call(port, "POST", CHAT, {"messages": ASK, "max_tokens": 2, "logprobs": True,
                                             "seed": 1, **NO_THINKING}).json()
        assert len(logprobs["choices"][0]["logprobs"]["content"]) == 2


def test_without_numpy_logprobs_are_off_too(lib_path, kimi_linear_container, tmp_path):
    with cli_server(str(kimi_linear_container), "--lib", str(lib_path),
                    env=hiding(tmp_path, "llguidance", "numpy")) as (_, port, banner):
        (line,) = [line for line in banner if line.startswith("struct")]
        assert "structured output and logprobs off" in line and ENABLE_HINT in line
        err = assert_error(call(port, "POST", CHAT, {"messages": ASK, "logprobs": True}), 400,
                           param="logprobs", code="logprobs_unavailable")
        assert ENABLE_HINT in err["message"]
        # A chat.json prompt cannot ask for a format: without a grammar it is refused.
        err = assert_error(call(port, "POST", CHAT, {"messages": ASK, "response_format": {"type": "json_object"}}),
                           400, param="response_format", code="structured_output_unavailable")
        assert ENABLE_HINT in err["message"]
        plain = call(port, "POST", CHAT, {"messages": ASK, "max_tokens": 2, "seed": 1})
        assert plain.status == 200 and json.loads(plain.body)["usage"]["completion_tokens"] == 2
        # Calls in serve's own format on a chat.json are made by a grammar alone.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        err = assert_error(call(port, "POST", CHAT, {"messages": ASK, "tools": tools}), 400,
                           param="tools", code="structured_output_unavailable")
        assert ENABLE_HINT in err["message"] and "pip install '.[structured]'" in err["message"]
        # tool_choice none leaves the tools out: nothing to enforce.
        left_out = call(port, "POST", CHAT, {"messages": ASK, "tools": tools, "tool_choice": "none",
                                             "max_tokens": 2, "seed": 1})
        assert left_out.status == 200, left_out.body
