"""The OpenAI Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), at the edge:
its replies, blocking and streamed (the body read into the internal request:
serve/dialects/responses_request.py; the stored input's listing: serve/dialects/input_items.py).
"""
from __future__ import annotations

import time
from typing import Any, Optional

from serve.core.reply import Delta
from serve.dialects import seal
from serve.core.errors import ApiError, invalid
from serve.dialects.openai_request import unknown_fields
from serve.dialects.translation import Block, Blocks
from serve.dialects.input_items import stored_items
from serve.service.response_store import OwnedResponses
from serve.service.replies import ChatReply, ReplyStart
from serve.dialects.framing import SSE
from serve.dialects.sse import sse_named
from serve.dialects.responses_request import (ECHOED, FIELDS, INCLUDE_REASONING, new_id, parse,
                                              parse_request)

__all__ = ["ResponsesExchange", "FIELDS", "parse_request"]


# ---- replies ----------------------------------------------------------------


def _usage(prompt: int, cached: int, output: int, reasoning: int) -> dict:
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


class ResponsesExchange:
    """One Responses request: its stream events as the deltas arrive, or the Response at the end."""
    framing = SSE

    def __init__(self, body: dict, store: OwnedResponses, model: str):
        parsed = parse(body, store)
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
        self.id = new_id("resp")
        self.model = model
        self._created = time.time()
        self._blocks = Blocks()
        self._item_ids: dict[int, str] = {}
        self._sequence = 0
        self._incomplete = False
        self._done: Optional[dict] = None   # the final Response, once the reply is over
        self._start = ReplyStart()
        self._message: Optional[dict] = None   # the reply's message, once it is over
        self.background = body.get("background") is True
        self._logprobs: dict[int, list[dict]] = {}   # each text block's, as its deltas carried them
        self._piece_logprobs: list[dict] = []        # the delta's being written

    def error(self, error: ApiError) -> ApiError:
        return self.translation.error(error)

    # -- the stream -------------------------------------------------------------------

    def opening(self, start: ReplyStart) -> bytes:
        return sse_named(self.opening_events(start))

    def heartbeat(self, start: ReplyStart) -> bytes:
        """response.in_progress again: a data event (Codex's idle timer ignores comments),
        with the output so far (the open item as output_item.added showed it) and the usage as
        known before prefill."""
        current = self._blocks.current
        output = [self._item(block, block is not current) for block in self._blocks.blocks]
        return sse_named([self._event("response.in_progress", response=self._response(
            "in_progress", output, self._usage_at(start)))])

    def delta(self, delta: Delta) -> bytes:
        steps = self._feed(delta)
        if not self.request.stream:
            return b""
        return sse_named(self._step_events(steps))

    def keep(self, reply: ChatReply) -> None:
        """Store the Response before the client sees it, so its next request can name it."""
        if self.stored:
            self._store.put(self._final(reply), self._history + [reply.message], self._input_items)

    def closing(self, reply: ChatReply) -> bytes:
        return sse_named(self.closing_events(reply))

    def failed(self, error: ApiError) -> bytes:
        return sse_named(self.failed_events(error))

    def body(self, reply: ChatReply) -> dict:
        self._incomplete = reply.finish_reason == "length"
        self._blocks.finish()
        response = self._final(reply)
        return {**response, "output_text": "".join(
            part["text"] for item in response["output"] if item["type"] == "message"
            for part in item["content"])}

    # -- the same events as lists, for a background response (serve/http/background.py) ----

    def opening_events(self, start: ReplyStart) -> list[dict]:
        self._start = start
        response = self._response("in_progress", [], self._usage_at(start))
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta_events(self, delta: Delta) -> list[dict]:
        return self._step_events(self._feed(delta))

    def _feed(self, delta: Delta) -> list[tuple[str, Block, str]]:
        """One delta into the blocks and logprobs that both the stream and the Response are
        made of; the steps it took, for a stream's events."""
        self._piece_logprobs = delta.logprobs or []
        steps = self._blocks.feed(delta)
        for step, block, _ in steps:
            if step == "add" and block.kind == "text":
                self._logprobs.setdefault(block.index, []).extend(self._piece_logprobs)
        return steps

    def _step_events(self, steps: list[tuple[str, Block, str]]) -> list[dict]:
        return [event for step in steps for event in self._events(*step)]

    def closing_events(self, reply: ChatReply, status: Optional[str] = None) -> list[dict]:
        """The last events; `status` overrides the final one (a background response
        cancelled on purpose ends `cancelled`)."""
        self._incomplete = reply.finish_reason == "length" and status is None
        self._message = reply.message
        events = [event for step in self._blocks.finish() for event in self._events(*step)]
        response = self._final(reply)
        if status is not None:
            response["status"] = status
        kind = {"cancelled": "response.cancelled", None: "response.incomplete"
                if self._incomplete else "response.completed"}[status]
        return events + [self._event(kind, response=response)]

    def failed_events(self, error: ApiError) -> list[dict]:
        response = self._response("failed", [self._item(b, True) for b in self._blocks.blocks], None)
        response["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                             "message": error.message}
        self._done = response
        return [self._event("response.failed", response=response)]

    def snapshot(self, status: Optional[str]) -> dict:
        """The Response as it stands: its final one once there is one (`status` overriding
        it), else in `status` (queued, in_progress) with the output so far."""
        if self._done is not None:
            return {**self._done, "status": status} if status else self._done
        return self._now(status or "in_progress", self._start)

    def store_final(self) -> None:
        """Store the final Response (a background response's, once it has one)."""
        if self.stored and self._done is not None:
            message = [self._message] if self._message is not None else []
            self._store.put(self._done, self._history + message, self._input_items)

    def _now(self, status: str, start: ReplyStart) -> dict:
        """The Response in `status`, each item with what it holds so far (a poll shows it)."""
        current = self._blocks.current
        output = []
        for block in self._blocks.blocks:
            item = self._item(block, True)
            if block is current:
                item["status"] = "in_progress"
            output.append(item)
        return self._response(status, output, self._usage_at(start))

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
                "background": self.background, "error": None, "incomplete_details": None,
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
        item_id = self._item_ids.setdefault(block.index, new_id(
            {"reasoning": "rs", "text": "msg", "tool": "fc"}[block.kind]))
        last = block is self._blocks.blocks[-1]
        status = "incomplete" if done and last and self._incomplete else \
            "completed" if done else "in_progress"
        if block.kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [],
                    "content": [self._part(block)] if done else []}
            if done and self._seal:
                item["encrypted_content"] = seal.seal(block.text, self._store.owner)
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

    def _part(self, block: Block, text: Optional[str] = None) -> dict:
        text = block.text if text is None else text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self._logprobs.get(block.index, [])}

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
                                delta=piece, logprobs=self._piece_logprobs)]
        if block.kind == "tool":
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=self._item(block, True)["name"], arguments=block.text)]
        else:
            done = ({"text": block.text} if block.kind == "reasoning"
                    else {"text": block.text, "logprobs": self._logprobs.get(block.index, [])})
            kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
            events = [self._event(f"response.{kind}.done", **where, content_index=0, **done),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=self._part(block))]
        return events + [self._event("response.output_item.done", output_index=block.index,
                                     item=self._item(block, True))]
