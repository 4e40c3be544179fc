"""The fields XTML rendering reads, checked by type: a malformed message is a ValueError
naming the field, not an AttributeError or a non-string segment deep inside."""
from __future__ import annotations

from typing import Mapping

from serve.core.client_json import Json, JsonObject
from serve.core.request import IMAGE_PARTS

ROLES = ("system", "user", "assistant", "tool")


def type_name(value: Json) -> str:
    return "null" if value is None else type(value).__name__


def _check_string(message: JsonObject, key: str, where: str) -> None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, not {type_name(value)}")


def _check_content(content: Json, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts, not {type_name(content)}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{j}] must be an object, not {type_name(part)}")
        kind = part.get("type")
        if kind == "text":
            _check_string(part, "text", f"{where}[{j}]")
        elif kind not in IMAGE_PARTS:
            raise ValueError(f"{where}[{j}]: unsupported content part type: {kind!r}")


def _check_tool_calls(calls: Json, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list, not {type_name(calls)}")
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ValueError(f"{where}[{j}] must be an object, not {type_name(call)}")
        _check_string(call, "id", f"{where}[{j}]")
        function = call.get("function")
        if function is not None and not isinstance(function, Mapping):
            raise ValueError(f"{where}[{j}].function must be an object, not {type_name(function)}")
        _check_string(function or {}, "name", f"{where}[{j}].function")


def check_message(message: Json, where: str) -> None:
    """The fields rendering reads, by type, so a malformed message is a ValueError naming
    the field rather than an AttributeError or a non-string segment deep inside."""
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object, not {type_name(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: unsupported message role: {role!r}")
    _check_content(message.get("content"), f"{where}.content")
    if role != "tool":
        _check_string(message, "name", where)
    if role == "assistant":
        _check_string(message, "reasoning_content", where)
        _check_string(message, "reasoning", where)
        _check_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
    elif role == "tool":
        for key in ("tool_call_id", "tool", "name"):
            _check_string(message, key, where)
