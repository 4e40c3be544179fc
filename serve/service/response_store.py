"""Responses kept for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`
and `GET /v1/responses/{id}/input_items`.

In memory only, bounded by count and by JSON size, oldest out first: a
restart forgets every stored response.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

STORE_RESPONSES = 256           # responses kept, at most
STORE_BYTES = 64 * 1024 * 1024  # and their JSON size, at most


@dataclass
class Stored:
    response: dict
    conversation: list[dict]   # the chat messages up to and including this reply, no instructions
    input_items: list[dict]    # as listed by input_items (serve/dialects/input_items.py)
    size: int


class ResponseStore:
    """The most recent responses. Reasoning items are indexed by id, so a client
    that sends an output item back as input gets its reasoning into the prompt."""

    def __init__(self, max_responses: int = STORE_RESPONSES, max_bytes: int = STORE_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, Stored]" = OrderedDict()
        self._reasoning: dict[str, str] = {}
        self._bytes = 0

    def put(self, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
        size = sum(len(json.dumps(part)) for part in (response, conversation, input_items))
        with self._lock:
            self._entries[response["id"]] = Stored(response, conversation, input_items, size)
            self._bytes += size
            self._reasoning.update(_reasoning_items(response))
            while self._entries and (len(self._entries) > self.max_responses
                                     or self._bytes > self.max_bytes):
                self._forget(next(iter(self._entries)))

    def get(self, response_id: str) -> Optional[Stored]:
        with self._lock:
            return self._entries.get(response_id)

    def reasoning(self, item_id: object) -> Optional[str]:
        with self._lock:
            return self._reasoning.get(item_id) if isinstance(item_id, str) else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            if response_id not in self._entries:
                return False
            self._forget(response_id)
            return True

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, response_id: str) -> None:
        stored = self._entries.pop(response_id)
        self._bytes -= stored.size
        for item_id in _reasoning_items(stored.response):
            self._reasoning.pop(item_id, None)


def _reasoning_items(response: dict) -> dict[str, str]:
    return {item["id"]: "".join(part["text"] for part in item["content"])
            for item in response["output"] if item["type"] == "reasoning"}
