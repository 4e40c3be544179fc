"""K3 prompt rendering: OpenAI chat messages to XTML segments.

A port of the K3 release's `encoding_k3.py`, checked against its outputs in
`tests/fixtures/xtml_vectors.json`. The result is a list of segments rather
than a string because structure and content go to different tokenizer entry
points: markup segments may contain special tokens, text segments never
produce them, so nothing a user or tool wrote can open or close an element.
Each segment is tokenized on its own; merging neighbours changes the BPE
output, so the writer below never merges.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Optional, Sequence

from serve.core.client_json import Json, JsonObject
from serve.core.segment import Segment
from serve.formats.base import PromptError
from serve.formats.xtml.checks import check_message, type_name
from serve.formats.tool_results import resolve_tool_results

OPEN = "<|open|>"
SEP = "<|sep|>"
CLOSE = "<|close|>"
END_OF_MSG = "<|end_of_msg|>"
MARKUP_TOKENS = (OPEN, SEP, CLOSE, END_OF_MSG)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_PAD = "<|media_pad|>"  # the placeholder waste_image_expand widens to an image's positions

THINKING_EFFORTS = ("low", "high", "max")

# Model-facing texts. They are part of the prompt the model was trained on
# and must stay byte-identical to the release encoder's.
_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_NEW_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel "
    "(not including the response channel), supported values include `low`, "
    "`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\n"
                "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
            "You MUST NOT call any tools in the next message.",
}
# K3 has no named tool choice: it gets `required` and this note (one line, after the conversation).
_NAMED_TOOL_TEXT = "You MUST call the tool `{}` and no other tool in the next message."
_RAW_JSON_RULE = ("Your response must be raw JSON data without markdown code blocks "
                  "(```json) or any additional formatting.")
_SCHEMA_INTRO = "The JSON data must match the following schema:\n"


def escape_attr(value: str) -> str:
    """Escape an attribute value; `&` goes first so later entities are not re-escaped."""
    return (value.replace("&", "&amp;").replace('"', "&quot;")
            .replace("<", "&lt;").replace(">", "&gt;"))


def unescape_attr(value: str) -> str:
    """Inverse of escape_attr; `&amp;` goes last so `&amp;lt;` stays `&lt;`."""
    return (value.replace("&gt;", ">").replace("&lt;", "<")
            .replace("&quot;", '"').replace("&amp;", "&"))


def image_prompt(width: int, height: int) -> str:
    """The media block for one image of the original size width x height."""
    return f"<|media_begin|>image {width}x{height}<|media_content|>{MEDIA_PAD}<|media_end|>"


def render_text(segments: Iterable[Segment]) -> str:
    """The prompt as one string, for logs and tests. Never tokenize this."""
    return "".join(segment.text for segment in segments)


def _dumps(value: Json, what: str, **options: Any) -> str:
    """json.dumps that reports a value JSON cannot hold as a ValueError naming it."""
    try:
        return json.dumps(value, ensure_ascii=False, **options)
    except TypeError as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None


def _compact_json(value: Json, what: str) -> str:
    return _dumps(value, what, separators=(",", ":"), sort_keys=True)


class _Writer:
    """Accumulates segments; one call, one segment, empty text dropped."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        # messages written -> segments written by then, wherever one message's markup
        # ends and the next one's begins (a run of tool results is one block)
        self.ends: dict[int, int] = {}

    def markup(self, token: str) -> None:
        self.segments.append(Segment(token, True))

    def text(self, text: str) -> None:
        if text:
            self.segments.append(Segment(text, False))

    def open(self, name: str, attrs: Sequence[tuple[str, str]] = ()) -> None:
        self.markup(OPEN)
        self.text(name)
        for key, value in attrs:
            self.text(" " + key)
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.markup(SEP)

    def close(self, name: str) -> None:
        self.markup(CLOSE)
        self.text(name)
        self.markup(SEP)

    def element(self, name: str, attrs: Sequence[tuple[str, str]], body: str) -> None:
        self.open(name, attrs)
        self.text(body)
        self.close(name)

    def end_message(self) -> None:
        self.close("message")
        self.markup(END_OF_MSG)


class _ImagePrompts:
    """The caller's image prompts, handed out in order of appearance."""

    def __init__(self, prompts: Optional[Sequence[str]]) -> None:
        self._pending = list(prompts or ())
        if not all(isinstance(prompt, str) for prompt in self._pending):
            raise ValueError("image_prompts must be strings")
        self._next = 0

    def remaining(self) -> bool:
        return self._next < len(self._pending)

    def take(self) -> str:
        if not self.remaining():
            raise ValueError("image content part has no image prompt left to render it")
        prompt = self._pending[self._next]
        self._next += 1
        return prompt


def _write_text_with_placeholders(out: _Writer, text: str, images: _ImagePrompts) -> None:
    # A placeholder only becomes an image while prompts remain; later ones
    # stay literal text, like any other string the user typed.
    while images.remaining():
        before, found, after = text.partition(IMAGE_PLACEHOLDER)
        if not found:
            break
        out.text(before)
        out.markup(images.take())
        text = after
    out.text(text)


def _write_content(out: _Writer, content: Json, images: _ImagePrompts) -> None:
    """Message content, as _check_content admits: None, a string, or text and image parts."""
    if content is None:
        return
    if isinstance(content, str):
        _write_text_with_placeholders(out, content, images)
        return
    for part in content:
        if part["type"] == "text":
            _write_text_with_placeholders(out, part.get("text") or "", images)
        else:
            out.markup(images.take())


def _write_system(out: _Writer, kind: Optional[str], text: str) -> None:
    """A system message the server writes; `kind` is the release's type attribute, if any."""
    out.open("message", [("role", "system")] + ([("type", kind)] if kind else []))
    out.text(text)
    out.end_message()


def _declare_tools(out: _Writer, header: str, tools: Json) -> None:
    _write_system(out, "tool-declare", header + "```json\n" + _compact_json(tools, "tools") + "\n```")


def _json_type(value: Json) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    raise ValueError(f"tool argument of non-JSON type {type(value).__name__}")


def _argument_body(value: Json, kind: str) -> str:
    return value if kind == "string" else _dumps(value, "tool argument")


def _parse_arguments(raw: Json, where: str) -> JsonObject | str:
    """The call's arguments as a mapping (empty when there are none), or their
    text when it is not JSON at all; JSON that is not an object is refused."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return raw
    if not isinstance(raw, str):
        raise PromptError(where, f"must be a JSON object or its text, not {type_name(raw)}")
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    except RecursionError:   # valid or not, Python's parser cannot tell past its depth
        raise ValueError("tool call arguments are nested too deeply") from None
    if not isinstance(parsed, dict):
        raise PromptError(where, f"must encode a JSON object, not {_json_type(parsed)}")
    return parsed


def _write_tool_call(out: _Writer, call: JsonObject, index: int, where: str) -> None:
    function = call.get("function") or {}
    out.open("call", [("tool", function.get("name") or ""), ("index", str(index))])
    arguments = _parse_arguments(function.get("arguments"), f"{where}.function.arguments")
    if isinstance(arguments, str):
        # Arguments that do not parse go in verbatim, so the model sees
        # exactly what it wrote.
        out.element("json", [("type", "object")], arguments)
    else:
        for key, value in arguments.items():
            kind = _json_type(value)
            out.element("argument", [("key", str(key)), ("type", kind)], _argument_body(value, kind))
    out.close("call")


def _message_attrs(role: str, message: JsonObject) -> list[tuple[str, str]]:
    """role, then the participant's name when the message has one."""
    attrs = [("role", role)]
    if message.get("name"):
        attrs.append(("name", message["name"]))
    return attrs


def _reasoning(message: JsonObject) -> str:
    """`reasoning_content`, or its alias `reasoning`; whitespace alone counts as none."""
    text = message.get("reasoning_content") or message.get("reasoning") or ""
    return text if text.strip() else ""


def _write_assistant(out: _Writer, message: JsonObject, images: _ImagePrompts,
                     thinking: bool, where: str) -> None:
    out.open("message", _message_attrs("assistant", message))
    # With thinking on, every turn in history has a think channel, empty or
    # not; with it off, none has, so the history looks like the turn to come.
    if thinking:
        out.open("think")
        out.text(_reasoning(message))
        out.close("think")
    out.open("response")
    _write_content(out, message.get("content"), images)
    out.close("response")
    calls = message.get("tool_calls") or []
    if calls:
        out.open("tools")
        for position, call in enumerate(calls, start=1):
            _write_tool_call(out, call, position, f"{where}.tool_calls[{position - 1}]")
        out.close("tools")
    out.end_message()


def _write_plain(out: _Writer, role: str, message: JsonObject,
                 images: _ImagePrompts) -> None:
    out.open("message", _message_attrs(role, message))
    _write_content(out, message.get("content"), images)
    out.end_message()


def _write_system_message(out: _Writer, message: JsonObject,
                          images: _ImagePrompts) -> None:
    # A system message carrying tools introduces them mid-conversation; any
    # text it also carries follows as an ordinary system message.
    if message.get("tools"):
        _declare_tools(out, _NEW_TOOLS_HEADER, message["tools"])
        if message.get("content"):
            _write_plain(out, "system", message, images)
    else:
        _write_plain(out, "system", message, images)


def _write_tool_results(out: _Writer, resolved: Sequence[tuple[JsonObject, str]],
                        answered: int, images: _ImagePrompts) -> None:
    for index, (message, name) in enumerate(resolved, start=answered + 1):
        out.open("message", [("role", "tool"), ("tool", name), ("index", str(index))])
        _write_content(out, message.get("content"), images)
        out.end_message()


def _write_messages(out: _Writer, messages: Sequence[JsonObject],
                    images: _ImagePrompts, thinking: bool) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list, not {type_name(messages)}")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")
    # Tool results answer the latest assistant turn's calls, and are numbered
    # from it, even past a user or system message in between.
    calls: Sequence[JsonObject] = ()
    answered = 0
    i = 0
    out.ends[0] = len(out.segments)
    while i < len(messages):
        message = messages[i]
        role = message["role"]
        if role == "tool":
            end = i
            while end < len(messages) and messages[end].get("role") == "tool":
                end += 1
            resolved = [(messages[i + k], name)
                        for k, name in resolve_tool_results(messages[i:end], calls, answered, i)]
            _write_tool_results(out, resolved, answered, images)
            answered += end - i
            i = end
            out.ends[i] = len(out.segments)
            continue
        if role == "assistant":
            calls, answered = message.get("tool_calls") or (), 0
            _write_assistant(out, message, images, thinking, f"messages[{i}]")
        elif role == "system":
            _write_system_message(out, message, images)
        else:
            _write_plain(out, role, message, images)
        i += 1
        out.ends[i] = len(out.segments)


def _thinking_effort_text(effort: Optional[str]) -> Optional[str]:
    if effort is None:
        return None
    if effort not in THINKING_EFFORTS:
        # The release refuses `medium` too, although its own text lists it.
        raise ValueError(f"unsupported thinking_effort: {effort!r} (use one of {THINKING_EFFORTS})")
    return _EFFORT_TEXT.format(effort)


def _named_tool(tool_choice: JsonObject) -> str:
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise ValueError(f"unsupported tool_choice: {tool_choice!r} (name a function as "
                         "type function, function.name)")
    return name


def _tool_choice_texts(tool_choice: Json) -> list[tuple[Optional[str], str]]:
    """The system notes for tool_choice, as (message type, text) after the conversation."""
    if tool_choice is None or tool_choice == "auto":
        return []
    if isinstance(tool_choice, Mapping):
        # The release knows no named choice: `required`, and which tool, in a
        # plain system note (decoding that enforces it is another matter).
        name = _named_tool(tool_choice)
        return [("tool-choice", _TOOL_CHOICE_TEXT["required"]), (None, _NAMED_TOOL_TEXT.format(name))]
    if not isinstance(tool_choice, str) or tool_choice not in _TOOL_CHOICE_TEXT:
        raise ValueError(f"unsupported tool_choice: {tool_choice!r}")
    return [("tool-choice", _TOOL_CHOICE_TEXT[tool_choice])]


def _schema_of(response_format: JsonObject) -> Json:
    """The schema of a json_schema response_format: OpenAI's `json_schema.schema`,
    else `json_schema.json_schema`, else `json_schema` is the schema itself."""
    json_schema = response_format.get("json_schema")
    if json_schema is None:
        return None
    if not isinstance(json_schema, Mapping):
        raise ValueError(f"response_format.json_schema must be an object, not {type_name(json_schema)}")
    for key in ("schema", "json_schema"):
        if key in json_schema:
            return json_schema[key]
    return json_schema


def _response_format_text(response_format: Optional[JsonObject],
                          response_schema: Json = None) -> Optional[str]:
    kind = "text"
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise ValueError(f"response_format must be an object, not {type_name(response_format)}")
        kind = response_format.get("type", "text")
    if response_schema is not None:
        # The release's own keyword: the schema alone, as json_schema.
        if kind != "text":
            raise ValueError("give response_format or response_schema, not both")
        kind, schema = "json_schema", response_schema
    elif kind == "json_schema" and response_format is not None:
        schema = _schema_of(response_format)
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ValueError(f"unsupported response_format type: {kind!r}")
    text = f"The system is invoked with `response_format={kind}`.\n{_RAW_JSON_RULE}"
    if kind == "json_schema":
        text += f"\n{_SCHEMA_INTRO}```json\n{_compact_json(schema, 'response_format schema')}\n```"
    return text


def build_chat(messages: Sequence[JsonObject],
               tools: Optional[Sequence[JsonObject]] = None, *,
               add_generation_prompt: bool = True, thinking: bool = True,
               image_prompts: Optional[Sequence[str]] = None,
               thinking_effort: Optional[str] = None, tool_choice: Json = None,
               response_format: Optional[JsonObject] = None,
               response_schema: Json = None) -> tuple[list[Segment], dict[int, int]]:
    """Render a chat request as K3 XTML segments, in the release encoder's order:
    tool declaration, thinking effort, the conversation, tool choice, response
    format, then the open assistant turn. thinking_effort means nothing with
    thinking off, so it is then neither rendered nor checked.

    Also returns where the messages end: {messages written: segments by then},
    0 being where the first message begins (after the tools and the effort)."""
    effort_text = _thinking_effort_text(thinking_effort) if thinking else None
    choice_texts = _tool_choice_texts(tool_choice)
    format_text = _response_format_text(response_format, response_schema)
    out = _Writer()
    if tools:
        _declare_tools(out, _TOOLS_HEADER, tools)
    if effort_text is not None:
        _write_system(out, "thinking-effort", effort_text)
    _write_messages(out, messages, _ImagePrompts(image_prompts), thinking)
    for kind, text in choice_texts:
        _write_system(out, kind, text)
    if format_text is not None:
        _write_system(out, "response-format", format_text)
    if add_generation_prompt:
        out.segments += generation_prompt(thinking)
    return out.segments, out.ends


def build_chat_segments(messages: Sequence[JsonObject],
                        tools: Optional[Sequence[JsonObject]] = None,
                        **options: Any) -> list[Segment]:
    """`build_chat`'s segments alone."""
    return build_chat(messages, tools, **options)[0]


def generation_prompt(thinking: bool = True) -> list[Segment]:
    """The open assistant turn that hands the model the floor."""
    out = _Writer()
    out.open("message", [("role", "assistant")])
    out.open("think" if thinking else "response")
    return out.segments


def reasoning_end() -> list[Segment]:
    """What follows a reply's reasoning: the think channel closed, the response opened
    (as _write_assistant writes every turn in history)."""
    out = _Writer()
    out.close("think")
    out.open("response")
    return out.segments
