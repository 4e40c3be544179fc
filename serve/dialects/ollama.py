"""Ollama's API (`POST /api/chat`, `/api/generate`), at the edge (requests:
serve/dialects/ollama_request.py; the model listings: serve/dialects/ollama_models.py).

A reply streams as NDJSON (serve/dialects/framing.py), Ollama's default, one
object per piece: `message.content` or `message.thinking` (a chat),
`response` or `thinking` (a generate), and a chat's tool calls each whole in
its own object, with its arguments as an object. The last object says
`done: true`, `done_reason` (`stop`, or `length` when the reply was cut) and
the timings, in nanoseconds: `total_duration` from the body's arrival to the
reply's end, `load_duration` the part before prefill began (the wait for the
engine: the model is always loaded), `prompt_eval_duration` the prefill up to
the first token, `eval_duration` from there to the last; `prompt_eval_count` is
the prompt's positions evaluated (those restored from a snapshot are not), and
`eval_count` the tokens generated. It also carries serve's `waste` object.

A call whose arguments are not a JSON object (a call cut by `num_predict`) is
never sent as one: `done_reason` says `length`. Errors are `{"error": "..."}`,
with the HTTP status before a stream opens and as the stream's last line after.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Optional

from serve.core.errors import ApiError
from serve.core.reply import Delta, ToolCall, Usage
from serve.core.request import ChatRequest, CompletionRequest
from serve.dialects.framing import NDJSON, ndjson_line
from serve.dialects.ollama_request import (CHAT_FIELDS, GENERATE_FIELDS, Completion, parse_chat,
                                           parse_generate, unread_options)
from serve.dialects.openai_request import unknown_fields
from serve.dialects.translation import Translation
from serve.service.replies import ChatReply, CompletionReply, ReplyStart

TAG = ":latest"   # Ollama's tag for a name that gives none


def error_body(error: ApiError) -> dict:
    """Ollama's error shape; with no `param` field, the message names the field."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"error": message}


def ollama_name(model_id: str) -> str:
    """A model's name as Ollama lists it: with a tag."""
    return model_id if ":" in model_id else model_id + TAG


def model_id(name: str) -> str:
    """The id a name a client sends stands for: with or without `:latest`."""
    return name.removesuffix(TAG)


def created_at() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def timings(usage: Usage, began: float) -> dict:
    """Ollama's counts and durations (nanoseconds), from serve's own figures."""
    waste = usage.waste
    total = time.monotonic() - began
    generating = waste.get("ms", 0.0) / 1000.0
    return {"total_duration": _ns(total), "load_duration": _ns(max(0.0, total - generating)),
            "prompt_eval_count": usage.prompt_tokens - usage.cached_tokens,
            "prompt_eval_duration": _ns(waste.get("first_token_ms", 0.0) / 1000.0),
            "eval_count": usage.completion_tokens,
            "eval_duration": _ns(waste.get("decode_ms", 0.0) / 1000.0)}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def ollama_call(index: int, call_id: str, name: str, arguments: str) -> Optional[dict]:
    """A call in Ollama's shape, or None when its arguments are not an object (cut short: a
    whole call with none has "{}")."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    return {"id": call_id, "function": {"index": index, "name": name, "arguments": parsed}}


def _calls(calls: list[ToolCall]) -> list[dict]:
    made = (ollama_call(i, c["id"], c["function"]["name"], c["function"]["arguments"])
            for i, c in enumerate(calls))
    return [c for c in made if c is not None]


class _OllamaExchange:
    """What chat and generate share: NDJSON pieces, the final object, errors."""
    framing = NDJSON
    left_out: list[str] = []   # Ollama has no server-side tools
    request: ChatRequest | CompletionRequest
    _text = "response"         # the field a piece's text goes in

    def __init__(self, translation: Translation | Completion, model: str, ignored: list[str]):
        self.translation = translation
        self.request = translation.request
        self.model = model
        self.ignored = ignored
        self._began = time.monotonic()
        self._logprobs: list[dict] = []   # every delta's entries: the blocking reply's too

    def error(self, error: ApiError) -> ApiError:
        return self.translation.error(error)

    def opening(self, start: ReplyStart) -> bytes:
        return b""   # Ollama's stream begins with the reply's first piece

    def heartbeat(self, start: ReplyStart) -> bytes:
        return ndjson_line(self._piece({}))   # a piece that adds nothing (framing.py says why)

    def failed(self, error: ApiError) -> bytes:
        return ndjson_line(error_body(error))

    def keep(self, reply: object) -> None:
        pass   # nothing outlives the request

    def delta(self, delta: Delta) -> bytes:
        if delta.logprobs:
            self._logprobs.extend(delta.logprobs)
        if not self.request.stream:
            return b""   # the blocking body is built from the reply
        return b"".join(ndjson_line(piece) for piece in self._pieces(delta))

    def _pieces(self, delta: Delta) -> list[dict]:
        fields = ({"thinking": delta.reasoning_content} if delta.reasoning_content
                  else {self._text: delta.content})
        piece = self._piece(fields)
        if delta.logprobs:
            piece["logprobs"] = delta.logprobs   # beside the message, as Ollama sends them
        return [piece]

    def _head(self) -> dict:
        return {"model": ollama_name(self.model), "created_at": created_at()}

    def _done(self, reply: ChatReply | CompletionReply) -> dict:
        done = {"done": True, "done_reason": "length" if reply.finish_reason == "length" else "stop",
                **timings(reply.usage, self._began)}
        if self._logprobs and not self.request.stream:
            done["logprobs"] = self._logprobs
        return {**done, "waste": reply.usage.waste}

    def _piece(self, fields: dict) -> dict:
        raise NotImplementedError


class OllamaChatExchange(_OllamaExchange):
    """One /api/chat request: `message` pieces, a tool call whole when its last piece is in."""
    _text = "content"

    def __init__(self, body: dict, model: str, context: int):
        super().__init__(parse_chat(body, context), model,
                         unknown_fields(body, CHAT_FIELDS) + unread_options(body))
        self._call: Optional[dict] = None   # the streamed call still being read
        self._index = 0                     # calls sent so far

    def _piece(self, fields: dict) -> dict:
        return {**self._head(), "message": {"role": "assistant", "content": "", **fields},
                "done": False}

    def _pieces(self, delta: Delta) -> list[dict]:
        call = delta.tool_call
        if call is None:
            return self._flush() + super()._pieces(delta)
        function = call.get("function") or {}
        if "id" in call:   # a call's first piece: the one before it is whole
            pieces = self._flush()
            self._call = {"id": call["id"], "name": function.get("name", ""), "arguments": ""}
        else:
            pieces = []
        if self._call is not None:
            self._call["arguments"] += function.get("arguments", "")
        return pieces

    def _flush(self) -> list[dict]:
        call, self._call = self._call, None
        made = None if call is None else ollama_call(self._index, call["id"], call["name"],
                                                     call["arguments"])
        if made is None:
            return []
        self._index += 1
        return [self._piece({"tool_calls": [made]})]

    def closing(self, reply: ChatReply) -> bytes:
        pieces = self._flush() + [{**self._head(), "message": {"role": "assistant", "content": ""},
                                   **self._done(reply)}]
        return b"".join(ndjson_line(piece) for piece in pieces)

    def body(self, reply: ChatReply) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": reply.message.get("content") or ""}
        if reply.message.get("reasoning_content"):
            message["thinking"] = reply.message["reasoning_content"]
        calls = _calls(reply.message.get("tool_calls") or [])
        if calls:
            message["tool_calls"] = calls
        return {**self._head(), "message": message, **self._done(reply)}


class OllamaGenerateExchange(_OllamaExchange):
    """One /api/generate request: `response` pieces (a raw prompt's are a completion's)."""

    def __init__(self, body: dict, model: str, context: int):
        super().__init__(parse_generate(body, context), model,
                         unknown_fields(body, GENERATE_FIELDS) + unread_options(body))

    @property
    def raw(self) -> bool:
        return isinstance(self.request, CompletionRequest)

    def _piece(self, fields: dict) -> dict:
        return {**self._head(), "response": "", **fields, "done": False}

    def closing(self, reply: ChatReply | CompletionReply) -> bytes:
        return ndjson_line({**self._head(), "response": "", **self._done(reply)})

    def body(self, reply: ChatReply | CompletionReply) -> dict:
        if isinstance(reply, CompletionReply):
            return {**self._head(), "response": reply.text, **self._done(reply)}
        thinking = reply.message.get("reasoning_content")
        return {**self._head(), "response": reply.message.get("content") or "",
                **({"thinking": thinking} if thinking else {}), **self._done(reply)}
