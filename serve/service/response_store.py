"""Responses kept for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`
and `GET /v1/responses/{id}/input_items`.

In memory, bounded by count and by JSON size, oldest out first. With a
shared tier (--shared-cache), each response is also published there as a
file of its own (atomic, checked: serve/snapshots/shared_dir.py), and a
response this host does not hold is looked for there: a `previous_response_id`
chain goes on on another host, and after a restart. Without one, a restart
forgets every stored response.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from serve.snapshots.shared_dir import Rejected, SharedDir

STORE_RESPONSES = 256           # responses kept, at most
STORE_BYTES = 64 * 1024 * 1024  # and their JSON size, at most
SHARED_BYTES = 1 << 30          # the shared tier's responses, at most
_FILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}")   # ids this server makes; nothing else is a path


@dataclass
class Stored:
    response: dict
    conversation: list[dict]   # the chat messages up to and including this reply, no instructions
    input_items: list[dict]    # as listed by input_items (serve/dialects/input_items.py)
    size: int


class ResponseStore:
    """The most recent responses. Reasoning items are indexed by id, so a client
    that sends an output item back as input gets its reasoning into the prompt."""

    def __init__(self, max_responses: int = STORE_RESPONSES, max_bytes: int = STORE_BYTES,
                 shared: Optional[SharedDir] = None):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.shared = shared
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, Stored]" = OrderedDict()
        self._reasoning: dict[str, str] = {}
        self._bytes = 0

    def put(self, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
        self._keep(response, conversation, input_items)
        if self.shared is not None and _FILE_NAME.fullmatch(response["id"]):
            body = json.dumps({"response": response, "conversation": conversation,
                               "input_items": input_items}).encode()
            self.shared.publish(response["id"], "response", {}, [body], len(body))

    def _keep(self, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
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
            stored = self._entries.get(response_id)
        if stored is not None or self.shared is None or not _FILE_NAME.fullmatch(response_id):
            return stored
        return self._fetch(response_id)

    def _fetch(self, response_id: str) -> Optional[Stored]:
        """A response another host (or this one before a restart) published, checked."""
        assert self.shared is not None
        found = self.shared.read_whole(response_id, listed=False)
        if found is None:
            return None
        try:
            parts = json.loads(found[1])
            response, conversation, items = (parts["response"], parts["conversation"],
                                             parts["input_items"])
            if not isinstance(response, dict) or response.get("id") != response_id:
                raise ValueError("another response")
        except (ValueError, KeyError, TypeError):
            self.shared.reject(response_id, Rejected("damaged", f"{response_id} is not that response"))
            return None
        self._keep(response, conversation, items)
        with self._lock:
            return self._entries.get(response_id)

    def reasoning(self, item_id: object) -> Optional[str]:
        with self._lock:
            return self._reasoning.get(item_id) if isinstance(item_id, str) else None

    def delete(self, response_id: str) -> bool:
        """Forget a response here and in the shared tier; False when neither held it."""
        found = self.get(response_id) is not None
        with self._lock:
            if response_id in self._entries:
                self._forget(response_id)
        if found and self.shared is not None:
            self.shared.remove(response_id)
        return found

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
