"""A Responses body (`POST /v1/responses`) read into the internal chat request: the request
side of serve/dialects/responses.py.

Input items become the internal chat request: `instructions` and
system/developer messages as system turns, consecutive reasoning, assistant
message and function_call items as one assistant turn (the shape the model
produced them in), function_call_output items as tool messages. Functions
inside a `namespace` tool are shown to the model as `namespace.name` and
their calls come back with `namespace` set. Hosted tools (web_search,
file_search, ...) and custom tools are left out and logged.

`reasoning.effort` maps by `REASONING_EFFORTS` (serve/core/request.py), as `reasoning_effort` does.
`parallel_tool_calls: false` allows one call at most.

Reasoning comes back into a prompt only when the server can vouch for it: an
`encrypted_content` it sealed (asked with `include: ["reasoning.encrypted_content"]`,
see serve/dialects/seal.py), or the id of a reasoning item it still stores. Anything
else is left out. `prompt_cache_key` is accepted and not needed: the prefix
cache finds the shared prefix by itself.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

from serve.core.client_json import Json
from serve.dialects import fields, seal
from serve.core.errors import ApiError, invalid
from serve.dialects.openai_request import parse_budget, parse_hints, parse_reasoning_effort
from serve.dialects.translation import (Conversation, Parts, Translation, chat_request, string_field,
                                   tool_call)
from serve.service.response_store import OwnedResponses, Stored

INCLUDE_REASONING = "reasoning.encrypted_content"
INCLUDE_LOGPROBS = "message.output_text.logprobs"
TOP_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "logprobs": "include",
              "response_format": "text.format", "response_format.json_schema": "text.format",
              "reasoning_effort": "reasoning.effort",
              "thinking_token_budget": "reasoning.max_tokens"}
ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id",
          "reasoning", "text", "tool_choice", "tools", "user", "metadata")
# The fields a Responses body is read for (others are named once in the log).
FIELDS = fields.RESPONSES.read


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- requests ---------------------------------------------------------------


@dataclass
class ParsedRequest:
    translation: Translation
    history: list[dict]                 # the conversation without instructions, for the store
    namespaced: dict[str, tuple[str, str]]  # model-facing name -> (namespace, name)
    previous: Optional[Stored]          # the response it continues (previous_response_id)


def parse(body: dict, store: OwnedResponses) -> ParsedRequest:
    fields.RESPONSES.refuse(body)
    if body.get("background") is not None and not isinstance(body["background"], bool):
        raise invalid("background", "background must be a boolean")
    if body.get("background") is True and body.get("store") is False:
        raise invalid("store", "a background response is stored: it cannot have store false")
    conversation = Conversation()
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise invalid("instructions", "instructions must be a string")
        conversation.add({"role": "system", "content": body["instructions"]}, "instructions")
    start = len(conversation.messages)
    previous_id = body.get("previous_response_id")
    stored = None
    if previous_id is not None:
        stored = store.get(previous_id) if isinstance(previous_id, str) else None
        if stored is None:
            raise ApiError(400, f"previous response {previous_id!r} is not stored (responses are "
                                "kept in memory, a bounded number, until the server restarts)",
                           param="previous_response_id", code="previous_response_not_found")
        for message in stored.conversation:
            conversation.add(message, "previous_response_id")
    left_out: list[str] = []
    tools, tool_fields, namespaced = _tools(body.get("tools"), left_out)
    _input(conversation, body.get("input"), store, {v: k for k, v in namespaced.items()})
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid("reasoning", "reasoning must be an object")
    thinking, effort = parse_reasoning_effort((reasoning or {}).get("effort"), "reasoning.effort")
    include, top = body.get("include"), body.get("top_logprobs")
    # Logprobs are asked for by include, or by asking for alternatives (top_logprobs above 0).
    logprobs = (isinstance(include, list) and INCLUDE_LOGPROBS in include) or top not in (None, 0)
    chat = {"logprobs": logprobs or None, "top_logprobs": top if logprobs else None,"messages": conversation.messages, "tools": tools,
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": _text_format(body.get("text")), "stream": body.get("stream"),
            "max_tokens": body.get("max_output_tokens"),
            **{key: body.get(key) for key in ("temperature", "top_p", "cache_salt")}}
    translation = chat_request(chat, {**TOP_FIELDS, **conversation.fields, **tool_fields}, left_out)
    translation.request.thinking, translation.request.thinking_effort = thinking, effort
    translation.request.thinking_token_budget = parse_budget((reasoning or {}).get("max_tokens"),
                                                             "reasoning.max_tokens")
    translation.request.hints = parse_hints(body, priority=False)
    return ParsedRequest(translation, conversation.messages[start:], namespaced, stored)


def parse_request(body: dict, store: OwnedResponses) -> Translation:
    """A Responses body -> the internal chat request (for --warm, which has no exchange)."""
    return parse(body, store).translation


def _input(conversation: Conversation, value: Json, store: OwnedResponses,
           qualified: dict[tuple[str, str], str]) -> None:
    if isinstance(value, str):
        conversation.add({"role": "user", "content": value}, "input")
        return
    if not isinstance(value, list) or not value:
        raise invalid("input", "input must be a string or a non-empty list of items")
    turn: Optional[dict] = None   # the assistant turn its items are gathered into

    def assistant(where: str, opens: bool) -> dict:
        nonlocal turn
        if turn is None or opens:
            turn = {"role": "assistant", "content": ""}
            conversation.add(turn, where)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            # After the turn's text or calls, a message is the model's next turn.
            current = assistant(where, bool(turn and (turn["content"] or turn.get("tool_calls"))))
            current["content"] += _assistant_text(item.get("content"), where)
        elif kind == "function_call":
            name = string_field(item, "name", where)
            if item.get("namespace") is not None:
                name = qualified.get((string_field(item, "namespace", where), name), name)
            call = tool_call(string_field(item, "call_id", where), name, string_field(item, "arguments", where))
            assistant(where, False).setdefault("tool_calls", []).append(call)
        elif kind == "reasoning":
            # Reasoning opens a turn; text the server cannot vouch for is left out.
            current = assistant(where, bool(turn))
            text = seal.unseal(item.get("encrypted_content"), store.owner) or store.reasoning(item.get("id"))
            if text:
                current["reasoning_content"] = text
        else:
            turn = None
            if kind == "message":
                _message(conversation, item, where)
            elif kind == "function_call_output":
                _function_output(conversation, item, where)
            else:
                raise invalid(f"{where}.type", f"unsupported input item type {kind!r}")


def _assistant_text(content: Json, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("output_text", "refusal"):
            raise invalid(f"{at}.type", "an assistant message holds output_text or refusal parts")
        texts.append(string_field(part, "text" if kind == "output_text" else "refusal", at))
    return "".join(texts)


def _parts(content: Json, where: str, images: bool) -> Parts:
    parts = Parts()
    if isinstance(content, str):
        parts.text(content, where)
        return parts
    if not isinstance(content, list):
        raise invalid(where, "content must be a string or a list of parts")
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text":
            parts.text(string_field(part, "text", at), at)
        elif kind == "input_image" and images:
            if not isinstance(part.get("image_url"), str):
                raise invalid(f"{at}.image_url", "images are sent as image_url (a data: URL); "
                                                 "file_id is not supported")
            parts.image(part["image_url"], at)
        else:
            raise invalid(f"{at}.type", f"unsupported content part type {kind!r} here")
    return parts


def _message(conversation: Conversation, item: dict, where: str) -> None:
    role = item.get("role")
    if role not in ("user", "system", "developer"):
        raise invalid(f"{where}.role", "role must be user, assistant, system or developer")
    parts = _parts(item.get("content"), f"{where}.content", images=role == "user")
    # developer is the system role under its newer name.
    conversation.add({"role": "user" if role == "user" else "system", "content": parts.content()},
                     where, parts)


def _function_output(conversation: Conversation, item: dict, where: str) -> None:
    parts = _parts(item.get("output"), f"{where}.output", images=True)
    conversation.add({"role": "tool", "tool_call_id": string_field(item, "call_id", where),
                      "content": parts.content()}, where, parts)


def _function(tool: dict, at: str, name: str) -> dict:
    function: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    if tool.get("strict") is not None:   # enforced by constrained decoding when true
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tools(tools: Json, left_out: list[str]
           ) -> tuple[Optional[list[dict]], dict[str, str], dict[str, tuple[str, str]]]:
    """Function tools (namespaced ones too) as chat tools; the rest is left out."""
    if tools is None:
        return None, {}, {}
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be a list")
    out: list[dict] = []
    fields: dict[str, str] = {}
    namespaced: dict[str, tuple[str, str]] = {}

    def add(tool: dict, at: str, namespace: Optional[str]) -> None:
        name = string_field(tool, "name", at)
        shown = f"{namespace}.{name}" if namespace else name
        if namespace:
            namespaced[shown] = (namespace, name)
        fields[f"tools[{len(out)}]"] = fields[f"tools[{len(out)}].function"] = at   # flat shape
        out.append(_function(tool, at, shown))

    for j, tool in enumerate(tools):
        at = f"tools[{j}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            add(tool, at, None)
        elif kind == "namespace":
            namespace = string_field(tool, "name", at)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{at}.tools", "a namespace holds a list of tools")
            for k, member in enumerate(inner):
                if not isinstance(member, dict):
                    raise invalid(f"{at}.tools[{k}]", "each tool in a namespace must be an object")
                if member.get("type") == "function":
                    add(member, f"{at}.tools[{k}]", namespace)
                else:
                    left_out.append(f"{namespace}.{member.get('name')} ({member.get('type')})")
        elif isinstance(tool, dict):
            left_out.append(f"{tool['name']} ({kind})" if tool.get("name") else str(kind))
        else:
            raise invalid(at, "each tool must be an object")
    return out, fields, namespaced


def _tool_choice(choice: Json) -> Json:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": string_field(choice, "name", "tool_choice")}}
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        return choice["mode"]
    raise invalid("tool_choice", "tool_choice must be none, auto, required, a function "
                                 "or allowed_tools; hosted tools cannot be chosen here")


def _text_format(text: Json) -> Optional[dict]:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text", "text must be an object")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "schema must be a JSON Schema object")
        schema = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid("text.format.type", "text.format.type must be text, json_object or json_schema")


