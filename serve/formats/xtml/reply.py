"""Reads a K3 reply (XTML) back into reasoning, content and OpenAI tool calls, as it streams.

Two ways in, one state machine: `feed_token` takes structure only from the four marker
token ids, so text a model *spells* like markup stays text; `feed` is for hosts that only
see text and finds the markers by scanning, which cannot make that distinction.

Malformed output is normal (token limits cut replies anywhere), so nothing here raises:
broken structure is dropped or read as text, and whatever is open at the end is closed,
except a tool call's arguments: a call cut off stays as the model left it (truncated JSON),
so no client can take it for a finished one.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from serve.core.reply import default_call_id, Delta, Deltas, Reply, read_calls
from serve.formats.xtml.render import CLOSE, END_OF_MSG, MARKUP_TOKENS, OPEN, SEP, unescape_attr

_MARKER_BYTES = tuple(m.encode() for m in MARKUP_TOKENS)
_LONGEST_MARKER = max(len(m) for m in _MARKER_BYTES)

# A header is a name and a few attributes, tens of characters. Text running past
# this without a sep follows a stray marker: it is prose, and holding it as a
# header would swallow the rest of the reply.
MAX_HEADER_CHARS = 1024

# Where the text inside an element goes.
_REASONING, _CONTENT, _DROP, _ARGUMENT, _JSON = "reasoning", "content", "drop", "argument", "json"

# The elements a reply may contain, by parent: child name -> where its text goes.
# Anything else is an unknown element: its structure is ignored, its text goes where
# its parent's text goes.
_CHILDREN = {
    "message": {"think": _REASONING, "response": _CONTENT, "tools": _DROP},
    "tools": {"call": _DROP},
    "call": {"argument": _ARGUMENT, "json": _JSON},
}

_HEADER = re.compile(r"(\S*)(.*)", re.DOTALL)
_ATTRIBUTE = re.compile(r'([^\s=]+)="([^"]*)"')
@dataclass(frozen=True)
class Markers:
    """Token ids of the four structural specials (their texts are fixed)."""
    open: int
    sep: int
    close: int
    end_of_msg: int


@dataclass
class _Element:
    name: str
    kind: str      # the name if the element is known in its place, else ""
    sink: str


@dataclass
class _Call:
    index: int
    body: str = ""        # "" until the first child decides: "argument" or "json"
    arguments: int = 0    # argument children opened so far


@dataclass
class _Argument:
    type: str
    pending: list[str] = field(default_factory=list)   # non-string values wait for their close


def _parse_header(header: str) -> tuple[str, dict[str, str]]:
    """`name key="value" ...` -> (name, attributes); text that is not an attribute is ignored."""
    name, rest = _HEADER.match(header).groups()   # type: ignore[union-attr]  # matches any text
    return name, {key: unescape_attr(value) for key, value in _ATTRIBUTE.findall(rest)}


def _json_value(text: str) -> str:
    """A buffered argument as JSON: the value if it parses (strictly), else the raw text as a string."""
    def reject(constant: str) -> None:
        raise ValueError(constant)   # NaN/Infinity are not JSON, whatever Python accepts
    try:
        return json.dumps(json.loads(text, parse_constant=reject), ensure_ascii=False)
    except (ValueError, RecursionError):   # RecursionError: nesting deeper than Python's parser goes
        return json.dumps(text, ensure_ascii=False)


class ReplyParser:
    """Incremental parser for one assistant reply. Use either `feed_token` or `feed`, not both."""

    def __init__(self, markers: Markers, *, thinking: bool, special_ids: frozenset[int] = frozenset(),
                 new_call_id: Callable[[], str] = default_call_id) -> None:
        self._marker_by_id = {markers.open: OPEN, markers.sep: SEP,
                              markers.close: CLOSE, markers.end_of_msg: END_OF_MSG}
        self._special_ids = special_ids
        self._new_call_id = new_call_id
        # The generation prompt already opened the message and its first channel.
        first = "think" if thinking else "response"
        self._stack = [_Element("message", "message", _CONTENT),
                       _Element(first, first, _CHILDREN["message"][first])]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._header: list[str] | None = None   # text of an open/close header awaiting its sep
        self._header_chars = 0
        self._header_marker = OPEN
        self._held = b""                          # text mode: a possible marker cut by the chunk end
        self._call: _Call | None = None
        self._argument: _Argument | None = None
        # What was said so far, as parts joined on demand: a long reply must not
        # cost a copy of everything before it on every token.
        self._text: dict[str, list[str]] = {"reasoning_content": [], "content": []}
        self._calls: list[dict[str, str]] = []   # id and name of each tool call
        self._arguments: list[list[str]] = []  # each call's argument fragments
        self._ended = False
        self._closed = False                      # no more input: the message ended or finish() ran
        self._cut = False                         # generation stopped inside the message
        self._out = Deltas()

    @property
    def reply(self) -> Reply:
        return Reply("".join(self._text["reasoning_content"]), "".join(self._text["content"]),
                     read_calls(self._calls, self._arguments), self._ended)

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def thinking(self) -> bool:
        return (not self._closed and self._header is None
                and any(element.kind == "think" for element in self._stack))

    def feed_token(self, token_id: int, piece: bytes) -> list[Delta]:
        marker = self._marker_by_id.get(token_id)
        if marker is not None:
            self._on_marker(marker)
        elif token_id not in self._special_ids:
            self._on_bytes(piece)
        return self._take()

    def feed(self, text: str) -> list[Delta]:
        data = self._held + text.encode()
        self._held = b""
        start = 0
        at = data.find(b"<")
        while at != -1:
            marker = next((m for m in _MARKER_BYTES if data.startswith(m, at)), None)
            if marker is not None:
                self._on_bytes(data[start:at])
                self._on_marker(marker.decode())
                start = at + len(marker)
                at = data.find(b"<", start)
            # Only a tail shorter than a marker can be one cut short; testing every
            # "<" would slice the rest of the chunk each time (quadratic on HTML).
            elif len(data) - at < _LONGEST_MARKER and any(m.startswith(data[at:]) for m in _MARKER_BYTES):
                self._held = data[at:]   # the rest may be completed by the next chunk
                data = data[:at]
                break
            else:
                at = data.find(b"<", at + 1)
        self._on_bytes(data[start:])
        return self._take()

    def finish(self) -> list[Delta]:
        """End of generation: a held partial marker is text; whatever is still open gets closed."""
        self._on_bytes(self._held)
        self._held = b""
        if not self._closed:
            self._flush_decoder()
            self._header = None   # a header without its sep never took effect
            self._cut = True
            self._close_down_to(0)
            self._closed = True
        return self._take()

    # -- events -------------------------------------------------------------------------

    def _on_bytes(self, data: bytes) -> None:
        if data and not self._closed:
            self._route(self._decoder.decode(data))

    def _on_marker(self, marker: str) -> None:
        if self._closed:
            return
        # A character cut by structure can never complete: flush it where it was going.
        self._flush_decoder()
        if marker == END_OF_MSG:
            self._header = None
            self._close_down_to(0)
            self._end_message()
        elif marker in (OPEN, CLOSE):
            self._header = []   # a previous header still waiting for its sep is dropped
            self._header_chars = 0
            self._header_marker = marker
        elif self._header is not None:   # SEP completes the header
            header, self._header = "".join(self._header), None
            if self._header_marker == OPEN:
                self._open(*_parse_header(header))
            else:
                self._close(_parse_header(header)[0])
        # A sep outside any header closes nothing: dropped.

    def _flush_decoder(self) -> None:
        self._route(self._decoder.decode(b"", final=True))
        self._decoder.reset()

    def _route(self, text: str) -> None:
        if not text:
            return
        if self._header is not None:
            self._header.append(text)
            self._header_chars += len(text)
            if self._header_chars <= MAX_HEADER_CHARS:
                return
            text, self._header = "".join(self._header), None
        sink = self._stack[-1].sink
        if sink == _REASONING:
            self._emit_text("reasoning_content", text)
        elif sink == _CONTENT:
            self._emit_text("content", text)
        elif sink == _JSON:
            self._emit_arguments(text)
        elif sink == _ARGUMENT:
            if self._current_argument.type == "string":
                self._emit_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._current_argument.pending.append(text)

    # -- structure ----------------------------------------------------------------------

    def _open(self, name: str, attributes: dict[str, str]) -> None:
        parent = self._stack[-1]
        known = _CHILDREN.get(parent.kind, {})
        if name not in known or (parent.kind == "call" and not self._claim_call_body(name)):
            self._stack.append(_Element(name, "", parent.sink))
            return
        self._stack.append(_Element(name, name, known[name]))
        if name == "call":
            self._start_call(attributes.get("tool", ""))
        elif name == "argument":
            self._start_argument(attributes.get("key", ""), attributes.get("type", ""))

    def _claim_call_body(self, child: str) -> bool:
        """A call holds either argument elements or one json element; the first child decides."""
        if not self._current_call.body:
            self._current_call.body = child
            return True
        return self._current_call.body == child == "argument"

    def _start_call(self, name: str) -> None:
        self._call = _Call(index=len(self._calls))
        call_id = self._new_call_id()
        self._calls.append({"id": call_id, "name": name})
        self._arguments.append([])
        self._out.call(self._current_call.index, call_id, name)

    def _start_argument(self, key: str, value_type: str) -> None:
        self._argument = _Argument(value_type)
        opening = "{" if self._current_call.arguments == 0 else ", "
        self._current_call.arguments += 1
        quote = '"' if value_type == "string" else ""
        self._emit_arguments(opening + json.dumps(key, ensure_ascii=False) + ": " + quote)

    def _close(self, name: str) -> None:
        depth = next((i for i in range(len(self._stack) - 1, -1, -1) if self._stack[i].name == name), None)
        if depth is None:
            return   # closes something never opened
        self._close_down_to(depth)
        if depth == 0:
            self._end_message()

    def _close_down_to(self, depth: int) -> None:
        """Close the elements at `depth` and above, innermost first, finishing calls and arguments."""
        while len(self._stack) > depth:
            kind = self._stack.pop().kind
            if kind == "argument":
                self._end_argument()
            elif kind == "call":
                self._end_call()

    def _end_argument(self) -> None:
        argument, self._argument = self._current_argument, None
        if self._cut:   # as generated: an open string stays open, a value stays unparsed
            if argument.type != "string" and argument.pending:
                self._emit_arguments("".join(argument.pending))
        elif argument.type == "string":
            self._emit_arguments('"')
        else:
            self._emit_arguments(_json_value("".join(argument.pending)))

    def _end_call(self) -> None:
        if self._cut:   # no closing brace the model did not write
            self._call = None
            return
        if self._current_call.body == "argument":
            self._emit_arguments("}")
        elif not self._current_call.body:
            self._emit_arguments("{}")
        self._call = None   # a json body was passed through as written

    def _end_message(self) -> None:
        self._ended = True
        self._closed = True

    @property
    def _current_call(self) -> _Call:
        """The call being read: asked for only inside one."""
        assert self._call is not None
        return self._call

    @property
    def _current_argument(self) -> _Argument:
        """The argument being read: asked for only inside one."""
        assert self._argument is not None
        return self._argument

    # -- output -------------------------------------------------------------------------

    def _emit_text(self, channel: str, text: str) -> None:
        self._text[channel].append(text)
        self._out.text(channel, text)

    def _emit_arguments(self, fragment: str) -> None:
        self._arguments[self._current_call.index].append(fragment)
        self._out.arguments(self._current_call.index, fragment)

    def _take(self) -> list[Delta]:
        return self._out.take()
