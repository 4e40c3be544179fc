"""Where a prompt is worth a snapshot: the ends of the parts conversations share.

An agent's requests begin with the same tool declarations; the projects it
works in differ only in the system prompt that follows; a conversation then
grows turn by turn.  A snapshot at the end of the tools block and one at the
end of the leading system messages let a new conversation, or another
project, skip what it shares with an earlier one.  K3's prompt puts the
tool_choice and response_format notes after the conversation, where the next
turn's messages will go, so when there are notes the conversation before
them is a boundary too.  The boundaries are found by rendering those parts
on their own (the renderer is not changed) and checking that they begin the
whole prompt's segments exactly.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from .chat_format import ChatFormatError

# Inside a very long stretch, a snapshot every SPACING positions (at multiples
# of it, so that two prompts sharing a long prefix checkpoint the same places).
SPACING = 4096

_SYSTEM_ROLES = ("system", "developer")


def preamble_ends(render: Callable[[list], list], messages: Sequence[Mapping[str, Any]],
                  segments: Sequence[Any], notes: bool) -> list[int]:
    """Segment counts at which the tool declarations, the leading system messages
    and the messages before any trailing notes end within `segments` (the whole
    rendered conversation).

    `render(messages)` renders the same request with only those messages, no
    tool_choice or response_format notes and no generation prompt; a part that
    does not render, or does not begin `segments` exactly, gives no boundary.
    `notes` says whether the request has such notes at all (else the whole
    conversation is not rendered a second time for nothing).
    """
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], Mapping) \
            and messages[lead].get("role") in _SYSTEM_ROLES:
        lead += 1
    ends = set()
    for part in ([], list(messages[:lead]), *([list(messages)] if notes else [])):
        try:
            rendered = render(part)
        except (ChatFormatError, ValueError, TypeError):  # e.g. an image in a system message: no boundary there
            continue
        n = len(rendered)
        if 0 < n < len(segments) and list(segments[:n]) == list(rendered):
            ends.add(n)
    return sorted(ends)


def spaced(start: int, end: int, spacing: int = SPACING) -> list[int]:
    """The multiples of `spacing` strictly between start and end."""
    first = (start // spacing + 1) * spacing
    return list(range(first, end, spacing))
