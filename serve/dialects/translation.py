"""What the Anthropic Messages and OpenAI Responses translations share.

Both turn a request into the one internal `ChatRequest` and the service's
chat deltas back into their own wire format. Requests go through
`parse_chat_request`, so every dialect gets the chat endpoint's
validation and limits; `Translation.error` then renames the internal field a
400 names (`messages[3].content[1]`, `stop`) to the one the client sent.
Replies are grouped by `Blocks` into what both formats send as separate
units: a run of reasoning, a run of text, one tool call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from serve.core.client_json import Json
from serve.core.errors import ApiError, invalid
from serve.core.reply import Delta
from serve.dialects.openai_request import parse_chat_request
from serve.core.request import ChatRequest

# `messages[3].content[1]` -> `messages[3]` -> `messages`: a field, then its parents.
_LAST_STEP = re.compile(r"(\.[^.\[]+|\[\d+\])$")


def renamed(error: ApiError, fields: dict[str, str]) -> ApiError:
    """The same error, naming the field (or its nearest named parent) as the client did."""
    param, path, suffix = error.param, error.param or "", ""
    while path and path not in fields:
        step = _LAST_STEP.search(path)
        if step is None:
            return error
        path, suffix = path[:step.start()], step.group(1) + suffix
    if not path:
        return error
    name = fields[path] + suffix
    return ApiError(error.status, error.message.replace(param or "", name), param=name,
                    code=error.code, kind=error.kind, headers=error.headers)


@dataclass
class Translation:
    """An internal chat request and how to name its fields the way the client did."""
    request: ChatRequest
    fields: dict[str, str]                              # internal field -> the dialect's field
    left_out: list[str] = field(default_factory=list)   # tools the server cannot run, for the log

    def error(self, error: ApiError) -> ApiError:
        return renamed(error, self.fields)


def chat_request(body: dict, fields: dict[str, str], left_out: list[str]) -> Translation:
    """`body` in OpenAI chat shape -> the internal request, its errors in the dialect's names."""
    try:
        return Translation(parse_chat_request(body), fields, left_out)
    except ApiError as e:
        raise renamed(e, fields) from None


def string_field(obj: dict, key: str, where: str) -> str:
    """obj[key], which must be a string; a 400 naming `where.key` otherwise."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key}", f"{key} must be a string")
    return value


def tool_call(call_id: str, name: str, arguments: Json) -> dict:
    """An assistant tool call in OpenAI chat shape (what the renderer reads)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


class Parts:
    """One message's content parts as they are built, with the dialect's name for each.

    Neighbouring text blocks are joined with a blank line (they are paragraphs
    to the client); content of text alone becomes one string.
    """

    def __init__(self) -> None:
        self.parts: list[dict] = []
        self.fields: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.parts)

    def text(self, text: str, where: str) -> None:
        if self.parts and self.parts[-1]["type"] == "text":
            self.parts[-1] = {"type": "text", "text": self.parts[-1]["text"] + "\n\n" + text}
        else:
            self.parts.append({"type": "text", "text": text})
            self.fields.append(where)

    def image(self, url: str, where: str) -> None:
        self.parts.append({"type": "image_url", "image_url": {"url": url}})
        self.fields.append(where)

    def content(self) -> str | list[dict]:
        if all(part["type"] == "text" for part in self.parts):
            return "".join(part["text"] for part in self.parts)
        return self.parts


class Conversation:
    """Internal chat messages as they are built, and where each came from in the request."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.fields: dict[str, str] = {}

    def add(self, message: dict, where: str, parts: Optional[Parts] = None) -> None:
        at = f"messages[{len(self.messages)}]"
        self.messages.append(message)
        self.fields[at] = where
        for j, part_where in enumerate(parts.fields if parts is not None else ()):
            self.fields[f"{at}.content[{j}]"] = part_where


# ---- replies ----------------------------------------------------------------


@dataclass
class Block:
    kind: str            # "reasoning", "text" or "tool"
    index: int           # its place in the reply
    text: str = ""       # the reasoning, the text, or a tool call's arguments (JSON)
    call_id: str = ""
    name: str = ""


class Blocks:
    """Deltas -> ("open" | "add" | "close", block, piece) steps, in reply order."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.reasoning_pieces = 0   # deltas of reasoning: one per generated token that had any
        self._open: Optional[Block] = None

    def feed(self, delta: Delta) -> list[tuple[str, Block, str]]:
        if delta.reasoning_content:
            self.reasoning_pieces += 1
            return self._add("reasoning", delta.reasoning_content)
        if delta.content:
            return self._add("text", delta.content)
        steps: list[tuple[str, Block, str]] = []
        call = delta.tool_call
        if call is not None:
            function = call.get("function") or {}
            if "id" in call:
                steps += self._switch(Block("tool", len(self.blocks), call_id=call["id"],
                                            name=function.get("name") or ""))
            if function.get("arguments"):
                steps += self._append(function["arguments"])
        return steps

    def open(self, kind: str) -> list[tuple[str, Block, str]]:
        """Open an empty block before the reply begins (a stream's heartbeats go in it): the
        reply's first delta of its kind goes on in it, one of another kind closes it."""
        return self._switch(Block(kind, len(self.blocks)))

    @property
    def current(self) -> Optional[Block]:
        """The block still open, if one is."""
        return self._open

    def finish(self) -> list[tuple[str, Block, str]]:
        """Close the last block; the reply is complete."""
        return self._switch(None)

    def _add(self, kind: str, piece: str) -> list[tuple[str, Block, str]]:
        steps = [] if self._open is not None and self._open.kind == kind else self._switch(
            Block(kind, len(self.blocks)))
        return steps + self._append(piece)

    def _append(self, piece: str) -> list[tuple[str, Block, str]]:
        block = self._open
        assert block is not None   # _add opened it
        block.text += piece
        return [("add", block, piece)]

    def _switch(self, block: Optional[Block]) -> list[tuple[str, Block, str]]:
        steps = [] if self._open is None else [("close", self._open, "")]
        self._open = block
        if block is not None:
            self.blocks.append(block)
            steps.append(("open", block, ""))
        return steps
