"""Where a prompt is worth a snapshot: the ends of the parts conversations share.

An agent's requests begin with the same tool declarations; the projects it
works in differ only in the system prompt that follows; a conversation then
grows turn by turn.  A snapshot at the end of the tools block and one at the
end of the leading system messages let a new conversation, or another
project, skip what it shares with an earlier one.  K3's prompt puts the
tool_choice and response_format notes after the conversation, where the next
turn's messages will go, so when there are notes the conversation before
them is a boundary too.  The renderer says where each message ends, so the
boundaries come from the one rendering of the conversation.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from serve.core.client_json import JsonObject
from serve.formats.base import Rendering

_SYSTEM_ROLES = ("system", "developer")


def preamble_ends(conversation: Rendering, messages: Sequence[JsonObject],
                  notes: bool) -> list[int]:
    """Segment counts at which the tool declarations, the leading system messages
    and the messages before any trailing notes end within the rendered conversation.

    `notes` says whether the request has tool_choice or response_format notes,
    which K3's prompt puts after the conversation. A boundary is where the
    renderer says one message ends and the next begins; one at either end of
    the conversation is no boundary.
    """
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], Mapping) \
            and messages[lead].get("role") in _SYSTEM_ROLES:
        lead += 1
    wanted = [0, lead, *([len(messages)] if notes else [])]
    ends = {conversation.ends[n] for n in wanted if n in conversation.ends}
    return sorted(n for n in ends if 0 < n < len(conversation.segments))


def spaced(start: int, end: int, spacing: int) -> list[int]:
    """The multiples of `spacing` strictly between start and end (--prefix-cache-spacing: at
    multiples, so that two prompts sharing a long prefix checkpoint the same places)."""
    first = (start // spacing + 1) * spacing
    return list(range(first, end, spacing))
