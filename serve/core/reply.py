"""A reply as it streams and as it ends, in no wire format: the deltas a chat format's
parser yields, the reply it reads back, and the tokens it cost.

A `Delta` goes from the parser (serve/formats/) through the service straight to a
dialect (serve/dialects/), which writes it in its own shapes. Tool calls keep the
internal message's shape (OpenAI's, which every chat format renders from).
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict


_ID_ALPHABET = string.ascii_letters + string.digits


def default_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class FunctionDelta(TypedDict, total=False):
    name: str
    arguments: str   # a piece of the call's JSON arguments


class _ToolCallDeltaKeys(TypedDict):
    index: int       # the call's place among the reply's calls


class ToolCallDelta(_ToolCallDeltaKeys, total=False):
    """A piece of a tool call: its first carries `id`, `type` and the function's name."""
    id: str
    type: str
    function: FunctionDelta


class FunctionCall(TypedDict):
    name: str
    arguments: str   # the JSON text as the model wrote it (cut short if the reply was)


class ToolCall(TypedDict):
    """A call in a finished reply, in the internal (OpenAI) message's shape."""
    id: str
    type: str        # "function"
    function: FunctionCall


def read_calls(calls: list[dict[str, str]], arguments: list[list[str]]) -> list[ToolCall]:
    """The calls a parser has read so far: each one's id and name, and its arguments' pieces."""
    return [{"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": "".join(pieces)}}
            for call, pieces in zip(calls, arguments)]


@dataclass
class Delta:
    """One streaming event; exactly one of its first three fields is non-empty. A completion's
    text is `content`."""
    reasoning_content: str = ""
    content: str = ""
    tool_call: Optional[ToolCallDelta] = None
    # With logprobs asked for: the entries of the tokens behind `content`
    # (serve/service/logprobs.py says their shape).
    logprobs: Optional[list[dict]] = None


@dataclass
class Reply:
    """Everything the model has said so far."""
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    ended: bool = False


class Deltas:
    """The deltas one token (or chunk) yields, in order; pieces of one text channel or of one
    call's arguments merge, but never into a call's first delta (its id and name)."""

    def __init__(self) -> None:
        self._out: list[Delta] = []

    def text(self, channel: str, text: str) -> None:
        last = self._out[-1] if self._out else None
        if last is not None and getattr(last, channel):
            setattr(last, channel, getattr(last, channel) + text)
        else:
            self._out.append(Delta(content=text) if channel == "content"
                             else Delta(reasoning_content=text))

    def call(self, index: int, call_id: str, name: str) -> None:
        self._out.append(Delta(tool_call={"index": index, "id": call_id, "type": "function",
                                          "function": {"name": name, "arguments": ""}}))

    def arguments(self, index: int, fragment: str) -> None:
        last = self._out[-1] if self._out else None
        if last is not None and last.tool_call and last.tool_call["index"] == index \
                and "id" not in last.tool_call:
            last.tool_call["function"]["arguments"] += fragment
        else:
            self._out.append(Delta(tool_call={"index": index, "function": {"arguments": fragment}}))

    def take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def joined(deltas: list[Delta]) -> list[Delta]:
    """The same output in as few deltas as say it: a run of one text channel joins, and so do
    the pieces of one call's arguments (never into a call's first delta, which carries its id
    and name); logprobs entries join only between deltas that both have them. Makes new
    deltas; those given are not changed (other readers of the log hold them too)."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and (last.logprobs is None) == (delta.logprobs is None):
            merged = _merge(last, delta)
            if merged is not None:
                out[-1] = merged
                continue
        out.append(delta)
    return out


def _merge(a: Delta, b: Delta) -> Optional[Delta]:
    """`a` then `b` as one delta, or None where they cannot be one."""
    logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    if a.tool_call is None and b.tool_call is None:
        if a.content and b.content:
            return Delta(content=a.content + b.content, logprobs=logprobs)
        if a.reasoning_content and b.reasoning_content:
            return Delta(reasoning_content=a.reasoning_content + b.reasoning_content,
                         logprobs=logprobs)
        return None
    first, second = a.tool_call, b.tool_call
    if first is None or second is None or first["index"] != second["index"] \
            or "id" in first or "id" in second:
        return None
    arguments = first.get("function", {}).get("arguments", "") \
        + second.get("function", {}).get("arguments", "")
    return Delta(tool_call={"index": first["index"], "function": {"arguments": arguments}},
                 logprobs=logprobs)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    waste: dict  # the engine numbers OpenAI's schema has no place for
    cached_tokens: int = 0  # prompt positions restored from a prefix snapshot
    reasoning_tokens: int = 0   # of the completion, those the model generated in its think channel


def assistant_message(content: str, reasoning: str, tool_calls: list[ToolCall]) -> dict[str, Any]:
    """The reply as an internal (OpenAI-shaped) assistant message."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message
