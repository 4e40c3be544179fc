"""OpenAI's request validation: a chat completions or completions body -> the internal request.

Validation checks the fields this server knows and ignores the rest, so
clients that send extra sampling knobs keep working. The field checks every
dialect shares (reasoning effort, parallel_tool_calls, unread fields) live here too.
"""
from __future__ import annotations

import math
from typing import Optional

from serve.core.work_classes import Hints
from serve.core.client_json import Json
from serve.core.errors import invalid
from serve.dialects import fields
from serve.core.request import (IMAGE_PARTS, REASONING_EFFORTS, ChatRequest, CompletionRequest,
                                image_url, Sampling)

MAX_STOP_STRINGS = 4
MAX_TOP_K = (1 << 31) - 1  # the engine's top_k is a C int; no vocabulary comes near it
MAX_TOKEN_ID = (1 << 31) - 1   # the engine's ids are C ints too
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 100.0   # OpenAI's bound: -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0
# The request fields each endpoint reads or accepts knowingly (serve/dialects/fields.py sorts
# them). Any other is named once in the log (serve/http/server.py): a client option sent in
# the wrong place, such as litellm's literal `extra_body`, must not be dropped without a word.
CHAT_FIELDS = fields.CHAT.read
COMPLETION_FIELDS = fields.COMPLETIONS.read
# Per role, the message fields besides content that reach the prompt as text.
STRING_FIELDS = {"system": ("name",), "developer": ("name",), "user": ("name",),
                 "assistant": ("name", "reasoning_content", "reasoning"),
                 "tool": ("tool_call_id", "name", "tool")}


def unknown_fields(body: dict, known: frozenset[str]) -> list[str]:
    """The body's top-level fields an endpoint does not read, for the log."""
    return sorted(key for key in body if key not in known)


def _is_int(value: Json) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Json) -> bool:
    # An int is always finite; asking math.isfinite would overflow on a huge one.
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _parse_sampling(body: dict) -> Sampling:
    s = Sampling()
    if body.get("temperature") is not None:
        t = body["temperature"]
        if not _is_number(t) or not 0 <= t <= 2:
            raise invalid("temperature", "temperature must be a number between 0 and 2")
        s.temperature = float(t)
    if body.get("top_p") is not None:
        p = body["top_p"]
        if not _is_number(p) or not 0 < p <= 1:
            raise invalid("top_p", "top_p must be a number greater than 0 and at most 1")
        s.top_p = float(p)
    if body.get("top_k") is not None:
        k = body["top_k"]
        if not _is_int(k) or not 0 <= k <= MAX_TOP_K:
            raise invalid("top_k", f"top_k must be an integer from 0 to {MAX_TOP_K}")
        s.top_k = k
    if body.get("seed") is not None:
        seed = body["seed"]
        if not _is_int(seed):
            raise invalid("seed", "seed must be an integer")
        s.seed = seed % (1 << 64)  # the engine's seed is a uint64
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise invalid(name, f"{name} must be an integer >= 1")
        if s.max_tokens is None:
            s.max_tokens = value
    s.stop = _parse_stop(body.get("stop"))
    s.logit_bias = _parse_logit_bias(body.get("logit_bias"))
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None:
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise invalid(name, f"{name} must be a number from -{MAX_PENALTY:g} to "
                                    f"{MAX_PENALTY:g}")
            setattr(s, name, float(value))
    return s


def _parse_logit_bias(value: Json) -> dict[int, float]:
    """{"token id": bias}: ids as JSON keys are strings, biases from -100 to 100."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias", "logit_bias must be an object mapping token ids to biases")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        # (at most ten digits before int(): a longer string is no id, and a huge one is slow)
        if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > MAX_TOKEN_ID:
            raise invalid("logit_bias", f"logit_bias keys must be token ids, not {key!r}")
        if not _is_number(amount) or not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"logit_bias[{key!r}] must be a number from "
                                        f"-{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}")
        if amount:
            bias[int(key)] = float(amount)
    return bias


def _parse_stop(stop: Json) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) for s in stop)):
        raise invalid("stop", f"stop must be a string or a list of up to {MAX_STOP_STRINGS} strings")
    return [s for s in stop if s]


def _parse_stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "stream must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "stream_options must be an object")
        include_usage = options.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise invalid("stream_options.include_usage", "include_usage must be a boolean")
    return stream, include_usage


def parse_reasoning_effort(value: Json, param: str = "reasoning_effort"
                           ) -> tuple[Optional[bool], Optional[str]]:
    """Maps a reasoning effort to (thinking, K3's level) by REASONING_EFFORTS; (None, None)
    when absent. `param` names the field in the dialect the value came from."""
    if value is None:
        return None, None
    if not isinstance(value, str) or value not in REASONING_EFFORTS:
        raise invalid(param, f"{param} must be one of {', '.join(REASONING_EFFORTS)}")
    level = REASONING_EFFORTS[value]
    return level is not None, level


def parse_budget(value: Json, param: str = "thinking_token_budget") -> Optional[int]:
    """A reasoning budget in think-channel tokens (vLLM's `thinking_token_budget`): a
    non-negative integer, 0 for thinking off, -1 for none even when the server has one;
    None when absent. `param` names the field in the dialect the value came from."""
    if value is None:
        return None
    if not _is_int(value) or value < -1:
        raise invalid(param, f"{param} must be an integer >= 0 (or -1: no budget)")
    return value


def parse_parallel(value: Json, param: str) -> bool:
    """parallel_tool_calls (or its dialect's name): absent or null is true."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid(param, f"{param} must be a boolean")
    return value


def _parse_content(content: Json, param: str, allow_null: bool) -> None:
    if content is None:
        if not allow_null:
            raise invalid(param, f"{param} must be a string or a list of content parts")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(param, f"{param} must be a string or a list of content parts")
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(where, "a content part must be an object")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise invalid(where, "a text part needs a string 'text'")
        elif kind in IMAGE_PARTS:
            if not isinstance(image_url(part), str):
                raise invalid(where, f"an {kind} part needs {kind} (or {kind}.url) as a string")
        else:
            raise invalid(where, f"unsupported content part type {kind!r}")


def _parse_tool_calls(calls: Json, param: str) -> None:
    if not isinstance(calls, list):
        raise invalid(param, "tool_calls must be a list")
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("id", ""), str):
            raise invalid(where, "a tool call must be an object with a string id")
        if call.get("type", "function") != "function":
            raise invalid(where, "tool call type must be 'function'")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(where, "a tool call needs function.name")
        if not isinstance(fn.get("arguments", ""), str):
            raise invalid(where, "tool call function.arguments must be a JSON string")


def _parse_messages(messages: Json) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "each message must be an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"{where}.role", f"role must be one of {', '.join(MESSAGE_ROLES)}")
        has_calls = role == "assistant" and message.get("tool_calls") is not None
        if has_calls:
            _parse_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        _parse_content(message.get("content"), f"{where}.content", allow_null=has_calls)
        for key in STRING_FIELDS.get(role, ()):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise invalid(f"{where}.{key}", f"{key} must be a string")
        # developer is OpenAI's newer name for the system role.
        normalized.append(dict(message, role="system") if role == "developer" else message)
    _check_calls_answered(normalized)
    return normalized


def _check_calls_answered(messages: list[dict]) -> None:
    """Each assistant tool call (with an id) gets its result (a tool message) before the next
    assistant message, or before the conversation ends if anything follows the call: a
    conversation that goes on past a call with no result is not one the model was taught to
    read, and OpenAI and Anthropic refuse it too. (Their stricter order, results right after
    the call, is not asked: a user's text among the results reads the same.)"""
    asked: Optional[int] = None     # the assistant message whose calls are not all answered
    pending: list[str] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            answered = message.get("tool_call_id")
            if answered in pending:
                pending.remove(answered)
            elif not answered and pending:
                pending.pop(0)   # a result with no id answers the call at its position
        elif role == "assistant":
            if pending:
                break
            asked = i
            pending = [call["id"] for call in message.get("tool_calls") or () if call.get("id")]
    if pending and asked is not None and len(messages) > asked + 1:
        # Worded for every dialect: a tool message, a tool_result block, a function_call_output.
        raise invalid(f"messages[{asked}]", f"messages[{asked}] calls tools whose results never "
                                            f"come ({', '.join(pending)}): each call needs its "
                                            "result, naming its id, before the next assistant "
                                            "message")


def _parse_tools(tools: Json) -> Optional[list[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be a list")
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid(where, "each tool must be an object of type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"{where}.function", "a tool needs function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"{where}.function.parameters", "parameters must be a JSON Schema object")
    return tools or None


def _parse_tool_choice(choice: Json, tools: Optional[list[dict]]) -> Json:
    if choice == "required" and not tools:
        # A call is required but none is declared: no reply could follow it (OpenAI's 400 too).
        raise invalid("tool_choice", "tool_choice requires a tool call, but tools declares none")
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in {tool["function"]["name"] for tool in tools or ()}:
            raise invalid("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
        return choice
    raise invalid("tool_choice", "tool_choice must be none, auto, required or a named function")


def _parse_response_format(value: Json) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format", "response_format.type must be text, json_object or json_schema")
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format.json_schema", "json_schema must be an object")
        if spec.get("schema") is not None and not isinstance(spec["schema"], dict):
            raise invalid("response_format.json_schema.schema", "schema must be a JSON Schema object")
    return None if value["type"] == "text" else value


def _parse_chat_logprobs(body: dict) -> Optional[int]:
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise invalid("logprobs", "logprobs must be a boolean")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
        raise invalid("top_logprobs",
                      f"top_logprobs must be an integer from 0 to {MAX_CHAT_TOP_LOGPROBS}")
    if top is not None and not on:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if on else None


def _parse_completion_logprobs(body: dict) -> Optional[int]:
    value = body.get("logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
    return value


def parse_hints(body: dict, priority: bool = True) -> Hints:
    """What the body says about its class; `priority` is read where vLLM reads it (its
    OpenAI endpoints): an integer, lower served earlier (serve/core/work.py)."""
    model = body.get("model")
    value = body.get("priority") if priority else None
    if value is not None and not _is_int(value):
        raise invalid("priority", "priority must be an integer (as vLLM's: lower is served "
                                  "earlier; a positive priority is background work)")
    return Hints(model if isinstance(model, str) else "", value)


def parse_cache_salt(value: Json) -> Optional[str]:
    """vLLM's `cache_salt`: requests reuse each other's prefix snapshots only when they carry
    the same salt (and come from the same key: serve/snapshots/scope.py)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid("cache_salt", "cache_salt must be a non-empty string")
    return value


def parse_chat_request(body: dict) -> ChatRequest:
    fields.CHAT.refuse(body)
    messages = _parse_messages(body.get("messages"))
    sampling = _parse_sampling(body)
    stream, include_usage = _parse_stream(body)
    thinking, effort = parse_reasoning_effort(body.get("reasoning_effort"))
    tools = _parse_tools(body.get("tools"))
    return ChatRequest(messages=messages, sampling=sampling, stream=stream,
                       include_usage=include_usage, tools=tools,
                       tool_choice=_parse_tool_choice(body.get("tool_choice"), tools),
                       parallel_tool_calls=parse_parallel(body.get("parallel_tool_calls"),
                                                          "parallel_tool_calls"),
                       response_format=_parse_response_format(body.get("response_format")),
                       thinking=thinking, thinking_effort=effort,
                       thinking_token_budget=parse_budget(body.get("thinking_token_budget")),
                       logprobs=_parse_chat_logprobs(body), hints=parse_hints(body),
                       cache_salt=parse_cache_salt(body.get("cache_salt")))


def _check_echo(body: dict) -> None:
    """echo, honoured alone; with logprobs it would score the prompt, which this server cannot
    do: ignored, that would give a client (an evaluation harness scoring echoed prompts, say)
    a wrong answer that looks right."""
    if body.get("echo") is not None and not isinstance(body["echo"], bool):
        # `in (False, True)` would let 1 and 0 through, and 1 would not be echoed
        raise invalid("echo", "echo must be a boolean")
    if body.get("echo") and body.get("logprobs") is not None:
        # Scoring a prompt needs every prompt position's logits; the engine gives the last.
        raise invalid("echo", fields.COMPLETIONS.refused["echo"].why)


def parse_completion_request(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "prompt must be a string or a list of one string")
    fields.COMPLETIONS.refuse(body)
    sampling = _parse_sampling(body)
    stream, include_usage = _parse_stream(body)
    _check_echo(body)
    return CompletionRequest(prompt=prompt, sampling=sampling, stream=stream,
                             include_usage=include_usage,
                             logprobs=_parse_completion_logprobs(body), hints=parse_hints(body),
                             echo=body.get("echo") is True,
                             cache_salt=parse_cache_salt(body.get("cache_salt")))
