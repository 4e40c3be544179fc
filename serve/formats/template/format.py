"""A container's own chat.json: four prefix/suffix strings that carry a conversation.

Tools come in serve's generic call format (serve/formats/template/tools.py), held to by
constrained decoding; every request field the strings cannot express (images) is
refused by name rather than dropped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from serve.core.client_json import Json, JsonObject
from serve.formats.grammar import Lark
from serve.formats.template.grammar import template_grammar
from serve.core.request import ChatRequest
from serve.formats.base import ChatFormatError, FormatRefused, Rendering, system_role
from serve.engine.api import EngineApi
from serve.formats.template.tools import JsonCalls, TemplateReplyParser, TemplateTools
from serve.formats.tool_results import resolve_tool_results
from serve.core.segment import Segment

TEMPLATE_ROLES = ("system", "user", "assistant")
TEMPLATE_KEYS = (*TEMPLATE_ROLES, "open", "default_system")
TEMPLATE_LIMITS = "no reasoning channel, no images"

# Anything spelled like a control token; each must be a real special of the vocabulary.
_CONTROL_TOKEN = re.compile(r"<\|.*?\|>", re.DOTALL)


@dataclass(frozen=True)
class ChatTemplate:
    """chat.json's strings: (prefix, suffix) per role, and the prefix that hands over the floor."""
    turns: dict[str, tuple[str, str]]   # "user" and "assistant" always; "system" optional
    open: str
    # The system message a conversation gets when it does not start with one
    # (what e.g. SmolLM2's own template inserts); None for no such message.
    default_system: Optional[str] = None


def _parse_template(raw: str) -> ChatTemplate:
    """Strict structural check of chat.json's text; vocabulary checks come later."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise FormatRefused(f"chat.json: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FormatRefused("chat.json: not a JSON object")
    unknown = sorted(set(data) - set(TEMPLATE_KEYS))
    if unknown:
        raise FormatRefused(f"chat.json: unknown key {unknown[0]!r} (expected {', '.join(TEMPLATE_KEYS)})")
    for required in ("open", "user", "assistant"):
        if required not in data:
            raise FormatRefused(f'chat.json: missing "{required}"')
    if not isinstance(data["open"], str):
        raise FormatRefused('chat.json: "open" must be a string')
    turns = {}
    for role in TEMPLATE_ROLES:
        if role not in data:
            continue
        pair = data[role]
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise FormatRefused(f'chat.json: "{role}" must be a [prefix, suffix] pair of strings')
        turns[role] = (pair[0], pair[1])
    default_system = data.get("default_system")
    if default_system is not None and not isinstance(default_system, str):
        raise FormatRefused('chat.json: "default_system" must be a string')
    if default_system is not None and "system" not in turns:
        raise FormatRefused('chat.json: "default_system" needs a "system" turn')
    return ChatTemplate(turns, data["open"], default_system)


def _template_strings(template: ChatTemplate) -> list[str]:
    return [s for pair in template.turns.values() for s in pair] + [template.open]


class TemplateFormat:
    name = "chat.json"
    refusal = None
    media_pad = None
    supports_images = False
    image_placeholder = ""
    supports_reasoning = False
    prompts_response_format = False  # only a grammar (serve/formats/template/grammar.py) can hold the reply to it
    prompts_tools = False            # calls in serve's own format are made by a grammar alone

    def __init__(self, path: Path, template: ChatTemplate, stop_tokens: list[int],
                 special_ids: frozenset[int], tools: Optional[TemplateTools] = None,
                 no_tools: str = "") -> None:
        self.path = path
        self.template = template
        self.stop_tokens = stop_tokens
        self.tools = tools   # None: this template cannot carry tools (`no_tools` says why)
        self.supports_tools = tools is not None
        limits = f"tools in serve's call format, {TEMPLATE_LIMITS}" if tools else \
            f"{no_tools}, {TEMPLATE_LIMITS}"
        self.description = f"chat.json from {path} — {limits}"
        self._special_ids = special_ids

    @classmethod
    def load(cls, engine: EngineApi, path: Path) -> "TemplateFormat":
        try:
            raw = path.read_text("utf-8")
        except FileNotFoundError:
            raise FormatRefused("chat.json: missing") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise FormatRefused(f"chat.json: unreadable ({exc})") from None
        template = _parse_template(raw)
        # Markup the tokenizer lacks would be encoded as prose: the model would
        # read its own turn structure as text and answer anyway, wrongly.
        ids: dict[str, int] = {}
        for text in _template_strings(template):
            for token in _CONTROL_TOKEN.findall(text):
                token_id = engine.token_id(token)
                if token_id is None:
                    raise FormatRefused(f"chat.json: {token} is not a token of this vocabulary")
                ids[token] = token_id
        # Without a stop token every reply would run to max_tokens.
        stops = list(dict.fromkeys(ids[t] for t in _CONTROL_TOKEN.findall(template.turns["assistant"][1])))
        if not stops:
            raise FormatRefused("chat.json: the assistant suffix has no control token (<|...|>) "
                           "to end a reply")
        tools, no_tools = None, ""
        try:
            if "system" not in template.turns:
                raise FormatRefused("no tools: chat.json has no system turn to declare them in")
            tools = JsonCalls.for_template(template.open, ids, stops)
        except FormatRefused as exc:
            no_tools = str(exc)
        return cls(path, template, stops, frozenset(engine.specials.values()) | set(ids.values()),
                   tools, no_tools)

    def render(self, messages: Sequence[JsonObject], *, tools: Json = None,
               tool_choice: Json = None, response_format: Json = None, thinking: bool,
               thinking_effort: Optional[str] = None,
               image_prompts: Optional[Sequence[str]] = None,
               add_generation_prompt: bool = True) -> Rendering:
        """Template strings as markup segments, the caller's content always as text. Tools
        are declared first, in a system turn of their own, unless tool_choice is none."""
        if image_prompts:
            raise ChatFormatError("images need the XTML chat format", "messages")
        segments: list[Segment] = []
        if tools and tool_choice != "none":
            prefix, suffix = self._tools_turn("tools")["system"]
            segments += _present([Segment(prefix, True), *self._tool_format().declaration(tools),
                                  Segment(suffix, True)])
        default = self.template.default_system
        if default is not None and (not messages or system_role(messages[0]).get("role") != "system"):
            prefix, suffix = self.template.turns["system"]
            segments += _present([Segment(prefix, True), Segment(default, False), Segment(suffix, True)])
        ends = {0: len(segments)}
        results = self._result_names(messages)
        for i, message in enumerate(messages):
            segments += _present(self._message(i, system_role(message), results))
            ends[i + 1] = len(segments)
        if add_generation_prompt:
            segments += _present(self.generation_prompt(thinking))
        return Rendering(segments, ends)

    def image_prompt(self, width: int, height: int) -> str:
        raise ChatFormatError("images need the XTML chat format", "messages")

    def generation_prompt(self, thinking: bool) -> list[Segment]:
        return [Segment(self.template.open, True)]

    def _tool_format(self) -> TemplateTools:
        """The template's tools, once `_tools_turn` has let the request through."""
        assert self.tools is not None
        return self.tools

    def _tools_turn(self, field: str) -> dict[str, tuple[str, str]]:
        """The template's turns, when it can carry tools; else a 400 naming `field`."""
        if self.tools is None:
            raise ChatFormatError(f"this chat.json cannot carry tools ({self.description})", field)
        return self.template.turns

    def _message(self, i: int, message: JsonObject,
                 results: dict[int, str]) -> list[Segment]:
        role, where = message.get("role"), f"messages[{i}]"
        content = Segment(self._content_text(i, message.get("content")), False)
        if role == "tool":   # a result, in the user turn every template has
            prefix, suffix = self._tools_turn(where)["user"]
            return [Segment(prefix, True), Segment(self._tool_format().result(results[i]), False),
                    content, Segment(suffix, True)]
        if role not in self.template.turns:
            raise ChatFormatError(f"this chat.json has no {role!r} turn", where)
        prefix, suffix = self.template.turns[role]
        calls = message.get("tool_calls") if role == "assistant" else None
        if not calls:
            return [Segment(prefix, True), content, Segment(suffix, True)]
        self._tools_turn(f"{where}.tool_calls")
        return [Segment(prefix, True), content,
                *self._tool_format().calls(calls, f"{where}.tool_calls"), Segment(suffix, True)]

    @staticmethod
    def _result_names(messages: Sequence[JsonObject]) -> dict[int, str]:
        """The tool each result answers, by message index (as XTML names them)."""
        names: dict[int, str] = {}
        calls: Sequence[JsonObject] = ()
        answered, i = 0, 0
        while i < len(messages):
            message = messages[i]
            if message.get("role") == "assistant":
                calls, answered = message.get("tool_calls") or (), 0
            if message.get("role") != "tool":
                i += 1
                continue
            end = i
            while end < len(messages) and messages[end].get("role") == "tool":
                end += 1
            run = messages[i:end]
            for k, name in resolve_tool_results(run, calls, answered, i):
                names[i + k] = name
            answered += end - i
            i = end
        return names

    @staticmethod
    def _content_text(i: int, content: Json) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        if not isinstance(content, list):
            raise ChatFormatError("content must be a string or a list of parts",
                                  f"messages[{i}].content")
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ChatFormatError("only text parts fit this chat format",
                                      f"messages[{i}].content[{j}]")
            texts.append(part["text"])
        return "".join(texts)

    def reasoning_end(self) -> list[Segment]:
        return []   # no think channel

    def new_parser(self, thinking: bool) -> TemplateReplyParser:
        return TemplateReplyParser(frozenset(self.stop_tokens), self._special_ids,
                                   self.tools.marker if self.tools else ())

    def grammar(self, req: ChatRequest, thinking: bool) -> Lark:
        return template_grammar(req, self.tools.marker if self.tools else ())


def _present(segments: list[Segment]) -> list[Segment]:
    """Without the empty ones (a template string or a message may be empty)."""
    return [segment for segment in segments if segment.text]
