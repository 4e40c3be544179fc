"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), at the edge.

A request becomes the internal chat request (`system` and mid-conversation
system messages as system turns, `tool_use` as tool calls, `tool_result` as
tool messages, images as data URLs) and the chat deltas become Anthropic's
content blocks and stream events. Any `model` name is answered by the one model.
Claude Code's billing header (a `system` text block starting
`x-anthropic-billing-header:`) is metadata and stays out of the prompt.

Thinking onto K3's effort levels (`parse_reasoning_effort` is the rule):

| request                                   | K3                              |
|-------------------------------------------|---------------------------------|
| no `thinking`                             | the server's default            |
| `{"type": "disabled"}`                    | thinking off                    |
| `{"type": "adaptive"}`                    | thinking on, no effort given    |
| `{"type": "enabled", "budget_tokens": N}` | N < 8192: low; N < 24576: high; otherwise max; and N think-channel tokens at most (0: thinking off) |
| `output_config.effort`                    | as `reasoning_effort` (`REASONING_EFFORTS`: medium is high, xhigh max), over a budget |

`tool_choice.disable_parallel_tool_use: true` is `parallel_tool_calls: false`: one call at most.
Thinking blocks carry a `signature` (serve/dialects/seal.py); history thinking whose
signature does not verify is dropped, never rendered as reasoning.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Optional

from serve.core.client_json import Json
from serve.core.reply import Delta
from serve.dialects import fields, seal
from serve.core.errors import ApiError, invalid
from serve.dialects.openai_request import parse_hints, parse_reasoning_effort, unknown_fields
from serve.dialects.translation import (Block, Blocks, Conversation, Parts, Translation, chat_request,
                      string_field, tool_call)
from serve.service.replies import ChatReply, ReplyStart
from serve.dialects.framing import SSE
from serve.dialects.sse import sse_named

BUDGET_EFFORTS = ((8192, "low"), (24576, "high"))   # budget_tokens below the bound -> effort
BILLING_HEADER = "x-anthropic-billing-header:"   # Claude Code's system[0], see is_billing_block
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}
# Where an internal field comes from, beyond the messages (mapped as they are built).
TOP_FIELDS = {"messages": "messages", "stop": "stop_sequences", "reasoning_effort": "thinking",
              "thinking_token_budget": "thinking.budget_tokens",
              "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
              "response_format": "output_config.format",
              "response_format.json_schema": "output_config.format"}


def unread(body: dict, *, counting: bool = False) -> list[str]:
    """The fields of a Messages (or count_tokens) body this server does not read, for the log."""
    return unknown_fields(body, (fields.COUNT_TOKENS if counting else fields.MESSAGES).read)


def error_body(error: ApiError) -> dict:
    """Anthropic's error shape; with no `param` field, the message names the field."""
    kind = ERROR_TYPES.get(error.status) or ("api_error" if error.status >= 500
                                             else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- requests ---------------------------------------------------------------


def parse_request(body: dict, *, counting: bool = False, owner: str = "") -> Translation:
    """A Messages request (or a count_tokens one, which has no max_tokens) -> the chat request;
    `owner`'s signatures are the thinking it trusts (serve/dialects/seal.py)."""
    if not isinstance(body.get("model"), str):
        raise invalid("model", "model is required and must be a string")
    if not counting and body.get("max_tokens") is None:
        raise invalid("max_tokens", "max_tokens is required")
    (fields.COUNT_TOKENS if counting else fields.MESSAGES).refuse(body)
    conversation = Conversation()
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system", skip=is_billing_block)
        if system is not None:
            conversation.add({"role": "system", "content": system}, "system")
    _messages(conversation, body.get("messages"), owner)
    left_out: list[str] = []
    tools, tool_fields = _tools(body.get("tools"), left_out)
    thinking, effort, budget = _thinking(body.get("thinking"), body.get("output_config"))
    chat = {"messages": conversation.messages, "tools": tools,
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": _parallel(body.get("tool_choice")),
            "response_format": _output_format(body.get("output_config")),
            "stop": body.get("stop_sequences"), "stream": body.get("stream"),
            **{key: body.get(key) for key in ("temperature", "top_p", "top_k", "max_tokens",
                                              "cache_salt")}}
    translation = chat_request(chat, {**TOP_FIELDS, **conversation.fields, **tool_fields}, left_out)
    translation.request.thinking, translation.request.thinking_effort = thinking, effort
    translation.request.thinking_token_budget = budget
    translation.request.hints = parse_hints(body, priority=False)
    return translation


def _blocks(value: Json, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise invalid(where, "content must be a string or a list of content blocks")
    for b, block in enumerate(value):
        if not isinstance(block, dict):
            raise invalid(f"{where}[{b}]", "a content block must be an object")
    return value


def is_billing_block(block: Json) -> bool:
    """Claude Code's billing header, sent as a system text block: metadata, not prompt. Its
    version suffix and `cch` change on every request, so in the prompt it would make every
    turn's prefix differ from the last one's at the first system token."""
    return (isinstance(block, dict) and block.get("type") == "text"
            and isinstance(block.get("text"), str) and block["text"].startswith(BILLING_HEADER))


def without_billing(body: dict) -> dict:
    """The body as the prompt reads it, for comparing requests: without the billing block."""
    blocks = body.get("system")
    if not isinstance(blocks, list) or not any(is_billing_block(b) for b in blocks):
        return body
    return {**body, "system": [b for b in blocks if not is_billing_block(b)]}


def billing_block(body: dict) -> Optional[str]:
    """Where a request's billing block is (`system[0]`), if it has one."""
    system = body.get("system")
    blocks = system if isinstance(system, list) else []
    return next((f"system[{b}]" for b, block in enumerate(blocks) if is_billing_block(block)), None)


def _text_blocks(value: Json, where: str, skip: Callable[[dict], bool] = lambda block: False
                 ) -> Optional[str]:
    """`system` content: a string, or text blocks (cache_control is ignored); blocks `skip`
    names are left out, and None is returned when they were all there was."""
    if isinstance(value, str):
        return value
    parts, skipped = Parts(), False
    for b, block in enumerate(_blocks(value, where)):
        if block.get("type") != "text":
            raise invalid(f"{where}[{b}].type", "system content blocks must be of type text")
        text = string_field(block, "text", f"{where}[{b}]")
        if skip(block):
            skipped = True
        else:
            parts.text(text, f"{where}[{b}]")
    if skipped and not parts:
        return None
    return parts.content()  # type: ignore[return-value]  # text alone is a string


def _messages(conversation: Conversation, messages: Json, owner: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "each message must be an object")
        role, content = message.get("role"), message.get("content")
        if role == "user":
            _user(conversation, content, where)
        elif role == "assistant":
            conversation.add(_assistant(content, where, owner), where)
        elif role == "system":   # mid-conversation system text, a system turn where it stands
            conversation.add({"role": "system",
                              "content": _text_blocks(content, f"{where}.content")}, where)
        else:
            raise invalid(f"{where}.role", "role must be user, assistant or system")
    if messages[-1].get("role") == "assistant":
        raise invalid(f"messages[{len(messages) - 1}]", "a prefilled assistant reply is not "
                      "supported: the last message must be the user's")


def _user(conversation: Conversation, content: Json, where: str) -> None:
    if isinstance(content, str):
        conversation.add({"role": "user", "content": content}, where)
        return
    parts = Parts()
    for b, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{b}]"
        if block.get("type") == "tool_result":
            if parts:   # text before a result stays before it
                conversation.add({"role": "user", "content": parts.content()}, where, parts)
                parts = Parts()
            result = _tool_result(block, at)
            conversation.add({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", at),
                              "content": result.content()}, at, result)
        else:
            _part(parts, block, at)
    if parts:
        conversation.add({"role": "user", "content": parts.content()}, where, parts)


def _part(parts: Parts, block: dict, at: str) -> None:
    """A text or image block; an image's source becomes the data URL chat requests carry."""
    kind = block.get("type")
    if kind == "text":
        parts.text(string_field(block, "text", at), at)
        return
    if kind != "image":
        raise invalid(f"{at}.type", f"unsupported content block type {kind!r}")
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise invalid(f"{at}.source", "an image source must be of type base64 or url")
    if source["type"] == "url":   # refused when staged, as remote image URLs are on chat
        parts.image(string_field(source, "url", f"{at}.source"), f"{at}.source")
        return
    media = string_field(source, "media_type", f"{at}.source")
    parts.image(f"data:{media};base64,{string_field(source, 'data', f'{at}.source')}", f"{at}.source")


def _tool_result(block: dict, at: str) -> Parts:
    content, result = block.get("content"), Parts()
    if block.get("is_error") is True:
        result.text("Error:", at)   # the model is told the tool failed
    if isinstance(content, str):
        result.text(content, f"{at}.content")
    elif content is not None:
        for c, inner in enumerate(_blocks(content, f"{at}.content")):
            _part(result, inner, f"{at}.content[{c}]")
    return result


def _assistant(content: Json, where: str, owner: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for b, block in enumerate(_blocks(content, f"{where}.content")):
        at, kind = f"{where}.content[{b}]", block.get("type")
        if kind == "text":
            texts.append(string_field(block, "text", at))
        elif kind == "thinking":
            text = string_field(block, "thinking", at)
            # Not ours: left out; empty (a stream opened it before the reply chose text): nothing.
            if text and seal.verify(text, block.get("signature"), owner):
                reasoning.append(text)
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise invalid(f"{at}.input", "tool_use input must be an object")
            calls.append(tool_call(string_field(block, "id", at), string_field(block, "name", at), arguments))
        elif kind != "redacted_thinking":   # never made here, so never ours to render
            raise invalid(f"{at}.type", f"unsupported content block type {kind!r} in an "
                                        "assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Json, left_out: list[str]) -> tuple[Optional[list[dict]], dict[str, str]]:
    """Client tools as chat tools; server tools (typed, e.g. web_search_*) are left out."""
    if tools is None:
        return None, {}
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be a list")
    out: list[dict] = []
    fields: dict[str, str] = {}
    for j, tool in enumerate(tools):
        at = f"tools[{j}]"
        if not isinstance(tool, dict):
            raise invalid(at, "each tool must be an object")
        if tool.get("type") not in (None, "custom"):
            left_out.append(f"{tool.get('name')} ({tool['type']})")
            continue
        function: dict[str, Any] = {"name": string_field(tool, "name", at)}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"{at}.input_schema", "input_schema must be a JSON Schema object")
        function["parameters"] = tool["input_schema"]
        if tool.get("strict") is not None:   # enforced by constrained decoding when true
            function["strict"] = tool["strict"]
        fields[f"tools[{len(out)}]"] = fields[f"tools[{len(out)}].function"] = at
        fields[f"tools[{len(out)}].function.parameters"] = f"{at}.input_schema"
        out.append({"type": "function", "function": function})
    return out, fields


def _tool_choice(choice: Json) -> Json:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": string_field(choice, "name", "tool_choice")}}
    raise invalid("tool_choice", "tool_choice.type must be auto, any, tool or none")


def _parallel(choice: Json) -> bool:
    """Messages says it the other way round: disable_parallel_tool_use, on tool_choice."""
    disable = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if disable is not None and not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use",
                      "disable_parallel_tool_use must be a boolean")
    return not disable


def _thinking(thinking: Json, output_config: Json
              ) -> tuple[Optional[bool], Optional[str], Optional[int]]:
    """(thinking, effort, budget) by the table in the module's docstring. Anthropic refuses
    a budget under 1,024; serve honours any (a small one is what a slow model needs)."""
    on: Optional[bool] = None
    effort: Optional[str] = None
    budget: Optional[int] = None
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "disabled":
            return False, None, None
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise invalid("thinking.budget_tokens", "budget_tokens must be an integer >= 0")
            effort = next((level for bound, level in BUDGET_EFFORTS if budget < bound), "max")
        elif kind != "adaptive":
            raise invalid("thinking.type", "thinking.type must be enabled, disabled or adaptive")
        on = True
    if output_config is not None and not isinstance(output_config, dict):
        raise invalid("output_config", "output_config must be an object")
    given, given_effort = parse_reasoning_effort((output_config or {}).get("effort"),
                                                 "output_config.effort")
    if given is not None:
        on, effort = given, given_effort
    return on, effort, budget


def _output_format(output_config: Json) -> Optional[dict]:
    output_format = output_config.get("format") if isinstance(output_config, dict) else None
    if output_format is None:
        return None
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema" \
            or not isinstance(output_format.get("schema"), dict):
        raise invalid("output_config.format",
                      "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format["schema"]}}


# ---- replies ----------------------------------------------------------------


def _usage(reply: ChatReply) -> dict:
    # Anthropic counts the reused prefix apart from the input that was evaluated.
    usage = reply.usage
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesExchange:
    """One Messages request: its stream events as the deltas arrive, or its body at the end."""
    framing = SSE

    def __init__(self, body: dict, model: str, owner: str = ""):
        self.translation = parse_request(body, owner=owner)
        self.owner = owner   # whose signatures its thinking blocks carry
        self.request = self.translation.request
        self.left_out = self.translation.left_out
        self.ignored = unread(body)
        self.billing = billing_block(body)   # where the billing header was, for the log
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self._blocks = Blocks()

    def error(self, error: ApiError) -> ApiError:
        return self.translation.error(error)

    def opening(self, start: ReplyStart) -> bytes:
        # Zeros while the request still waits in line: message_delta says the size at the end.
        prompt = start.prompt_tokens or 0
        usage = {"input_tokens": prompt - start.cached_tokens, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": start.cached_tokens, "output_tokens": 0}
        return sse_named([{"type": "message_start", "message": self._message([], None, None, usage)}])

    def heartbeat(self, start: ReplyStart) -> bytes:
        """An empty delta of the open block, and a ping for the clients that count those.

        Claude Code counts only content events as signs of life (not ping), so the
        first heartbeat opens the block the reply will begin with, thinking or text;
        the reply's first delta goes on in it, or closes it when of another kind. A
        reply that begins before a heartbeat is due streams as Anthropic's API would.
        """
        steps = [] if self._blocks.blocks else self._blocks.open(
            "reasoning" if start.thinking else "text")
        block = self._blocks.current
        if block is not None:
            steps.append(("add", block, ""))
        return sse_named([event for step in steps for event in self._events(*step)]
                         + [{"type": "ping"}])

    def delta(self, delta: Delta) -> bytes:
        steps = self._blocks.feed(delta)   # the blocks both the stream and the body are made of
        if not self.request.stream:
            return b""
        return sse_named([event for step in steps for event in self._events(*step)])

    def closing(self, reply: ChatReply) -> bytes:
        events = [event for step in self._blocks.finish() for event in self._events(*step)]
        return sse_named(events + [
            {"type": "message_delta",
             "delta": {"stop_reason": self._stop_reason(reply),
                       "stop_sequence": reply.stop_sequence or None},
             "usage": _usage(reply), "waste": reply.usage.waste},
            {"type": "message_stop"}])

    def failed(self, error: ApiError) -> bytes:
        return sse_named([error_body(error)])

    def keep(self, reply: ChatReply) -> None:
        pass   # Messages keeps nothing: a client sends the whole conversation each time

    def body(self, reply: ChatReply) -> dict:
        self._blocks.finish()
        content = [self._content_block(block, final=True) for block in self._blocks.blocks]
        return {**self._message(content, self._stop_reason(reply), reply.stop_sequence or None,
                                _usage(reply)), "waste": reply.usage.waste}

    def _message(self, content: list, stop_reason: Optional[str], stop_sequence: Optional[str],
                 usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}

    @staticmethod
    def _stop_reason(reply: ChatReply) -> str:
        if reply.finish_reason in STOP_REASONS:
            return STOP_REASONS[reply.finish_reason]
        return "stop_sequence" if reply.stop_sequence else "end_turn"

    def _content_block(self, block: Block, final: bool) -> dict:
        """A block whole (final) or as content_block_start opens it (empty)."""
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if final else "",
                    "signature": seal.sign(block.text, self.owner) if final else ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if final else ""}
        return {"type": "tool_use", "id": _tool_id(block.call_id), "name": block.name,
                "input": _tool_input(block.text) if final else {}}

    def _events(self, step: str, block: Block, piece: str) -> list[dict]:
        if step == "open":
            return [{"type": "content_block_start", "index": block.index,
                     "content_block": self._content_block(block, final=False)}]
        if step == "add":
            delta = ({"type": "thinking_delta", "thinking": piece} if block.kind == "reasoning"
                     else {"type": "text_delta", "text": piece} if block.kind == "text"
                     else {"type": "input_json_delta", "partial_json": piece})
            return [{"type": "content_block_delta", "index": block.index, "delta": delta}]
        events = []
        if block.kind == "reasoning":   # the signature closes a thinking block
            events.append({"type": "content_block_delta", "index": block.index,
                           "delta": {"type": "signature_delta",
                                     "signature": seal.sign(block.text, self.owner)}})
        return events + [{"type": "content_block_stop", "index": block.index}]
