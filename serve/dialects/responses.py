"""The OpenAI Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), at the edge
(the stored input's listing: serve/dialects/input_items.py).

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

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from serve.core.client_json import Json
from serve.core.reply import Delta
from serve.dialects import seal
from serve.core.errors import ApiError, invalid
from serve.dialects.openai_request import parse_budget, parse_hints, parse_reasoning_effort, unknown_fields
from serve.dialects.shared import (Block, Blocks, Conversation, Parts, Translation, chat_request,
                      string_field, tool_call)
from serve.dialects.input_items import stored_items
from serve.service.response_store import ResponseStore, Stored
from serve.service.replies import ChatReply, ReplyStart
from serve.dialects.sse import sse_named

INCLUDE_REASONING = "reasoning.encrypted_content"
TOP_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
              "response_format": "text.format", "response_format.json_schema": "text.format",
              "reasoning_effort": "reasoning.effort",
              "thinking_token_budget": "reasoning.max_tokens"}
ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id",
          "reasoning", "text", "tool_choice", "tools", "user", "metadata")
# The fields a Responses body is read for (others are named once in the log).
FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice",
                    "parallel_tool_calls", "text", "reasoning", "max_output_tokens",
                    "temperature", "top_p", "metadata", "store", "include",
                    "previous_response_id", "prompt_cache_key", "client_metadata", "stream",
                    "user", "background", "conversation", "prompt"))
UNSUPPORTED = {"background": "background responses are not supported",
               "conversation": "conversations are not supported; continue with previous_response_id",
               "prompt": "stored prompt templates are not supported"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- requests ---------------------------------------------------------------


@dataclass
class _Request:
    translation: Translation
    history: list[dict]                 # the conversation without instructions, for the store
    namespaced: dict[str, tuple[str, str]]  # model-facing name -> (namespace, name)
    previous: Optional[Stored]          # the response it continues (previous_response_id)


def _parse(body: dict, store: ResponseStore) -> _Request:
    for name, reason in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise invalid(name, reason)
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
    chat = {"messages": conversation.messages, "tools": tools,
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": _text_format(body.get("text")), "stream": body.get("stream"),
            "max_tokens": body.get("max_output_tokens"),
            **{key: body.get(key) for key in ("temperature", "top_p")}}
    translation = chat_request(chat, {**TOP_FIELDS, **conversation.fields, **tool_fields}, left_out)
    translation.request.thinking, translation.request.thinking_effort = thinking, effort
    translation.request.thinking_token_budget = parse_budget((reasoning or {}).get("max_tokens"), "reasoning.max_tokens")
    translation.request.hints = parse_hints(body, priority=False)
    return _Request(translation, conversation.messages[start:], namespaced, stored)


def parse_request(body: dict, store: ResponseStore) -> Translation:
    """A Responses body -> the internal chat request (for --warm, which has no exchange)."""
    return _parse(body, store).translation


def _input(conversation: Conversation, value: Json, store: ResponseStore,
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
            text = seal.unseal(item.get("encrypted_content")) or store.reasoning(item.get("id"))
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


# ---- replies ----------------------------------------------------------------


def _usage(prompt: int, cached: int, output: int, reasoning: int) -> dict:
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


class Exchange:
    """One Responses request: its stream events as the deltas arrive, or the Response at the end."""

    def __init__(self, body: dict, store: ResponseStore, model: str):
        parsed = _parse(body, store)
        self.translation = parsed.translation
        self.request = parsed.translation.request
        self.left_out = parsed.translation.left_out
        self.ignored = unknown_fields(body, FIELDS)
        self._history = parsed.history
        self._namespaced = parsed.namespaced
        # Only what the Response echoes: the input is in the request now, and need not stay.
        self._body = {key: body[key] for key in ECHOED if key in body}
        self._store = store
        self.stored = body.get("store") is not False   # kept for previous_response_id and GET
        # What input_items lists: the chain's items so far, then this request's.
        previous = parsed.previous
        earlier = previous.input_items + previous.response["output"] if previous else []
        self._input_items = stored_items(body["input"], earlier) if self.stored else []
        include = body.get("include") or []
        if not isinstance(include, list):
            raise invalid("include", "include must be a list")
        self._seal = INCLUDE_REASONING in include
        self.id = _new_id("resp")
        self.model = model
        self._created = time.time()
        self._blocks = Blocks()
        self._item_ids: dict[int, str] = {}
        self._sequence = 0
        self._incomplete = False
        self._done: Optional[dict] = None   # the final Response, once the reply is over

    def error(self, error: ApiError) -> ApiError:
        return self.translation.error(error)

    # -- the stream -------------------------------------------------------------------

    def opening(self, start: ReplyStart) -> bytes:
        response = self._response("in_progress", [], self._usage_at(start))
        return sse_named([self._event("response.created", response=response),
                          self._event("response.in_progress", response=response)])

    def heartbeat(self, start: ReplyStart) -> bytes:
        """response.in_progress again: a data event (Codex's idle timer ignores comments),
        with the output so far and the usage as known before prefill."""
        current = self._blocks.current
        output = [self._item(block, block is not current) for block in self._blocks.blocks]
        return sse_named([self._event("response.in_progress",
                                      response=self._response("in_progress", output,
                                                              self._usage_at(start)))])

    def delta(self, delta: Delta) -> bytes:
        return sse_named([event for step in self._blocks.feed(delta) for event in self._events(*step)])

    def keep(self, reply: ChatReply) -> None:
        """Store the Response before the client sees it, so its next request can name it."""
        if self.stored:
            self._store.put(self._final(reply), self._history + [reply.message], self._input_items)

    def closing(self, reply: ChatReply) -> bytes:
        self._incomplete = reply.finish_reason == "length"
        events = [event for step in self._blocks.finish() for event in self._events(*step)]
        response = self._final(reply)
        kind = "response.incomplete" if self._incomplete else "response.completed"
        return sse_named(events + [self._event(kind, response=response)])

    def failed(self, error: ApiError) -> bytes:
        response = self._response("failed", [self._item(b, True) for b in self._blocks.blocks], None)
        response["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                             "message": error.message}
        return sse_named([self._event("response.failed", response=response)])

    def body(self, reply: ChatReply) -> dict:
        self._incomplete = reply.finish_reason == "length"
        self._blocks.finish()
        response = self._final(reply)
        return {**response, "output_text": "".join(
            part["text"] for item in response["output"] if item["type"] == "message"
            for part in item["content"])}

    # -- shapes -----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _final(self, reply: ChatReply) -> dict:
        """The Response of the finished reply (built once: the store and the client get the same)."""
        if self._done is not None:
            return self._done
        self._incomplete = reply.finish_reason == "length"   # keep() may come first
        usage = reply.usage
        response = self._response(
            "incomplete" if self._incomplete else "completed",
            [self._item(block, True) for block in self._blocks.blocks],
            _usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                   usage.reasoning_tokens))
        response["waste"] = usage.waste
        if self._incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        self._done = response
        return response

    @staticmethod
    def _usage_at(start: ReplyStart) -> Optional[dict]:
        """The usage a stream's first events carry: the input, once the prompt is built."""
        if start.prompt_tokens is None:
            return None
        return _usage(start.prompt_tokens, start.cached_tokens, 0, 0)

    def _response(self, status: str, output: list[dict], usage: Optional[dict]) -> dict:
        body, sampling = self._body, self.request.sampling
        return {"id": self.id, "object": "response", "created_at": self._created, "status": status,
                "background": False, "error": None, "incomplete_details": None,
                "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "model": self.model,
                "output": output, "parallel_tool_calls": self.request.parallel_tool_calls,
                "previous_response_id": body.get("previous_response_id"),
                "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                              "summary": (body.get("reasoning") or {}).get("summary")},
                "store": self.stored, "temperature": sampling.temperature,
                "text": body.get("text") or {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "top_p": sampling.top_p, "truncation": "disabled", "usage": usage,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}

    def _item(self, block: Block, done: bool) -> dict:
        """The output item of a block: whole once done, or empty as output_item.added shows it."""
        item_id = self._item_ids.setdefault(block.index, _new_id(
            {"reasoning": "rs", "text": "msg", "tool": "fc"}[block.kind]))
        last = block is self._blocks.blocks[-1]
        status = "incomplete" if done and last and self._incomplete else \
            "completed" if done else "in_progress"
        if block.kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [],
                    "content": [self._part(block)] if done else []}
            if done and self._seal:
                item["encrypted_content"] = seal.seal(block.text)
            return item
        if block.kind == "text":
            return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                    "content": [self._part(block)] if done else []}
        namespace, name = self._namespaced.get(block.name, (None, block.name))
        item = {"id": item_id, "type": "function_call", "status": status, "call_id": block.call_id,
                "name": name, "arguments": block.text if done else ""}
        if namespace:
            item["namespace"] = namespace
        return item

    @staticmethod
    def _part(block: Block, text: Optional[str] = None) -> dict:
        text = block.text if text is None else text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _events(self, step: str, block: Block, piece: str) -> list[dict]:
        where = {"item_id": self._item_ids.get(block.index), "output_index": block.index}
        if step == "open":
            events = [self._event("response.output_item.added", output_index=block.index,
                                  item=self._item(block, False))]
            where["item_id"] = self._item_ids[block.index]
            if block.kind != "tool":
                events.append(self._event("response.content_part.added", **where, content_index=0,
                                          part=self._part(block, "")))
            return events
        if step == "add":
            if block.kind == "tool":
                return [self._event("response.function_call_arguments.delta", **where, delta=piece)]
            if block.kind == "reasoning":
                return [self._event("response.reasoning_text.delta", **where, content_index=0,
                                    delta=piece)]
            return [self._event("response.output_text.delta", **where, content_index=0,
                                delta=piece, logprobs=[])]
        if block.kind == "tool":
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=self._item(block, True)["name"], arguments=block.text)]
        else:
            done = ({"text": block.text} if block.kind == "reasoning"
                    else {"text": block.text, "logprobs": []})
            kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
            events = [self._event(f"response.{kind}.done", **where, content_index=0, **done),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=self._part(block))]
        return events + [self._event("response.output_item.done", output_index=block.index,
                                     item=self._item(block, True))]
