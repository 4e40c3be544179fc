"""Responses kept for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`
and `GET /v1/responses/{id}/input_items`.

In memory, bounded by count and by JSON size, oldest out first. With a
shared tier (--shared-cache), each response is also published there as a
file of its own (atomic, checked: serve/snapshots/shared_dir.py), and a
response this host does not hold is looked for there: a `previous_response_id`
chain goes on on another host, and after a restart. Without one, a restart
forgets every stored response.

Every response belongs to the namespace of the key that made it (ChatRequest.owner,
serve/http/auth.py): `of(owner)` is the store as that owner sees it. Another
owner's id is not found, exactly as an id that was never made: the same 404, the
same 400 for previous_response_id, and its reasoning items are not its to recall.
In the shared tier an owner's response file is named by a hash of owner and id,
so a listing says neither whose it is nor which id it holds.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from serve.snapshots.shared_dir import Rejected, SharedDir

STORE_RESPONSES = 256           # responses kept, at most
STORE_BYTES = 64 * 1024 * 1024  # and their JSON size, at most
SHARED_BYTES = 1 << 30          # the shared tier's responses, at most
FILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}")   # ids this server makes; nothing else is a path


@dataclass
class Stored:
    response: dict
    conversation: list[dict]   # the chat messages up to and including this reply, no instructions
    input_items: list[dict]    # as listed by input_items (serve/dialects/input_items.py)
    size: int
    owner: str = ""


def owned_name(owner: str, response_id: str) -> str:
    """Where an owner's response is kept, here and as a file in the shared tier."""
    if not owner:
        return response_id
    return hashlib.blake2b(f"{owner}\0{response_id}".encode("utf-8", "surrogatepass"),
                           digest_size=20).hexdigest()


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

    def of(self, owner: str) -> "OwnedResponses":
        """The store as `owner` sees it: only its own responses."""
        return OwnedResponses(self, owner)

    def put(self, response: dict, conversation: list[dict], input_items: list[dict],
            owner: str = "") -> None:
        self._keep(response, conversation, input_items, owner)
        if self.shared is not None and FILE_NAME.fullmatch(response["id"]):
            body = json.dumps({"response": response, "conversation": conversation,
                               "input_items": input_items, "owner": owner}).encode()
            self.shared.publish(owned_name(owner, response["id"]), "response", {}, [body], len(body))

    def _keep(self, response: dict, conversation: list[dict], input_items: list[dict],
              owner: str) -> None:
        size = sum(len(json.dumps(part)) for part in (response, conversation, input_items))
        key = owned_name(owner, response["id"])
        with self._lock:
            if key in self._entries:
                self._forget(key)
            self._entries[key] = Stored(response, conversation, input_items, size, owner)
            self._bytes += size
            self._reasoning.update({owned_name(owner, item): text for item, text
                                    in _reasoning_items(response).items()})
            while self._entries and (len(self._entries) > self.max_responses
                                     or self._bytes > self.max_bytes):
                self._forget(next(iter(self._entries)))

    def get(self, response_id: str, owner: str = "") -> Optional[Stored]:
        key = owned_name(owner, response_id)
        with self._lock:
            stored = self._entries.get(key)
        if stored is not None or self.shared is None or not FILE_NAME.fullmatch(response_id):
            return stored
        return self._fetch(response_id, owner)

    def _fetch(self, response_id: str, owner: str) -> Optional[Stored]:
        """A response another host (or this one before a restart) published, checked."""
        assert self.shared is not None
        key = owned_name(owner, response_id)
        found = self.shared.read_whole(key, listed=False)
        if found is None:
            return None
        try:
            parts = json.loads(found[1])
            response, conversation, items = (parts["response"], parts["conversation"],
                                             parts["input_items"])
            if not isinstance(response, dict) or response.get("id") != response_id \
                    or parts.get("owner", "") != owner:
                raise ValueError("another response")
        except (ValueError, KeyError, TypeError, AttributeError):
            self.shared.reject(key, Rejected("damaged", f"{key} is not that response"))
            return None
        self._keep(response, conversation, items, owner)
        with self._lock:
            return self._entries.get(key)

    def reasoning(self, item_id: object, owner: str = "") -> Optional[str]:
        if not isinstance(item_id, str):
            return None
        with self._lock:
            return self._reasoning.get(owned_name(owner, item_id))

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Forget a response here and in the shared tier; False when neither held it."""
        found = self.get(response_id, owner) is not None
        key = owned_name(owner, response_id)
        with self._lock:
            if key in self._entries:
                self._forget(key)
        if found and self.shared is not None:
            self.shared.remove(key)
        return found

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, key: str) -> None:
        stored = self._entries.pop(key)
        self._bytes -= stored.size
        for item_id in _reasoning_items(stored.response):
            self._reasoning.pop(owned_name(stored.owner, item_id), None)


class OwnedResponses:
    """One owner's view of the store: what the Responses dialect and its endpoints use."""

    def __init__(self, store: ResponseStore, owner: str):
        self.store, self.owner = store, owner

    def put(self, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
        self.store.put(response, conversation, input_items, self.owner)

    def get(self, response_id: str) -> Optional[Stored]:
        return self.store.get(response_id, self.owner)

    def reasoning(self, item_id: object) -> Optional[str]:
        return self.store.reasoning(item_id, self.owner)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id, self.owner)


def _reasoning_items(response: dict) -> dict[str, str]:
    return {item["id"]: "".join(part["text"] for part in item["content"])
            for item in response["output"] if item["type"] == "reasoning"}
