"""A container's own chat.json: four prefix/suffix strings that carry a plain conversation.

Every request field they cannot express is refused by name rather than dropped.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from . import grammar
from .api import ChatRequest
from .chat_format import ChatFormatError, FormatRefused, Rendering, system_role
from .engine_api import EngineApi
from .xtml import Segment
from .xtml_reply import Delta, Reply

TEMPLATE_ROLES = ("system", "user", "assistant")
TEMPLATE_KEYS = (*TEMPLATE_ROLES, "open", "default_system")
TEMPLATE_LIMITS = "plain conversation only, no tools, no reasoning channel, no images"

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


class PlainReplyParser:
    """The reply under a chat.json template: all text is content, the stop token ends it.

    Same surface as xtml_reply.ReplyParser. Other specials are dropped, and bytes
    are decoded incrementally because a token can end mid-character.
    """

    def __init__(self, stop_ids: frozenset[int], special_ids: frozenset[int]) -> None:
        self._stop_ids = stop_ids
        self._special_ids = special_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._content: list[str] = []  # joined on demand: no copy of the whole reply per token
        self._ended = False
        self._closed = False

    @property
    def reply(self) -> Reply:
        return Reply(content="".join(self._content), ended=self._ended)

    @property
    def ended(self) -> bool:
        return self._ended

    def feed_token(self, token_id: int, piece: bytes) -> list[Delta]:
        if self._closed:
            return []
        if token_id in self._stop_ids:
            self._ended = True
            return self._close()
        if token_id in self._special_ids:
            return []
        return self._emit(self._decoder.decode(piece))

    def finish(self) -> list[Delta]:
        return [] if self._closed else self._close()

    def _close(self) -> list[Delta]:
        self._closed = True
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._content.append(text)
        return [Delta(content=text)]


class TemplateFormat:
    name = "chat.json"
    refusal = None
    media_pad = None
    supports_images = False
    supports_tools = False
    supports_reasoning = False
    prompts_response_format = False  # only a grammar (serve/grammar.py) can hold the reply to it

    def __init__(self, path: Path, template: ChatTemplate, stop_tokens: list[int],
                 special_ids: frozenset[int]) -> None:
        self.path = path
        self.template = template
        self.stop_tokens = stop_tokens
        self.description = f"chat.json from {path} — {TEMPLATE_LIMITS}"
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
        return cls(path, template, stops, frozenset(engine.specials.values()) | set(ids.values()))

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Any = None,
               tool_choice: Any = None, response_format: Any = None, thinking: bool, thinking_effort: Optional[str] = None,
               image_prompts: Optional[Sequence[str]] = None,
               add_generation_prompt: bool = True) -> Rendering:
        """Template strings as markup segments, the caller's content always as text."""
        self._refuse_request_fields(tools, tool_choice, thinking_effort)
        segments: list[Segment] = []
        default = self.template.default_system
        if default is not None and (not messages or system_role(messages[0]).get("role") != "system"):
            prefix, suffix = self.template.turns["system"]
            segments += _present([Segment(prefix, True), Segment(default, False), Segment(suffix, True)])
        ends = {0: len(segments)}
        for i, message in enumerate(messages):
            prefix, suffix = self._turn(i, message)
            segments += _present([Segment(prefix, True),
                                  Segment(self._content_text(i, message.get("content")), False),
                                  Segment(suffix, True)])
            ends[i + 1] = len(segments)
        if image_prompts:
            raise ChatFormatError("images need the XTML chat format", "messages")
        if add_generation_prompt:
            segments += _present(self.generation_prompt(thinking))
        return Rendering(segments, ends)

    def generation_prompt(self, thinking: bool) -> list[Segment]:
        return [Segment(self.template.open, True)]

    @staticmethod
    def _refuse_request_fields(tools: Any, tool_choice: Any, thinking_effort: Optional[str]) -> None:
        if tools:
            raise ChatFormatError("tools need the XTML chat format; this container has chat.json",
                                  "tools")
        if tool_choice not in (None, "none", "auto"):
            raise ChatFormatError("tool_choice needs the XTML chat format", "tool_choice")
        if thinking_effort is not None:
            raise ChatFormatError("this chat format has no reasoning channel", "reasoning_effort")

    def _turn(self, i: int, message: Mapping[str, Any]) -> tuple[str, str]:
        role = system_role(message).get("role")
        if role == "assistant" and message.get("tool_calls"):
            raise ChatFormatError("tool calls need the XTML chat format",
                                  f"messages[{i}].tool_calls")
        if role == "tool":
            raise ChatFormatError("tool results need the XTML chat format", f"messages[{i}]")
        if role not in self.template.turns:
            raise ChatFormatError(f"this chat.json has no {role!r} turn", f"messages[{i}]")
        return self.template.turns[role]

    @staticmethod
    def _content_text(i: int, content: Any) -> str:
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

    def new_parser(self, thinking: bool) -> PlainReplyParser:
        return PlainReplyParser(frozenset(self.stop_tokens), self._special_ids)

    def grammar(self, req: ChatRequest, thinking: bool) -> grammar.Lark:
        return grammar.json_grammar(req)   # the JSON document alone: this format has no tools


def _present(segments: list[Segment]) -> list[Segment]:
    """Without the empty ones (a template string or a message may be empty)."""
    return [segment for segment in segments if segment.text]
