"""Every field of the four dialects in one of three lists (serve/dialects/fields.py), and
docs/api.md's lists the same: each honoured field changes the reply (on the reference
engine, greedy unless the field is about sampling), each refused one is a 400 naming it, and
each ignored one changes nothing and is not logged as unread."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from scripted import (ScriptedEngine, call, real_service, scripted_service, serving,
                      xtml_tool_call)
from serve.dialects import fields
from serve.service.models import Models

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
COUNT, RESPONSES = "/v1/messages/count_tokens", "/v1/responses"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
SAMPLED = {"temperature": 2.0, "seed": 7}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# Whatever varies between two equal requests: ids, clocks, the engine's timings.
VOLATILE = {"id", "item_id", "call_id", "created", "created_at", "ms", "io_ms",
            "tokens_per_second", "behind_chores_ms", "mask_ms", "experts_hit", "experts_missed",
            "expert_hit_rate", "bytes_read", "direct_io", "response_id", "first_token_ms", "decode_ms"}


# ---- the lists in docs/api.md ------------------------------------------------------------


def documented(path: str) -> dict[str, set[str]]:
    """The three lists of the endpoint's section of docs/api.md's "Every field, sorted"."""
    text = DOCS.read_text().split("## Every field, sorted", 1)[1]
    section = re.split(r"\n### ", text.split(f"(`{path}`)\n", 1)[1])[0]
    lists: dict[str, set[str]] = {"honoured": set(), "refused": set(), "ignored": set()}
    honoured = re.search(r"Honoured[^:]*: (.*?)\n\n", section, re.S)
    assert honoured is not None, path
    # the names the paragraph lists, not those a parenthesis says something about
    lists["honoured"] = set(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", honoured.group(1))))
    for kind, heading in (("refused", "Refused"), ("ignored", "Accepted and ignored")):
        block = section.split(f"\n{heading}", 1)[1].split("\n\n", 2)[1]
        for bullet in re.findall(r"^- (.*)$", block, re.M):
            names = re.match(r"((?:`[^`]+`(?:, | and | with )?)+)", bullet)
            assert names is not None, bullet
            lists[kind] |= set(re.findall(r"`([^`]+)`", names.group(1)))
    return lists


@pytest.mark.parametrize("path", fields.ENDPOINTS)
def test_the_docs_lists_are_the_code_lists(path):
    code = fields.ENDPOINTS[path]
    docs = documented(path)
    assert docs["honoured"] == set(code.honoured)
    assert docs["refused"] == set(code.refused)
    assert docs["ignored"] == set(code.ignored)
    assert not set(code.ignored) & (set(code.honoured) | set(code.refused))


# ---- servers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(lib_path, k3_container, kimi_linear_container) -> Iterator[tuple[Any, list[str]]]:
    """The K3 reference engine, thinking off by default, and a second model ("small")."""
    log: list[str] = []
    with real_service(lib_path, k3_container, thinking=False, model_id="k3") as main, \
            real_service(lib_path, kimi_linear_container, model_id="small") as small, \
            serving(Models([main, small]), log=log.append) as srv:
        yield srv, log


@pytest.fixture(scope="module")
def scripted() -> Iterator[Any]:
    """Two calls every reply, and no logits (serve's decoder is off)."""
    first, second = (xtml_tool_call("get_weather", {"city": city}) for city in ("Paris", "Rome"))
    # one tools block of two calls: the first reply's, then the second's call element
    engine = ScriptedEngine([first[:-7] + second[6:-7] + first[-7:]])
    with serving(scripted_service(engine, thinking=False)) as srv:
        yield srv


def post(srv, path: str, body: dict):
    resp = call(srv.port, "POST", path, body, timeout=120)
    assert resp.status == 200, (path, body, resp.body)
    return resp


def outcome(resp) -> Any:
    """The reply as a client reads it, without what varies between equal requests."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        body: Any = ["stream", *[json.loads(line[len("data: "):])
                                 for line in resp.body.decode().splitlines()
                                 if line.startswith("data: {")]]
    else:
        body = resp.json()

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return strip(body)


# ---- honoured: each changes the reply ------------------------------------------------------

USER = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
Case = Callable[[Any], tuple[dict, dict]]   # (the real server) -> (base body, with the field)


def token_id(srv, text: str) -> int:
    (found,) = call(srv.port, "POST", "/tokenize", {"content": text}).json()["tokens"]
    return found


def first_token(srv, path: str, body: dict) -> int:
    """The id of the greedy reply's first token, by its bytes (logprobs report them)."""
    reply = post(srv, path, {**body, "logprobs": True} if path == CHAT else {**body, "logprobs": 0}).json()
    if path == CHAT:
        piece = bytes(reply["choices"][0]["logprobs"]["content"][0]["bytes"])
    else:
        piece = reply["choices"][0]["logprobs"]["tokens"][0].encode()
    return token_id(srv, piece.decode())


def chat_cases() -> dict[str, Case]:
    base = {"model": "k3", "messages": USER, "max_tokens": 12, "temperature": 0}
    tools = {**base, "tools": TOOLS}
    return {
        "messages": lambda s: (base, {**base, "messages": [{"role": "user", "content": "Hi!"}]}),
        "model": lambda s: (base, {**base, "model": "small"}),
        "tools": lambda s: (base, tools),
        "tool_choice": lambda s: (tools, {**tools, "tool_choice": "required"}),
        "response_format": lambda s: (base, {**base, "response_format": {"type": "json_object"}}),
        "temperature": lambda s: ({**base, "seed": 7}, {**base, **SAMPLED}),
        "top_p": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "top_p": 0.01}),
        "top_k": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "top_k": 1}),
        "seed": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "seed": 8}),
        "max_tokens": lambda s: (base, {**base, "max_tokens": 3}),
        "max_completion_tokens": lambda s: (base, {**base, "max_completion_tokens": 3}),
        "stop": lambda s: (base, {**base, "stop": [_word(post(s, CHAT, base).json()
                                                         ["choices"][0]["message"]["content"])]}),
        "stream": lambda s: (base, {**base, "stream": True}),
        "stream_options": lambda s: ({**base, "stream": True},
                                     {**base, "stream": True,
                                      "stream_options": {"include_usage": True}}),
        "logprobs": lambda s: (base, {**base, "logprobs": True}),
        "top_logprobs": lambda s: ({**base, "logprobs": True},
                                   {**base, "logprobs": True, "top_logprobs": 3}),
        "reasoning_effort": lambda s: (base, {**base, "reasoning_effort": "high"}),
        "logit_bias": lambda s: (base, {**base, "logit_bias": {
            str(first_token(s, CHAT, base)): -100}}),
        "frequency_penalty": lambda s: (_long(base), {**_long(base), "frequency_penalty": 2.0}),
        "presence_penalty": lambda s: (_long(base), {**_long(base), "presence_penalty": 2.0}),
        "priority": lambda s: (base, {**base, "priority": 5}),
        "thinking_token_budget": lambda s: ({**base, "reasoning_effort": "high"},
                                            {**base, "reasoning_effort": "high",
                                             "thinking_token_budget": 2}),
    }


def completion_cases() -> dict[str, Case]:
    base = {"model": "k3", "prompt": "The lighthouse keeper", "max_tokens": 12, "temperature": 0}
    return {
        "prompt": lambda s: (base, {**base, "prompt": "Once upon a time"}),
        "model": lambda s: (base, {**base, "model": "small"}),
        "temperature": lambda s: ({**base, "seed": 7}, {**base, **SAMPLED}),
        "top_p": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "top_p": 0.01}),
        "top_k": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "top_k": 1}),
        "seed": lambda s: ({**base, **SAMPLED}, {**base, **SAMPLED, "seed": 8}),
        "max_tokens": lambda s: (base, {**base, "max_tokens": 3}),
        "stop": lambda s: (base, {**base, "stop": _word(post(s, COMPLETIONS, base).json()
                                                        ["choices"][0]["text"])}),
        "stream": lambda s: (base, {**base, "stream": True}),
        "stream_options": lambda s: ({**base, "stream": True},
                                     {**base, "stream": True,
                                      "stream_options": {"include_usage": True}}),
        "logprobs": lambda s: (base, {**base, "logprobs": 2}),
        "echo": lambda s: (base, {**base, "echo": True}),
        "logit_bias": lambda s: (base, {**base, "logit_bias": {
            str(first_token(s, COMPLETIONS, base)): -100}}),
        "frequency_penalty": lambda s: (_long(base), {**_long(base), "frequency_penalty": 2.0}),
        "presence_penalty": lambda s: (_long(base), {**_long(base), "presence_penalty": 2.0}),
        "priority": lambda s: (base, {**base, "priority": 5}),
    }


def messages_cases(path: str) -> dict[str, Case]:
    base: dict = {"model": "k3", "messages": USER}
    if path == MESSAGES:
        base.update(max_tokens=12, temperature=0)
    tools = {**base, "tools": ANTHROPIC_TOOLS}
    schema = {"format": {"type": "json_schema", "schema": SCHEMA}}
    cases: dict[str, Case] = {
        "model": lambda s: (base, {**base, "model": "small"}),
        "messages": lambda s: (base, {**base, "messages": [{"role": "user", "content": "Hi!"}]}),
        "system": lambda s: (base, {**base, "system": "Answer in French."}),
        "tools": lambda s: (base, tools),
        "tool_choice": lambda s: (tools, {**tools, "tool_choice": {"type": "any"}}),
        "thinking": lambda s: (base, {**base, "thinking": {"type": "enabled",
                                                           "budget_tokens": 2048}}),
        "output_config": lambda s: (base, {**base, "output_config": schema}),
    }
    if path == MESSAGES:
        cases.update({
            "max_tokens": lambda s: (base, {**base, "max_tokens": 3}),
            "stop_sequences": lambda s: (base, {**base, "stop_sequences": [_word(
                post(s, MESSAGES, base).json()["content"][0]["text"])]}),
            "stream": lambda s: (base, {**base, "stream": True}),
            "temperature": lambda s: ({**base, "temperature": 0}, {**base, "temperature": 1}),
            "top_p": lambda s: ({**base, "temperature": 1}, {**base, "temperature": 1,
                                                            "top_p": 0.01}),
            "top_k": lambda s: ({**base, "temperature": 1}, {**base, "temperature": 1,
                                                            "top_k": 1}),
        })
    return cases


def responses_cases() -> dict[str, Case]:
    base = {"model": "k3", "input": "Tell me about the lighthouse keeper.",
            "max_output_tokens": 12, "temperature": 0}
    tools = {**base, "tools": RESPONSES_TOOLS}
    thinking = {**base, "reasoning": {"effort": "high"}}
    return {
        "model": lambda s: (base, {**base, "model": "small"}),
        "input": lambda s: (base, {**base, "input": "Hi!"}),
        "instructions": lambda s: (base, {**base, "instructions": "Answer in French."}),
        "tools": lambda s: (base, tools),
        "tool_choice": lambda s: (tools, {**tools, "tool_choice": "required"}),
        "text": lambda s: (base, {**base, "text": {"format": {
            "type": "json_schema", "name": "out", "schema": SCHEMA}}}),
        "reasoning": lambda s: (base, thinking),
        "max_output_tokens": lambda s: (base, {**base, "max_output_tokens": 3}),
        "temperature": lambda s: (base, {**base, "temperature": 1.9}),
        "top_p": lambda s: ({**base, "temperature": 1.9},
                            {**base, "temperature": 1.9, "top_p": 0.01}),
        "store": lambda s: (base, {**base, "store": False}),
        "include": lambda s: (thinking, {**thinking,
                                         "include": ["reasoning.encrypted_content"]}),
        "top_logprobs": lambda s: ({**base, "include": ["message.output_text.logprobs"]},
                                   {**base, "include": ["message.output_text.logprobs"],
                                    "top_logprobs": 3}),
        "previous_response_id": lambda s: (base, {**base, "previous_response_id": post(
            s, RESPONSES, base).json()["id"]}),
        "stream": lambda s: (base, {**base, "stream": True}),
    }


def _word(text: str) -> str:
    """A stop string the reply holds, past its start."""
    assert len(text) > 4, text
    return text[len(text) // 2:len(text) // 2 + 2]


def _long(body: dict) -> dict:
    """Long enough that a greedy reply on random weights repeats a token."""
    return {**body, "max_tokens": 60}


CASES = {CHAT: chat_cases(), COMPLETIONS: completion_cases(), MESSAGES: messages_cases(MESSAGES),
         COUNT: messages_cases(COUNT), RESPONSES: responses_cases()}
# Honoured fields shown on the scripted engine: their point is a reply the script makes.
SCRIPTED_CASES = {
    CHAT: {"parallel_tool_calls": ({"messages": USER, "tools": TOOLS},
                                   {"messages": USER, "tools": TOOLS,
                                    "parallel_tool_calls": False})},
    RESPONSES: {"parallel_tool_calls": ({"input": "hi", "tools": RESPONSES_TOOLS},
                                        {"input": "hi", "tools": RESPONSES_TOOLS,
                                         "parallel_tool_calls": False}),
                # Answered at once, queued, instead of with the reply (tests/api/test_background.py).
                "background": ({"input": "hi"}, {"input": "hi", "background": True})},
}


# Honoured fields whose effect is on what a later request reuses, not on this reply: shown in
# tests/snapshots/test_owners.py (two salts under one key share no snapshot).
ELSEWHERE = {path: {"cache_salt"} for path in (CHAT, COMPLETIONS, MESSAGES, RESPONSES)}


@pytest.mark.parametrize("path", fields.ENDPOINTS)
def test_every_honoured_field_has_a_case(path):
    assert set(CASES[path]) | set(SCRIPTED_CASES.get(path, {})) | ELSEWHERE.get(path, set()) \
        == set(fields.ENDPOINTS[path].honoured)


@pytest.mark.parametrize("path, name", [(p, n) for p, cases in CASES.items() for n in cases])
def test_each_honoured_field_changes_the_reply(real, path, name):
    srv, _ = real
    base, varied = CASES[path][name](srv)
    assert name not in base and name in varied or base.get(name) != varied.get(name)
    assert outcome(post(srv, path, varied)) != outcome(post(srv, path, base))


@pytest.mark.parametrize("path, name", [(p, n) for p, cases in SCRIPTED_CASES.items()
                                        for n in cases])
def test_each_honoured_field_changes_the_scripted_reply(scripted, path, name):
    base, varied = SCRIPTED_CASES[path][name]
    assert outcome(post(scripted, path, varied)) != outcome(post(scripted, path, base))


def test_logit_bias_can_force_a_token(real):
    """+100 on a token the greedy reply does not hold makes it appear (and -100 on the
    greedy token changes the reply: test_each_honoured_field_changes_the_reply)."""
    srv, _ = real
    for path, body, text in (
            (CHAT, {"messages": USER}, lambda r: r["choices"][0]["message"]["content"]),
            (COMPLETIONS, {"prompt": "The lighthouse"}, lambda r: r["choices"][0]["text"])):
        body = {**body, "max_tokens": 4, "temperature": 0}
        plain = text(post(srv, path, body).json())
        piece = next(c for c in "~@#%^Q" if c not in plain)
        biased = text(post(srv, path, {**body, "logit_bias": {str(token_id(srv, piece)): 100}}).json())
        assert piece in biased


# ---- refused: each is a 400 naming it ------------------------------------------------------

REFUSED = {
    CHAT: {"n": 2, "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "functions": [TOOLS[0]["function"]], "function_call": "auto",
           "web_search_options": {}, "verbosity": "low", "logprobs": True,
           "logit_bias": {"5": 10}, "frequency_penalty": 0.5, "presence_penalty": -0.5},
    COMPLETIONS: {"n": 3, "best_of": 2, "suffix": "end", "echo": True, "logprobs": 1,
                  "logit_bias": {"5": -10}, "frequency_penalty": 1, "presence_penalty": 1},
    MESSAGES: {"mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp",
                                "name": "x"}]},
    COUNT: {"mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp", "name": "x"}]},
    RESPONSES: {"conversation": "conv_1", "prompt": {"id": "pmpt_1"},
                "truncation": "auto", "text.verbosity": "high",
                "include": ["message.output_text.logprobs"]},
}
BASES = {CHAT: {"messages": USER}, COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
         MESSAGES: {"model": "m", "messages": USER, "max_tokens": 2},
         COUNT: {"model": "m", "messages": USER}, RESPONSES: {"input": "hi"}}


def with_field(body: dict, name: str, value: Any) -> dict:
    head, _, rest = name.partition(".")
    if not rest:
        return {**body, name: value}
    return {**body, head: {**body.get(head, {}), rest: value}}


@pytest.mark.parametrize("path", fields.ENDPOINTS)
def test_every_refused_field_has_a_case(path):
    assert set(REFUSED[path]) == set(fields.ENDPOINTS[path].refused)


@pytest.mark.parametrize("path, name", [(p, n) for p, cases in REFUSED.items() for n in cases])
def test_each_refused_field_is_a_400_naming_it(scripted, path, name):
    """On the scripted engine: serve's decoder is off there, so the fields that need it are
    refused too (on the real engine they are honoured, above)."""
    body = with_field(BASES[path], name, REFUSED[path][name])
    if path == COMPLETIONS and name == "echo":
        body["logprobs"] = 1   # echo alone is honoured; with logprobs it is refused
    resp = call(scripted.port, "POST", path, body)
    assert resp.status == 400, (name, resp.body)
    error = resp.json()["error"]
    assert error.get("param", name) == name and name in error["message"]
    # its off value, which clients send unasked, is accepted
    for allowed in fields.ENDPOINTS[path].refused[name].allowed:
        assert call(scripted.port, "POST", path,
                    with_field(BASES[path], name, allowed)).status == 200, (name, allowed)


# ---- ignored: each accepted, changing nothing ------------------------------------------------

IGNORED = {
    CHAT: {"user": "u-1", "safety_identifier": "s-1", "metadata": {"k": "v"}, "store": True,
           "prompt_cache_key": "pk", "prompt_cache_retention": "24h", "service_tier": "flex",
           "prediction": {"type": "content", "content": "The lighthouse"}},
    COMPLETIONS: {"user": "u-1"},
    MESSAGES: {"metadata": {"user_id": "u-1"}, "service_tier": "standard_only",
               "container": "container_1",
               "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
    COUNT: {"metadata": {"user_id": "u-1"}, "service_tier": "auto", "container": "container_1",
            "context_management": {"edits": []}, "max_tokens": 5, "stop_sequences": ["x"],
            "stream": True, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "cache_salt": "s"},
    RESPONSES: {"metadata": {"k": "v"}, "user": "u-1", "safety_identifier": "s-1",
                "prompt_cache_key": "pk", "prompt_cache_retention": "in-memory",
                "service_tier": "default", "client_metadata": {"originator": "codex"},
                "max_tool_calls": 3, "reasoning.summary": "auto",
                "stream_options": {"include_obfuscation": False}},
}
REAL_BASES = {CHAT: {"messages": USER, "max_tokens": 8, "temperature": 0},
              COMPLETIONS: {"prompt": "The lighthouse", "max_tokens": 8, "temperature": 0},
              MESSAGES: {"model": "k3", "messages": USER, "max_tokens": 8, "temperature": 0},
              COUNT: {"model": "k3", "messages": USER},
              RESPONSES: {"input": "Tell me.", "max_output_tokens": 8, "temperature": 0}}
# What a reply echoes of its request (the Responses object echoes these fields).
ECHOED = {"metadata", "user"}


@pytest.mark.parametrize("path", fields.ENDPOINTS)
def test_ignored_fields_change_nothing_and_are_not_unread(real, path):
    srv, log = real
    assert set(IGNORED[path]) == set(fields.ENDPOINTS[path].ignored)
    body = REAL_BASES[path]
    for name, value in IGNORED[path].items():
        body = with_field(body, name, value)
    plain, ignoring = outcome(post(srv, path, REAL_BASES[path])), outcome(post(srv, path, body))
    if path == RESPONSES:
        for reply in (plain, ignoring):
            for name in ECHOED:
                reply.pop(name)
            reply["reasoning"].pop("summary")
    assert ignoring == plain
    assert not [line for line in log if line.startswith(path + ":") and "does not read" in line]


def test_count_tokens_names_its_unread_fields_once(real):
    srv, log = real
    for _ in range(2):
        post(srv, COUNT, {"model": "k3", "messages": USER, "betas": ["x"]})
    assert sum(line.startswith(COUNT + ":") and "betas" in line for line in log) == 1


@pytest.mark.parametrize("bias, why", [
    ({"x": 1}, "keys must be token ids"), ({"-1": 1}, "keys must be token ids"),
    ({"9" * 5000: 1}, "keys must be token ids"), ({"5": 101}, "from -100 to 100"),
    ({"5": "1"}, "from -100 to 100"), ([5], "must be an object"),
    ({"2000000000": 1}, "no token has the id 2000000000")])
def test_a_bad_logit_bias_is_a_400(real, bias, why):
    srv, _ = real
    for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "a"})):
        resp = call(srv.port, "POST", path, {**body, "max_tokens": 1, "logit_bias": bias})
        assert resp.status == 400, resp.body
        error = resp.json()["error"]
        assert error["param"] == "logit_bias" and why in error["message"]


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [2.5, -3, "1", True])
def test_a_penalty_out_of_range_is_a_400(real, name, value):
    srv, _ = real
    resp = call(srv.port, "POST", CHAT, {"messages": USER, "max_tokens": 1, name: value})
    assert resp.status == 400 and resp.json()["error"]["param"] == name


def test_responses_logprobs_blocking_and_streamed(real):
    srv, _ = real
    body = {"model": "k3", "input": "Tell me.", "max_output_tokens": 6, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    (message,) = [i for i in post(srv, RESPONSES, body).json()["output"] if i["type"] == "message"]
    (part,) = message["content"]
    entries = part["logprobs"]
    assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert len(entries) <= 6 and all(isinstance(e["logprob"], float) for e in entries)
    events = [json.loads(line[len("data: "):]) for line in
              post(srv, RESPONSES, {**body, "stream": True}).body.decode().splitlines()
              if line.startswith("data: ")]
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta"
                for e in ev["logprobs"]]
    assert streamed == entries
    done = next(ev for ev in events if ev["type"] == "response.output_text.done")
    assert done["logprobs"] == entries
    plain = post(srv, RESPONSES, {k: v for k, v in body.items()
                                  if k not in ("include", "top_logprobs")}).json()
    assert [p["logprobs"] for i in plain["output"] if i["type"] == "message"
            for p in i["content"]] == [[]]
