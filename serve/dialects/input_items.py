"""The input items of a stored Response, listed by `GET /v1/responses/{id}/input_items`.

A response chained by `previous_response_id` lists its whole context, as
OpenAI's does: the previous response's input items and output, then its own
input. Items are kept as the client sent them, with an `id` given at store
time to those that came without one (a plain string input is one user
message), so a listing names the same ids every time.
"""
from __future__ import annotations

import uuid
from typing import Optional

from serve.core.client_json import Json
from serve.core.errors import invalid

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
               "reasoning": "rs"}


def stored_items(value: Json, earlier: list[dict]) -> list[dict]:
    """The items a response lists: `earlier` (its chain's), then the request's `input`
    (already validated), each with an id unique in the list, for cursors to find."""
    items = list(earlier)
    seen = {item["id"] for item in items}
    given = [{"role": "user", "content": value}] if isinstance(value, str) else value
    for item in given:
        item = {"type": "message", **item}
        if item["type"] == "message":
            item = _message(item)
        if not isinstance(item.get("id"), str) or item["id"] in seen:
            item["id"] = f"{ID_PREFIXES.get(item['type'], 'item')}_{uuid.uuid4().hex}"
        seen.add(item["id"])
        items.append(item)
    return items


def _message(item: dict) -> dict:
    """A message as OpenAI lists it: content as parts, even when it was sent as a string."""
    if isinstance(item.get("content"), str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        part = {"type": kind, "text": item["content"]}
        item["content"] = [{**part, "annotations": []} if kind == "output_text" else part]
    return {"status": "completed", **item}


def listing(items: list[dict], query: dict[str, str]) -> dict:
    """One page of `items` as OpenAI's list object; `query` holds limit, order, after, before."""
    limit = query.get("limit", str(DEFAULT_LIMIT))
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= MAX_LIMIT):
        raise invalid("limit", f"limit must be an integer from 1 to {MAX_LIMIT}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "order must be asc or desc")
    listed = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in listed]
    start = _position(ids, query.get("after"), "after") + 1 if "after" in query else 0
    end = _position(ids, query.get("before"), "before") if "before" in query else len(ids)
    window = listed[start:end]
    # `before` asks for the page just before that item, the end of the window.
    page = window[-int(limit):] if "before" in query and "after" not in query else window[:int(limit)]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(page) < len(window)}


def _position(ids: list[str], item_id: Optional[str], param: str) -> int:
    if item_id not in ids:
        raise invalid(param, f"{param} names no input item of this response: {item_id!r}")
    return ids.index(item_id)
