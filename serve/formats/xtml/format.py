"""K3's own chat format, XTML: tools, reasoning and images, read back by serve/formats/xtml/reply.py."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from serve.core.client_json import Json, JsonObject
from serve.formats.grammar import Lark
from serve.formats.xtml.grammar import Markup, xtml_grammar
from serve.formats.xtml import render as xtml
from serve.core.request import ChatRequest
from serve.formats.base import FormatRefused, Rendering, system_role
from serve.engine.api import EngineApi
from serve.core.segment import Segment
from serve.formats.xtml.reply import Markers, ReplyParser

XTML_MARKERS = ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")


class XtmlFormat:
    name = "xtml"
    description = "xtml (K3 markup: tools, reasoning, images)"
    refusal = None
    supports_images = True
    image_placeholder = xtml.IMAGE_PLACEHOLDER
    supports_tools = True
    supports_reasoning = True
    prompts_response_format = True   # the prompt tells the model the format asked for
    prompts_tools = True             # K3 was taught its calls: the prompt's notes fall back

    def __init__(self, markers: Markers, special_ids: frozenset[int], media_pad: Optional[int]) -> None:
        self.markers = markers
        self.stop_tokens = [markers.end_of_msg]
        self.media_pad = media_pad  # where an image's positions go; None without one
        self._special_ids = special_ids

    @classmethod
    def load(cls, engine: EngineApi) -> "XtmlFormat":
        ids = {text: engine.token_id(text) for text in XTML_MARKERS}
        absent = [text for text, token in ids.items() if token is None]
        if absent:
            raise FormatRefused(f"no XTML markers: {', '.join(absent)} "
                                f"{'is not a single token' if len(absent) == 1 else 'are not single tokens'}")
        markers = Markers(*(token for token in ids.values() if token is not None))   # all, in order
        return cls(markers, frozenset(engine.specials.values()), engine.token_id(xtml.MEDIA_PAD))

    def render(self, messages: Sequence[JsonObject], *, tools: Json = None,
               tool_choice: Json = None, response_format: Json = None, thinking: bool,
               thinking_effort: Optional[str] = None,
               image_prompts: Optional[Sequence[str]] = None,
               add_generation_prompt: bool = True) -> Rendering:
        segments, ends = xtml.build_chat(
            [system_role(m) for m in messages], tools,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking, image_prompts=image_prompts, thinking_effort=thinking_effort,
            tool_choice=tool_choice, response_format=response_format)
        return Rendering(segments, ends)

    def generation_prompt(self, thinking: bool) -> list[Segment]:
        return xtml.generation_prompt(thinking)

    def reasoning_end(self) -> list[Segment]:
        return xtml.reasoning_end()

    def image_prompt(self, width: int, height: int) -> str:
        return xtml.image_prompt(width, height)

    def new_parser(self, thinking: bool) -> ReplyParser:
        return ReplyParser(self.markers, thinking=thinking, special_ids=self._special_ids)

    def grammar(self, req: ChatRequest, thinking: bool) -> Lark:
        markers = self.markers
        return xtml_grammar(req, Markup(markers.open, markers.sep, markers.close), thinking)
