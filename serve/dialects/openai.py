"""OpenAI's chat completions and completions (`POST /v1/chat/completions`, `/v1/completions`).

The body is the internal request as it is (serve/dialects/openai_request.py validates it); the
reply is a chat.completion or text_completion, or their chunks on a stream
that ends with `data: [DONE]`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from serve.core.ids import new_id, now
from serve.dialects.openai_request import (CHAT_FIELDS, COMPLETION_FIELDS, parse_chat_request,
                                           parse_completion_request, unknown_fields)
from serve.dialects.openai_shapes import chat_chunk, chat_completion, text_completion, usage_chunk
from serve.core.errors import ApiError
from serve.core.reply import Delta
from serve.core.request import ChatRequest, CompletionRequest
from serve.service.logprobs import chat_logprobs, completion_logprobs, text_length
from serve.service.replies import ChatReply, CompletionReply, ReplyStart
from serve.dialects.framing import SSE
from serve.dialects.sse import SSE_DONE, sse_comment, sse_encoder, sse_event


def _chat_delta(delta: Delta) -> dict:
    """A delta as a chat.completion.chunk's `delta`."""
    if delta.reasoning_content:
        return {"reasoning_content": delta.reasoning_content}
    if delta.tool_call is not None:
        return {"tool_calls": [delta.tool_call]}
    return {"content": delta.content}


class _OpenAIStream:
    """What chat and completions streams share: plain `data:` events, [DONE] at the end."""
    request: ChatRequest | CompletionRequest
    left_out: list[str] = []
    framing = SSE

    model: str
    _encoder: Optional[Callable[[Any], bytes]] = None

    def _chunk(self, part: Any) -> dict:
        """The chunk that carries one varying part (a chat delta, a completion's text)."""
        raise NotImplementedError

    def _encode(self, part: Any) -> bytes:
        """The varying part -> the SSE event of its chunk. The encoder is made at the first
        part: by then `model` names the model that answers (the server sets it after parsing).
        It keeps bytes only, not this exchange: no cycle holds a request past its reply."""
        if self._encoder is None:
            self._encoder = sse_encoder(self._chunk)
        return self._encoder(part)

    def error(self, error: ApiError) -> ApiError:
        return error   # the request's fields are OpenAI's own

    def heartbeat(self, start: ReplyStart) -> bytes:
        # The openai clients skip comments; the bytes reset their read timeouts, and proxies'.
        return sse_comment("keepalive")

    def failed(self, error: ApiError) -> bytes:
        return sse_event(error.body()) + SSE_DONE

    def keep(self, reply: object) -> None:
        pass

    def _close(self, final: dict, usage: dict) -> bytes:
        events = [final, usage] if self.request.include_usage else [final]
        return b"".join(sse_event(event) for event in events) + SSE_DONE


class ChatExchange(_OpenAIStream):
    def __init__(self, body: dict, model: str):
        self.request = parse_chat_request(body)
        self.ignored = unknown_fields(body, CHAT_FIELDS)
        self._id, self._created, self.model = new_id("chatcmpl"), now(), model

    def _chunk(self, part: Any) -> dict:
        return chat_chunk(self._id, self._created, self.model, part)

    def opening(self, start: ReplyStart) -> bytes:
        return self._encode({"role": "assistant", "content": ""}) if self.request.stream else b""

    def delta(self, delta: Delta) -> bytes:
        if not self.request.stream:
            return b""   # the blocking body is the reply's message
        if delta.logprobs is not None:  # the entries go beside the delta, not in it
            return sse_event(chat_chunk(self._id, self._created, self.model, _chat_delta(delta),
                                        logprobs=chat_logprobs(delta.logprobs)))
        return self._encode(_chat_delta(delta))

    def closing(self, reply: ChatReply) -> bytes:
        return self._close(chat_chunk(self._id, self._created, self.model, {}, reply.finish_reason),
                           usage_chunk(self._id, self._created, self.model,
                                       "chat.completion.chunk", reply.usage))

    def body(self, reply: ChatReply) -> dict:
        return chat_completion(self._id, self._created, self.model, reply.message,
                               reply.finish_reason, reply.usage, reply.logprobs)


class CompletionExchange(_OpenAIStream):
    request: CompletionRequest

    def __init__(self, body: dict, model: str):
        self.request = parse_completion_request(body)
        self.ignored = unknown_fields(body, COMPLETION_FIELDS)
        self._id, self._created, self.model = new_id("cmpl"), now(), model
        self._offset = 0   # text_offset continues from chunk to chunk

    def _chunk(self, part: Any) -> dict:
        return text_completion(self._id, self._created, self.model, part, None)

    def opening(self, start: ReplyStart) -> bytes:
        # echo: the prompt comes first, as the text the reply continues
        return self._encode(self.request.prompt) if self.request.echo else b""

    def delta(self, delta: Delta) -> bytes:
        if not self.request.stream:
            return b""
        if delta.logprobs is None:
            return self._encode(delta.content)
        entries = delta.logprobs
        logprobs = completion_logprobs(entries, self._offset)
        self._offset += sum(text_length(e) for e in entries)
        return sse_event(text_completion(self._id, self._created, self.model, delta.content,
                                         None, logprobs=logprobs))

    def closing(self, reply: CompletionReply) -> bytes:
        return self._close(text_completion(self._id, self._created, self.model, "",
                                           reply.finish_reason),
                           usage_chunk(self._id, self._created, self.model, "text_completion",
                                       reply.usage))

    def body(self, reply: CompletionReply) -> dict:
        text = self.request.prompt + reply.text if self.request.echo else reply.text
        return text_completion(self._id, self._created, self.model, text,
                               reply.finish_reason, reply.usage, reply.logprobs)
