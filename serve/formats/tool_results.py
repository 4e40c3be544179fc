"""Tool results matched to the calls they answer, for every chat format that renders them."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from serve.core.client_json import Json, JsonObject
from serve.formats.base import PromptError


def _call_name(call: JsonObject) -> Optional[str]:
    return (call.get("function") or {}).get("name")


def resolve_tool_results(run: Sequence[JsonObject], calls: Sequence[JsonObject],
                         answered: int, first: int) -> list[tuple[int, str]]:
    """A run of tool results as (place in the run, tool name), in the order they render.

    `calls` are the calls of the latest assistant turn, `answered` how many
    results already followed it, `first` the run's place in `messages`.
    OpenAI clients may return results in any order, and the model expects
    them in the order of its calls, so a run whose every result names a call
    by `tool_call_id` is re-sorted; a run with any other result stays as sent,
    since its results can only be matched by position.
    """
    position_by_id: dict[Json, int] = {}   # keyed by what clients send as tool_call_id
    for i, call in enumerate(calls):
        if isinstance(call.get("id"), str):
            position_by_id.setdefault(call["id"], i)
    matched = [position_by_id.get(message.get("tool_call_id")) for message in run]
    order = list(range(len(run)))
    if None not in matched:
        order.sort(key=lambda k: matched[k] or 0)   # none is None here
    resolved = []
    for place, k in enumerate(order):
        message, at, call_at = run[k], answered + place, matched[k]
        name = ((_call_name(calls[call_at]) if call_at is not None else None)
                or message.get("tool") or message.get("name")
                or (_call_name(calls[at]) if at < len(calls) else None))
        if not name:
            raise PromptError(f"messages[{first + k}]", "is a tool result with no tool name: "
                              "give the tool_call_id of a call in the assistant message before it, "
                              "or a tool or name field")
        resolved.append((k, name))
    return resolved
