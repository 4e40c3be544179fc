"""Check a chat request against the chat format, and build its prompt: the ids to prefill.

messages -> one rendering of the conversation (remembered replies recalled from
it) -> token ids, remembered replies laid over as the model produced them ->
images expanded. Everything but the images' encoding is done before the
request waits for the engine (the tokenizer is serve's own, or the engine's
reached between its calls; each image's pixels checked and its positions
figured by serve, image_check.py and image_positions.py): a prompt that
cannot be built or cannot fit is refused at once, however busy the engine.
The conversation and the generation prompt are tokenized apart (as segments
always are), so the end of the conversation, which the next turn's prompt
repeats, is a known position worth a snapshot; so are the ends of the parts
other conversations share (serve/snapshots/checkpoints.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from serve.core.errors import ApiError, invalid
from serve.core.request import ChatRequest, CompletionRequest
from serve.formats.base import ChatFormat, ChatFormatError, PromptError, Rendering
from serve.snapshots.checkpoints import preamble_ends
from serve.engine.types import UnencodableText, WasteError
from serve.engine.api import EngineApi, ImageProbe
from serve.snapshots.history_ids import tokenize_history
from serve.tokenizer.api import Runner, Tokenizer, at_once, tokenize_segments
from serve.service.image_positions import ImagePositions
from serve.service.images import image_parts, StagedImages
from serve.snapshots.reply_memory import ReplyMemory
from serve.snapshots.scope import NO_SCOPE, Scope, scope_of
from serve.core.segment import Segment


@dataclass
class Prompt:
    """A tokenized prompt and what prefilling it, and remembering its reply, need to know."""
    ids: list[int]                        # what the engine will hold, images expanded
    snapshot_at: Sequence[int] = ()       # positions worth a prefix snapshot
    text_ids: list[int] = field(default_factory=list)  # with images: the ids before expansion
    image_start: int = 0                  # with images: where the first placeholder is in text_ids
    image_paths: Sequence[str] = ()       # with images: the files, to queue again after prefill
    image_params: Sequence[str] = ()      # with images: the request field each came from
    image_sizes: Sequence[tuple[int, int]] = ()        # with images: each one's width, height
    image_figures: Sequence[Optional[int]] = ()        # with images: serve's figure of each
                                                       # one's positions (None: not figured)
    generation: Sequence[int] = ()        # the generation prompt's ids, which open the reply's message
    conversation: Sequence[Segment] = ()  # the rendered segments before the generation prompt
    thinking: bool = False                # the reply opens in the think channel
    scope: Scope = NO_SCOPE               # whose snapshots and replies it stores and finds

    @property
    def restorable(self) -> tuple[list[int], int]:
        """The ids a snapshot may hold a prefix of, and the most positions it may hold: never
        the first image's (the same placeholder ids stand for any picture), nor the last
        (generation needs a prompt token of its own)."""
        if self.image_paths:
            return self.text_ids, self.image_start
        return self.ids, len(self.ids) - 1

    @property
    def expanded_length(self) -> Optional[int]:
        """The positions the prompt takes with its images expanded, by serve's figures;
        None when an image was not figured (only the engine can say)."""
        if not self.image_paths:
            return len(self.ids)
        if any(figure is None for figure in self.image_figures):
            return None
        return len(self.ids) + sum(figure - 1 for figure in self.image_figures if figure)

    @property
    def history(self) -> list[int]:
        """The conversation's ids: the prompt before the generation prompt."""
        return self.ids[:len(self.ids) - len(self.generation)]


@dataclass(frozen=True)
class ChatCheck:
    """What a chat request needs of the format, known before it waits for the engine."""
    thinking: bool
    images: list[tuple[str, str]]   # (param, url) of each image part
    reasoning: str = "off"          # what the reply's waste.reasoning says (PromptBuilder.reasoning)


def too_long(tokens: int, ctx: int, param: str, beyond: str, at_least: bool = False) -> ApiError:
    """The 400 of a prompt the context cannot hold: both numbers, and `beyond`, what a larger
    context would take (serve/app/context.py's beyond(): --ctx only when one is possible)."""
    return ApiError(400, f"the prompt is {'at least ' if at_least else ''}{tokens} tokens; the "
                         f"context holds {ctx} including at least one generated token"
                         + (f" ({beyond})" if beyond else ""),
                    param=param, code="context_length_exceeded")


def check_room(tokens: int, ctx: int, param: str, beyond: str) -> None:
    """Refuse a prompt that leaves no position for a generated token."""
    if tokens > ctx - 1:
        raise too_long(tokens, ctx, param, beyond)


def check_fits(engine: EngineApi, chars: int, param: str, beyond: str) -> None:
    """Refuse text that cannot fit before tokenizing it (which costs memory in proportion).

    No token is longer than the vocabulary's longest, and `chars` characters
    are at least as many UTF-8 bytes, so they make at least chars / longest tokens.
    """
    longest, ctx = engine.longest_token, engine.info.ctx_max
    least = -(-chars // longest) if longest else 0
    if least > ctx - 1:
        raise too_long(least, ctx, param, beyond, at_least=True)


def least_chars(value: object) -> int:
    """Characters in the strings (keys too) of a JSON value: what its JSON text holds at least."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item if isinstance(key, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def least_rendered_chars(messages: Sequence[object], images: int, placeholder: str) -> int:
    """Characters every format's rendering of `messages` holds at least, for refusing a
    prompt that cannot fit before rendering it: each message's text is in it verbatim, but
    for the image `placeholder`s that may stand for the request's `images`."""
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and part.get("type") == "text"
                         and isinstance(part.get("text"), str))
    return max(0, chars - images * len(placeholder))


class PromptBuilder:
    def __init__(self, engine: EngineApi, images: ImageProbe, chat_format: ChatFormat, *,
                 tokenizer: Tokenizer, bos: Sequence[int], vision: bool,
                 reply_memory: Optional[ReplyMemory], keep_reasoning: bool,
                 snapshots: bool, default_thinking: bool, tokenizing: Runner = at_once,
                 context_beyond: str = "", positions: Optional[ImagePositions] = None,
                 shared_namespace: str = "", reasoning_budget: Optional[int] = None):
        self.engine = engine
        self.tokenizer = tokenizer       # called through `tokenizing`, before the engine is held
        self.tokenizing = tokenizing     # runs a prompt's whole tokenizing (the engine's: as an errand)
        self.bos = list(bos)             # what a completion's prompt starts with
        self.images = images
        self.chat_format = chat_format
        self.vision = vision
        self.reply_memory = reply_memory
        self.keep_reasoning = keep_reasoning
        self.snapshots = snapshots                 # a prefix cache will store snapshots
        self.default_thinking = default_thinking   # when a request does not say
        self.reasoning_budget = reasoning_budget   # think-channel tokens, when a request does not say
        self.context_beyond = context_beyond       # a too-long prompt's word on a larger context
        self.positions = positions or ImagePositions(None)   # serve's figure of images' positions
        self.shared_namespace = shared_namespace   # what every request finds too (--shared-namespace)

    def scope(self, req: ChatRequest | CompletionRequest) -> Scope:
        """Whose the request's snapshots and replies are (serve/snapshots/scope.py)."""
        return scope_of(req.owner, req.cache_salt, self.shared_namespace)

    # -- before the engine ------------------------------------------------------------

    def check(self, req: ChatRequest) -> ChatCheck:
        """What the chat format must be able to express; a 400 naming what it cannot."""
        fmt = self.chat_format
        if fmt.refusal is not None:
            raise ApiError(400, f"this model has no usable chat format ({fmt.refusal}); "
                                "/v1/completions still works", param="messages",
                           code="unsupported_chat_format")
        thinking = self.thinking(req)
        if req.thinking_token_budget is not None and req.thinking_token_budget > 0 \
                and not fmt.supports_reasoning:
            raise invalid("thinking_token_budget",
                          f"thinking_token_budget asks for a reasoning budget, and the "
                          f"{fmt.name} chat format has no reasoning channel ({fmt.description})")
        if req.tools and req.tool_choice != "none" and not fmt.supports_tools:
            raise invalid("tools", f"the {fmt.name} chat format cannot declare tools "
                                   f"({fmt.description})")
        images = image_parts(req.messages)
        if images:
            param = images[0][0]
            if not self.vision:
                raise invalid(param, "images need the vision tower: start the server with --vision")
            if not fmt.supports_images:
                raise invalid(param, f"the {fmt.name} chat format cannot carry images")
            most = self.positions.max_images
            if most is not None and len(images) > most:
                raise invalid(images[most][0], f"a request may carry at most {most} images "
                                               f"(the engine queues no more); this one has "
                                               f"{len(images)}")
        # Before the engine is held: text that cannot fit is refused unrendered.
        tools = least_chars(req.tools or ())
        check_fits(self.engine, tools, "tools", self.context_beyond)
        least = least_rendered_chars(req.messages, len(images), fmt.image_placeholder)
        check_fits(self.engine, tools + least, "messages", self.context_beyond)
        return ChatCheck(thinking, images, self.reasoning(req, thinking))

    def thinking(self, req: ChatRequest) -> bool:
        """Whether the reply opens in the think channel. A format without one accepts any
        effort, and the reply says it went unused (`reasoning`)."""
        if not self.chat_format.supports_reasoning or self.budget(req) == 0:
            return False   # a budget of 0 is thinking off
        return self.default_thinking if req.thinking is None else req.thinking

    def budget(self, req: ChatRequest) -> Optional[int]:
        """The reply's think-channel tokens: the request's budget, else the server's (None:
        no budget)."""
        budget = self.reasoning_budget if req.thinking_token_budget is None \
            else req.thinking_token_budget
        return None if budget is None or budget < 0 else budget

    def reasoning(self, req: ChatRequest, thinking: bool) -> str:
        """The reply's reasoning, as waste.reasoning reports it: "unsupported" (the format
        has no reasoning channel), "off", the effort level the prompt names, or "on"."""
        if not self.chat_format.supports_reasoning:
            return "unsupported"
        if not thinking:
            return "off"
        return req.thinking_effort or "on"

    def of_chat(self, req: ChatRequest, check: ChatCheck, staged: StagedImages,
             fit: bool = True) -> Prompt:
        """Render once and tokenize, before the engine is held; images are measured here
        and encoded on the engine (with_images). `fit`: refuse a prompt that leaves the
        context no room for a reply (/tokenize counts one that does not fit)."""
        paths = [staged.stage(url, param) for param, url in check.images]
        sizes = [staged.measure(self.images.image_dimensions, path, param,
                                self.positions.max_pixels)
                 for path, (param, _) in zip(paths, check.images)]
        prompts = [self.chat_format.image_prompt(*size) for size in sizes]
        scope = self.scope(req)
        messages, conversation, replies = self._recall(req, check.thinking, prompts, scope.own)
        check_fits(self.engine, conversation.chars(), "messages", self.context_beyond)
        cuts = self._preamble_cuts(req, messages, conversation)
        opening = self.chat_format.generation_prompt(check.thinking)

        def tokenize() -> tuple[list[int], dict[int, int], list[int]]:
            history, positions = tokenize_history(self.tokenizer, conversation.segments, replies,
                                                  cuts)
            return history, positions, tokenize_segments(self.tokenizer, opening)
        try:
            history, positions, generation = self.tokenizing(tokenize)
        except UnencodableText as e:
            raise invalid("messages", f"a message cannot be tokenized: {e}") from None
        ids = history + generation
        snapshot_at = [*sorted(positions[cut] for cut in cuts if cut in positions), len(history)]
        if not paths:
            if fit:
                check_room(len(ids), self.engine.info.ctx_max, "messages", self.context_beyond)
            return Prompt(ids, snapshot_at, generation=generation,
                          conversation=conversation.segments, thinking=check.thinking,
                          scope=scope)
        prompt = Prompt(ids, snapshot_at, text_ids=ids,
                        image_start=ids.index(self._media_pad()), image_paths=paths,
                        image_params=[param for param, _ in check.images], image_sizes=sizes,
                        image_figures=[self.positions.figure(*size) for size in sizes],
                        generation=generation, conversation=conversation.segments,
                        thinking=check.thinking, scope=scope)
        # Each image's placeholder is one position here and its figure once expanded; an
        # image serve does not figure counts one position until the engine counts it.
        expanded = prompt.expanded_length
        check_room(len(ids) if expanded is None else expanded, self.engine.info.ctx_max,
                   "messages", self.context_beyond)
        return prompt

    def text(self, prompt: str) -> list[int]:
        """A completion's prompt, after the BOS the container has (waste_tokenize's add_bos)."""
        try:
            ids = self.bos + self.tokenizing(lambda: self.tokenizer.tokenize(prompt))
        except UnencodableText as e:
            raise invalid("prompt", f"the prompt cannot be tokenized: {e}") from None
        if not ids:
            raise invalid("prompt", "prompt is empty")
        check_room(len(ids), self.engine.info.ctx_max, "prompt", self.context_beyond)
        return ids

    def pieces(self, ids: Sequence[int], param: str, indexed: bool = True) -> list[bytes]:
        """Each id's bytes (a special token's as its text), by the prompts' tokenizer; a 400
        naming the first id no token has, as `param[i]` (or `param` when not `indexed`)."""
        tokenizer = self.tokenizer

        def each() -> list[bytes]:
            found = []
            for i, token in enumerate(ids):
                try:
                    found.append(tokenizer.detokenize([token]))
                except (ValueError, WasteError):
                    raise invalid(f"{param}[{i}]" if indexed else param,
                                  f"no token has the id {token}") from None
            return found
        return self.tokenizing(each)

    # -- holding the engine -----------------------------------------------------------

    def with_images(self, prompt: Prompt) -> Prompt:
        """The prompt with its images encoded and queued on the engine, their placeholders
        expanded to the positions each takes."""
        if not prompt.image_paths:
            return prompt
        for path, param, size, figure in zip(prompt.image_paths, prompt.image_params,
                                             prompt.image_sizes, prompt.image_figures):
            try:
                counted = self.engine.image_add(path)  # decodes the image, counts its positions
            except WasteError as e:
                self.engine.image_clear()
                raise invalid(param, f"image could not be encoded: {e}") from None
            self.positions.observe(size, figure, counted)
        return replace(prompt, ids=self.engine.image_expand(prompt.text_ids))

    def reply(self, message: dict, thinking: bool) -> list[Segment]:
        """One assistant message's own segments as history renders them (what reply memory
        keys on); [] when it cannot be rendered on its own (the whole conversation's
        rendering then reports what is wrong with it)."""
        try:
            return self.chat_format.render([message], thinking=thinking,
                                           add_generation_prompt=False).message(0)
        except (ChatFormatError, ValueError, RecursionError):
            return []

    # -- the parts --------------------------------------------------------------------

    def _media_pad(self) -> int:
        pad = self.chat_format.media_pad
        assert pad is not None   # images reach the prompt only under a format that places them
        return pad

    def _render(self, req: ChatRequest, messages: list, thinking: bool,
                prompts: list[str]) -> Rendering:
        try:
            return self.chat_format.render(
                messages, tools=req.tools, tool_choice=req.tool_choice,
                response_format=req.response_format, thinking=thinking,
                thinking_effort=req.thinking_effort if thinking else None, image_prompts=prompts,
                add_generation_prompt=False)
        except ChatFormatError as e:
            raise invalid(e.field or "messages", str(e), code="unsupported_by_chat_format") from None
        except PromptError as e:
            raise invalid(e.field, str(e)) from None
        except ValueError as e:
            raise invalid("messages", str(e)) from None
        except RecursionError:  # e.g. tool-call arguments nested deeper than json.loads goes
            raise invalid("messages", "a message is nested too deeply to render") from None

    def _recall(self, req: ChatRequest, thinking: bool, prompts: list[str], namespace: str
                ) -> tuple[list, Rendering, list[tuple[list[Segment], Sequence[int]]]]:
        """The messages, their rendering, and for each assistant message that renders as a
        reply remembered in `namespace`, (its rendering, the reply's ids). With --keep-reasoning, reasoning
        remembered for a reply the client returned without it is put back (and the
        conversation rendered again with it)."""
        messages = list(req.messages)
        conversation = self._render(req, messages, thinking, prompts)
        memory = self.reply_memory
        if memory is None or not (len(memory) or memory.shared is not None):
            return messages, conversation, []   # nothing remembered, here or by the team
        replies: list[tuple[list[Segment], Sequence[int]]] = []
        restored = False
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            rendered = conversation.message(i)
            entry = memory.recall(rendered, namespace) if rendered else None
            if entry is None and rendered and self.keep_reasoning:
                entry = memory.recall_without_reasoning(
                    rendered, lambda: self._render(req, messages[:i], thinking, prompts).segments,
                    namespace)
                if entry is not None:
                    message = {k: v for k, v in message.items() if k != "reasoning"}
                    message["reasoning_content"] = entry.reasoning
                    messages[i], rendered, restored = message, self.reply(message, thinking), True
            if entry is not None:
                replies.append((rendered, entry.ids))
        if restored:
            conversation = self._render(req, messages, thinking, prompts)
        return messages, conversation, replies

    def _preamble_cuts(self, req: ChatRequest, messages: list, conversation: Rendering) -> list[int]:
        """Segment counts where the tool declarations, the leading system messages and the
        messages before the trailing notes end (none without a prefix cache)."""
        if not self.snapshots:
            return []
        notes = req.tool_choice not in (None, "auto") or req.response_format is not None
        return preamble_ends(conversation, messages, notes)
