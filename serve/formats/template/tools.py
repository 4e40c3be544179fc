"""Tool calls on a chat.json container: serve's generic call format, for a model never taught one.

A chat.json has no place for tools, so serve brings its own form, held to by
constrained decoding (serve/formats/template/grammar.py's `template_grammar`):

- **Declarations**: a system turn of its own before the conversation, in the
  template's system strings: what a call looks like (with an example written in
  the real markup), then each tool as one line of JSON (name, description,
  parameters).
- **A call**: the template's `open` string, as markup (the special tokens that
  hand the assistant the floor), then `{"name": NAME, "arguments": ARGUMENTS}`
  as text. Several calls follow one another, each after its own `open`; any
  answer text comes before the first. The reply then ends as any reply does.
- **A result**: a user turn (the turn every template has) that starts
  `Result of the call to NAME:` and holds the tool's output as text.

Why nothing a user types can forge a call: a call begins with a special token
of the template, which only markup segments produce. Everything a user, a
document or a tool wrote is tokenized as text, which never yields one; in the
reply, the grammar admits no special token in answer text, and the parser
takes a call's start only from the token id, never from text spelled like it.

`JsonCalls` is the one implementation of the `TemplateTools` protocol; a
container whose tokenizer has its own tool markup can plug in another.
"""
from __future__ import annotations

import codecs
import json
import re
from typing import Mapping, Protocol, Sequence

from serve.core.client_json import Json, JsonObject
from serve.formats.base import FormatRefused, PromptError
from serve.core.segment import Segment
from serve.core.reply import default_call_id, Delta, Deltas, Reply, read_calls

CALL_HEAD = '{"name": '            # a call's text up to the tool's name
ARGUMENTS_KEY = ', "arguments": '  # between the name and the arguments
RESULT_HEADER = "Result of the call to {}:\n"
DECLARATION = (
    "# Tools\n"
    "You can call the tools listed below. To call one, write the marker shown here, then a "
    "JSON object with the tool's name and its arguments, as in this example:\n\n")
EXAMPLE_CALL = '{"name": "tool_name", "arguments": {"parameter": "value"}}'
DECLARATION_END = (
    "\n\nSeveral calls follow one another, each after its own marker. A call ends your turn; "
    "its result comes back in a message that starts \"Result of the call to\". Answer in "
    "plain text when no tool is needed.\n\nThe tools, in JSON Schema:\n")
_CONTROL_TOKEN = re.compile(r"<\|.*?\|>", re.DOTALL)
_NAME = re.compile(r'"(?:[^"\\]|\\.)*"')


class TemplateTools(Protocol):
    """How a chat.json container declares tools, writes calls and results, and reads calls."""

    @property
    def marker(self) -> Sequence[int | str]:
        """What opens a call: special token ids and text, in order."""

    def declaration(self, tools: Sequence[JsonObject]) -> list[Segment]:
        """The system turn's content that declares `tools`."""

    def calls(self, calls: Sequence[JsonObject], where: str) -> list[Segment]:
        """An assistant message's calls, as its history renders them after its content."""

    def result(self, name: str) -> str:
        """The text that introduces a result of tool `name` in its turn."""


def marker_parts(text: str, token_ids: Mapping[str, int]) -> list[int | str]:
    """`text` as its control tokens' ids and the text between them, in order."""
    parts: list[int | str] = []
    at = 0
    for match in _CONTROL_TOKEN.finditer(text):
        if match.start() > at:
            parts.append(text[at:match.start()])
        parts.append(token_ids[match.group()])
        at = match.end()
    if at < len(text):
        parts.append(text[at:])
    return parts


class JsonCalls:
    """serve's generic call format (the module's docstring)."""

    def __init__(self, open_text: str, marker: Sequence[int | str]) -> None:
        self.open_text = open_text
        self.marker = tuple(marker)

    @classmethod
    def for_template(cls, open_text: str, token_ids: Mapping[str, int],
                     stop_ids: Sequence[int]) -> "JsonCalls":
        """The format over a template whose `open` starts with a special token that does not
        end a reply (so a call can begin mid-reply, and only by that token); FormatRefused
        says why not."""
        marker = marker_parts(open_text, token_ids)
        if not marker or not isinstance(marker[0], int):
            raise FormatRefused('no tools: chat.json\'s "open" does not start with a control '
                                "token (<|...|>) to begin a call with")
        if marker[0] in stop_ids:
            raise FormatRefused('no tools: chat.json\'s "open" starts with the token that ends '
                                "a reply")
        return cls(open_text, marker)

    def declaration(self, tools: Sequence[JsonObject]) -> list[Segment]:
        lines = "\n".join(json.dumps(_declared(tool), ensure_ascii=False, separators=(",", ":"))
                          for tool in tools)
        return [Segment(DECLARATION, False), Segment(self.open_text, True),
                Segment(EXAMPLE_CALL, False), Segment(DECLARATION_END + lines, False)]

    def calls(self, calls: Sequence[JsonObject], where: str) -> list[Segment]:
        segments = []
        for j, call in enumerate(calls):
            function = call.get("function") or {}
            arguments = _arguments_text(function.get("arguments"),
                                        f"{where}[{j}].function.arguments")
            segments += [Segment(self.open_text, True),
                         Segment(call_text(function.get("name") or "", arguments), False)]
        return segments

    def result(self, name: str) -> str:
        return RESULT_HEADER.format(name)


def call_text(name: str, arguments: str) -> str:
    """A call as the grammar forces it and history writes it."""
    return f"{CALL_HEAD}{json.dumps(name, ensure_ascii=False)}{ARGUMENTS_KEY}{arguments}}}"


def _declared(tool: JsonObject) -> dict:
    function = tool.get("function") or {}
    return {key: function[key] for key in ("name", "description", "parameters") if key in function}


def _arguments_text(raw: Json, where: str) -> str:
    """Arguments as history writes them: the text the model wrote (or a client kept) as it
    is, an object as JSON, nothing as {}; JSON that is not an object is refused."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return "{}"
    if isinstance(raw, Mapping):
        return json.dumps(raw, ensure_ascii=False)
    if not isinstance(raw, str):
        raise PromptError(where, f"must be a JSON object or its text, not {type(raw).__name__}")
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return raw   # not JSON: the model sees exactly what it wrote
    if not isinstance(parsed, dict):
        raise PromptError(where, "must encode a JSON object")
    return raw


class TemplateReplyParser:
    """A reply under a chat.json template: text is content, the stop token ends it, and with
    tools each `marker` opens a call whose arguments stream as they are generated.

    Structure comes only from token ids: text spelled like a call stays text. A call cut
    off keeps its arguments as generated (truncated JSON, never closed here). Nothing raises:
    a marker that goes wrong (only possible without a grammar) drops the call.
    """
    thinking = False   # a template has no think channel

    def __init__(self, stop_ids: frozenset[int], special_ids: frozenset[int],
                 marker: Sequence[int | str] = (), new_call_id=default_call_id) -> None:
        self._stop_ids = stop_ids
        self._special_ids = special_ids
        self._marker = tuple(marker)
        self._new_call_id = new_call_id
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._content: list[str] = []   # joined on demand: no copy of the whole reply per token
        self._calls: list[dict[str, str]] = []   # id and name of each call
        self._arguments: list[list[str]] = []
        self._state = "content"         # content | marker | head | arguments | after | drop
        self._expect = 0                # marker: the part awaited next
        self._opened = 0                # calls there were when this marker began
        self._text = ""                 # marker and head: text seen but not yet placed
        self._depth = 0                 # arguments: JSON nesting, strings and escapes
        self._in_string = self._escaped = False
        self._ended = False
        self._closed = False
        self._out = Deltas()

    @property
    def reply(self) -> Reply:
        return Reply(content="".join(self._content),
                     tool_calls=read_calls(self._calls, self._arguments), ended=self._ended)

    @property
    def ended(self) -> bool:
        return self._ended

    def feed_token(self, token_id: int, piece: bytes) -> list[Delta]:
        if self._closed:
            return []
        if token_id in self._stop_ids:
            self._ended = True
            self._close()
        elif self._marker and token_id == self._marker[0] and self._state != "marker":
            self._flush()
            self._state, self._expect, self._text = "marker", 1, ""
            self._opened = len(self._calls)
            self._advance_marker()
        elif token_id in self._special_ids:
            self._flush()
            if self._state == "marker" and self._marker[self._expect] == token_id and not self._text:
                self._expect += 1
                self._advance_marker()
            elif self._state != "content":
                self._state = "drop"
        else:
            self._route(self._decoder.decode(piece))
        return self._take()

    def finish(self) -> list[Delta]:
        if not self._closed:
            self._close()
        return self._take()

    def _close(self) -> None:
        self._flush()
        self._closed = True

    def _flush(self) -> None:
        """A character cut by a special token can never complete: place what is held."""
        self._route(self._decoder.decode(b"", final=True))
        self._decoder.reset()

    def _route(self, text: str) -> None:
        if not text:
            return
        if self._state == "content":
            self._content.append(text)
            self._out.text("content", text)
        elif self._state == "marker":
            self._text += text
            self._advance_marker()
        elif self._state == "head":
            self._text += text
            self._read_head()
        elif self._state == "arguments":
            self._read_arguments(text)

    def _advance_marker(self) -> None:
        """Match held text against the marker's text parts; the call's head follows it."""
        while self._expect < len(self._marker):
            part = self._marker[self._expect]
            if isinstance(part, int):
                if self._text:
                    self._state = "drop"
                return
            if self._text.startswith(part):
                self._text = self._text[len(part):]
                self._expect += 1
            elif not part.startswith(self._text):
                self._state = "drop"
                return
            else:
                return   # more of the part is to come
        self._state = "head"
        self._read_head()

    def _read_head(self) -> None:
        """`{"name": "NAME"` opens the call (a reply cut after it shows the call, its arguments
        empty); `, "arguments": ` follows, then the arguments."""
        text = self._text
        if not CALL_HEAD.startswith(text[:len(CALL_HEAD)]):
            self._state = "drop"
            return
        name = _NAME.match(text, len(CALL_HEAD))
        if name is None:
            return
        if len(self._calls) == self._opened:   # not yet opened for this marker
            self._open_call(json.loads(name.group()))
        rest = text[name.end():]
        if not ARGUMENTS_KEY.startswith(rest[:len(ARGUMENTS_KEY)]):
            self._state = "drop"
        elif len(rest) >= len(ARGUMENTS_KEY):
            self._state, self._text = "arguments", ""
            self._depth, self._in_string, self._escaped = 0, False, False
            self._read_arguments(rest[len(ARGUMENTS_KEY):])

    def _open_call(self, name: str) -> None:
        call_id = self._new_call_id()
        self._calls.append({"id": call_id, "name": name})
        self._arguments.append([])
        self._out.call(len(self._calls) - 1, call_id, name)

    def _read_arguments(self, text: str) -> None:
        """Arguments up to the end of their JSON value; the `}` after it closes the call."""
        for at, char in enumerate(text):
            if self._in_string:
                self._in_string = self._escaped or char != '"'
                self._escaped = not self._escaped and char == "\\"
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._emit_arguments(text[:at + 1])
                    self._state = "after"   # the wrapper's `}`, then the next call or the end
                    return
        self._emit_arguments(text)

    def _emit_arguments(self, fragment: str) -> None:
        if fragment:
            self._arguments[-1].append(fragment)
            self._out.arguments(len(self._calls) - 1, fragment)

    def _take(self) -> list[Delta]:
        return self._out.take()
