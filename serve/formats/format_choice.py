"""Which chat format a container speaks: K3's XTML, its own chat.json, or neither.

XTML is preferred because it is the only complete format (tools, reasoning,
images). A container without the XTML markers falls back to the four
prefix/suffix strings of its `chat.json`: a conversation, and tools in serve's
own call format when structured output is on. Resolution never raises: a container with
neither format still serves its other endpoints.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from serve.core.client_json import JsonObject
from serve.core.request import ChatRequest
from serve.formats.base import ChatFormat, ChatFormatError, FormatRefused, Rendering, ReplyParser
from serve.engine.api import EngineApi
from serve.formats.grammar import Lark
from serve.core.segment import Segment
from serve.formats.template.format import TemplateFormat
from serve.formats.xtml.format import XtmlFormat


@dataclass
class NoChatFormat:
    """A container with no usable chat format: every chat request is refused with the reasons."""
    reasons: list[str]   # why XTML did not apply, and why chat.json did not
    name = ""
    supports_images = supports_tools = supports_reasoning = prompts_response_format = False
    prompts_tools = False
    image_placeholder = ""
    stop_tokens: tuple[int, ...] = ()
    media_pad = None

    @property
    def description(self) -> str:
        return "none — " + self.refusal

    @property
    def refusal(self) -> str:
        return "; ".join(self.reasons)

    def render(self, messages: Sequence[JsonObject], **options: Any) -> Rendering:
        raise ChatFormatError(self.refusal)

    def generation_prompt(self, thinking: bool) -> list[Segment]:
        raise ChatFormatError(self.refusal)

    def reasoning_end(self) -> list[Segment]:
        raise ChatFormatError(self.refusal)

    def image_prompt(self, width: int, height: int) -> str:
        raise ChatFormatError(self.refusal)

    def new_parser(self, thinking: bool) -> ReplyParser:
        raise ChatFormatError(self.refusal)

    def grammar(self, req: ChatRequest, thinking: bool) -> Lark:
        raise ChatFormatError(self.refusal)


def resolve_chat_format(engine: EngineApi, model_dir: str | os.PathLike) -> ChatFormat:
    """XTML if the vocabulary has its markers, else model_dir/chat.json, else neither.

    Never raises: anything unexpected becomes a reason, because a broken chat
    format must not take down the endpoints that do not need one.
    """
    reasons = []
    for attempt in (lambda: XtmlFormat.load(engine),
                    lambda: TemplateFormat.load(engine, Path(model_dir) / "chat.json")):
        try:
            chosen = attempt()
        except FormatRefused as exc:
            reasons.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - see the docstring
            reasons.append(f"{type(exc).__name__}: {exc}")
        else:
            if reasons:  # a fallback says why the richer format was not used
                chosen.description += f" ({'; '.join(reasons)})"
            return chosen
    return NoChatFormat(reasons)
