"""The chat format protocol: what a container's chat format does for a request.

A chat format turns a conversation into prompt segments (markup and text, each
tokenized on its own), says how the model's turn opens and ends, reads the
reply back from token ids, and writes the grammar that holds a reply to the
shape a request asks for. XTML (serve/formats/xtml/format.py) and a container's
chat.json (serve/formats/template/format.py, its tools in serve/formats/template/tools.py) implement it; a container with neither
gets `NoChatFormat` (serve/formats/format_choice.py), which refuses every chat request
with its reasons. The service asks the format, never which format it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol, Sequence

from serve.core.client_json import Json, JsonObject
from serve.core.request import ChatRequest
from serve.formats.grammar import Lark
from serve.core.segment import Segment
from serve.core.reply import Delta, Reply


class ChatFormatError(Exception):
    """A request the chat format cannot express; `field` names the request field."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class PromptError(ValueError):
    """A conversation a chat format cannot render; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


class FormatRefused(Exception):
    """Why a format does not apply to this container (one line, for the banner and the 400)."""


def system_role(message: JsonObject) -> JsonObject:
    """OpenAI's `developer` role is the system role under another name."""
    return {**message, "role": "system"} if message.get("role") == "developer" else message


@dataclass(frozen=True)
class Rendering:
    """A conversation rendered once, and where its messages begin and end in it.

    `ends` maps a number of messages to the segments written by then, at every
    point where one message's markup ends and the next one's begins; `ends[0]`
    is where the first message begins (after tool declarations and the like).
    A run of messages rendered as one block (tool results) has no point inside.
    """
    segments: list[Segment]
    ends: dict[int, int] = field(default_factory=dict)

    def message(self, i: int) -> list[Segment]:
        """Message i's own segments, or [] when it shares its markup with a neighbour."""
        if i in self.ends and i + 1 in self.ends:
            return self.segments[self.ends[i]:self.ends[i + 1]]
        return []

    def chars(self) -> int:
        return sum(len(segment.text) for segment in self.segments)


class ReplyParser(Protocol):
    """Reads one reply back as it is generated, from token ids (structure comes only from
    special ids, so text a model spells like markup stays text)."""

    @property
    def reply(self) -> Reply:
        """Everything read so far: reasoning, content, tool calls, and whether it ended."""

    @property
    def ended(self) -> bool:
        """The reply closed its message (what follows is only the stop token)."""

    @property
    def thinking(self) -> bool:
        """The think channel is open and no markup is half read: the format's
        `reasoning_end` may follow here (a reasoning budget counts these tokens)."""

    def feed_token(self, token_id: int, piece: bytes) -> list[Delta]:
        """One generated token and its bytes -> the deltas it completes."""

    def finish(self) -> list[Delta]:
        """Generation stopped: whatever is still open, closed."""


class ChatFormat(Protocol):
    name: str                        # "xtml", "chat.json"; "" when there is none
    supports_tools: bool
    supports_reasoning: bool         # a think channel the reply can open
    supports_images: bool
    prompts_response_format: bool    # the prompt tells the model which format to answer in
    prompts_tools: bool              # the prompt alone can get calls (else tools need a grammar)
    image_placeholder: str           # what a client may write where an image goes ("": nothing)

    @property
    def stop_tokens(self) -> Sequence[int]:
        """The ids that end a reply."""

    @property
    def description(self) -> str:
        """One line for the banner."""

    @property
    def refusal(self) -> Optional[str]:
        """Why no chat request can be served, or None."""

    @property
    def media_pad(self) -> Optional[int]:
        """Where an image's positions go in the prompt."""

    def render(self, messages: Sequence[JsonObject], *, tools: Json = None,
               tool_choice: Json = None, response_format: Json = None, thinking: bool,
               thinking_effort: Optional[str] = None,
               image_prompts: Optional[Sequence[str]] = None,
               add_generation_prompt: bool = True) -> Rendering:
        """The prompt as segments; ChatFormatError (or ValueError) for what it cannot express."""

    def generation_prompt(self, thinking: bool) -> list[Segment]:
        """The markup that opens the model's turn."""

    def reasoning_end(self) -> list[Segment]:
        """The markup that closes the think channel and opens the answer, as the format
        writes it when reasoning ends ([] without a think channel)."""

    def image_prompt(self, width: int, height: int) -> str:
        """The prompt text for one image of that size (asked only when `supports_images`)."""

    def new_parser(self, thinking: bool) -> ReplyParser:
        """A parser for one reply that follows this format's generation prompt."""

    def grammar(self, req: ChatRequest, thinking: bool) -> Lark:
        """A Lark grammar of the whole reply the request asks for (its response_format,
        tools and tool_choice), from after the generation prompt to the stop token."""
