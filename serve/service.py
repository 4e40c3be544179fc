"""Runs one OpenAI request on the engine, with no HTTP in sight.

Chat: messages → segments → token ids (→ images expanded) → generate → parser
deltas → stop strings → a finished reply. Completions skip the template and
the parser. Every request starts from an empty conversation and holds the
engine lock from prompt building to the last token, so requests cannot see
or disturb each other's state or image queue.
"""
from __future__ import annotations

import codecs
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from . import api, decode, grammar
from .api import ApiError, ChatRequest, CompletionRequest, Sampling, Usage, invalid
from .chatfmt import ChatFormatError, NoChatFormat
from .checkpoints import preamble_ends
from .engine import GenParams, GenResult, Stats, TokenInfo, UnencodableText, WasteError
from .activity import Activity
from .engine_queue import EngineQueue, shutting_down
from .history_ids import overlay, tokenize_history
from .images import StagedImages, image_parts
from .logprobs import LogprobTrail, chat_logprobs, completion_logprobs
from .metrics import Metrics
from .prefill import DEFAULT_CHUNK, PrefillCancelled, prefill
from .prefix_cache import PrefixCache
from .reply_memory import ReplyMemory
from .stops import StopFilter
from .xtml import PromptError, image_prompt


# A snapshot after a reply is saved only when it spares the next turn at least this many
# prompt positions over the one made before the reply (see the README's cost model).
MIN_SPARED_TOKENS = 16
# Deferred snapshots evaluate one token at a time: a request arriving meanwhile waits for
# one token's evaluation at most (about 2 s on K3).
SETTLE_CHUNK = 1


class ReplySink(Protocol):
    """Where a running request sends its output (a socket, or nothing for blocking replies)."""

    def start(self) -> None:
        """The request was accepted and generation begins; errors after this are mid-reply."""

    def progress(self, done: int, total: int) -> None:
        """Prefill has evaluated `done` of `total` prompt positions."""

    def emit(self, delta: dict) -> None:
        """One piece of output: a chat delta, or {"text": ...} for completions."""

    def gone(self) -> bool:
        """True once the client has disconnected: generation stops at the next token."""

    def queued(self, ahead: int) -> None:
        """The request waits for the engine behind `ahead` others (the running one included);
        called again when that number changes."""


class _Watched:
    """The sink as a running request sees it: also gone once the server is shutting down.

    Every generation loop already stops when its sink is gone, so this is how
    shutdown reaches all of them, at their next token or prefill chunk.
    """

    def __init__(self, sink: ReplySink, stopping: threading.Event):
        self._sink = sink
        self._stopping = stopping
        self.cut = False  # gone() said yes because of shutdown

    def start(self) -> None:
        self._sink.start()

    def progress(self, done: int, total: int) -> None:
        self._sink.progress(done, total)

    def emit(self, delta: dict) -> None:
        self._sink.emit(delta)

    def queued(self, ahead: int) -> None:
        self._sink.queued(ahead)

    def gone(self) -> bool:
        if self._stopping.is_set():
            self.cut = True
            return True
        return self._sink.gone()


@dataclass
class ServiceOptions:
    model_id: str
    max_tokens: int = 4096
    thinking: bool = True          # the default when a request does not say
    vision: bool = False
    allow_local_images: Optional[str] = None    # a directory clients may name image files in
    prefix_cache: Optional[PrefixCache] = None   # None: prefill every request from scratch
    prefill_chunk: int = DEFAULT_CHUNK
    snapshot_min_tokens: int = 0   # a shorter prompt that restored nothing is not snapshotted
    log: Optional[Callable[[str], None]] = None  # prefill progress of long prompts
    reply_memory: Optional[ReplyMemory] = None   # None: history is always re-tokenized
    keep_reasoning: bool = False   # render remembered reasoning into replies a client returns without it
    eval_logits: bool = True       # False: the engine's waste_eval gives no logits to decode with
    max_queue: int = 32            # requests that may wait for the engine; more get a 503


@dataclass
class ChatReply:
    message: dict
    finish_reason: str
    usage: Usage
    client_gone: bool
    logprobs: Optional[dict] = None   # choices[].logprobs, when asked for
    stop_sequence: str = ""   # the stop string that ended the reply, if one did


@dataclass
class CompletionReply:
    text: str
    finish_reason: str
    usage: Usage
    client_gone: bool
    logprobs: Optional[dict] = None


@dataclass
class _Prompt:
    """A tokenized prompt and what prefilling it needs to know."""
    ids: list[int]                        # what the engine will hold, images expanded
    snapshot_at: Sequence[int] = ()       # positions worth a prefix snapshot
    text_ids: list[int] = field(default_factory=list)  # with images: the ids before expansion
    image_start: int = 0                  # with images: where the first placeholder is in text_ids
    image_paths: Sequence[str] = ()       # with images: the files, to queue again after prefill
    generation: Sequence[int] = ()        # the generation prompt's ids, which open the reply's message
    conversation: Sequence = ()           # the rendered segments before the generation prompt


@dataclass
class _Run:
    """What the token callback learns while generation runs."""
    stop_ids: frozenset[int]
    max_tokens: int
    client_gone: bool = False
    started_at: float = 0.0         # when prefill began, after any wait for the engine
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    tokens: list[int] = field(default_factory=list)  # every generated id
    unevaluated: int = 0            # of those, how many the state lacks (serve's decoder: the last)
    cached_tokens: int = 0          # prompt positions restored from a snapshot
    stats: Optional[Stats] = None   # engine counters for this request only
    decoding: dict = field(default_factory=lambda: decode.Report(constrained=False).waste())

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else -1


class Service:
    def __init__(self, engine: Any, library: Any, chat_format: Any, options: ServiceOptions):
        self.engine = engine
        self.library = library
        self.chat_format = chat_format
        self.options = options
        self.created = api.now()
        self.warming: Optional[dict] = None   # while --warm runs: what /health reports
        self._waiting = 0                   # requests waiting for the engine lock
        self._waiting_lock = threading.Lock()
        # A snapshot to make when the engine is idle: the history's ids, the reply's rendering
        # and ids, and how many of those the snapshot saved after generation holds.
        self._settle: Optional[tuple[list[int], list, list[int], int]] = None
        self._deferred = 0                  # settle threads started and not yet finished
        self._closed = False
        self._vocabularies: dict[tuple, Any] = {}   # llguidance's view of the vocabulary, built once
        self.queue = EngineQueue(options.max_queue)
        self._stopping = threading.Event()
        self._request_id = ""  # of the request holding the engine, for its log lines
        self.metrics = Metrics(engine.stats(), self.activity, options.prefix_cache)

    def activity(self) -> Activity:
        # Deferred work first: a settle job is counted until its thread has let the engine go.
        with self._waiting_lock:
            deferred = self._deferred > 0
        return Activity(self.queue.busy, len(self.queue), deferred, self.warming is not None)

    # -- shutdown -------------------------------------------------------------

    def stop(self) -> None:
        """Refuse new and queued work; what runs stops at its next token or prefill chunk."""
        self._stopping.set()
        self._closed = True  # and deferred snapshot work at its next chunk
        self.queue.close()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """After stop(): True once no request uses the engine (it may then be closed)."""
        return self.queue.wait_idle(timeout)

    @contextmanager
    def _turn(self, request_id: str, sink: ReplySink) -> Iterator[_Watched]:
        """Wait in line for the engine and hold it; a run cut by shutdown ends in its 503."""
        watched = _Watched(sink, self._stopping)
        with self.queue.turn(watched), self._engine_turn():
            self._request_id = request_id
            yield watched
        if watched.cut:
            raise shutting_down()

    # -- models ---------------------------------------------------------------

    def model(self) -> dict:
        info = self.engine.info
        return {"id": self.options.model_id, "object": "model", "created": self.created,
                "owned_by": "serve",
                "waste": {"arch": info.arch, "n_layers": info.n_layers, "n_experts": info.n_experts,
                          "top_k": info.top_k, "hidden": info.hidden, "ctx": info.ctx_max,
                          "params_total": info.params_total, "params_active": info.params_active,
                          "quant": info.quant_summary,
                          "chat_format": self.chat_format.name or "none",
                          "vision": self.options.vision}}

    # -- chat -----------------------------------------------------------------

    def chat(self, req: ChatRequest, sink: ReplySink) -> ChatReply:
        thinking, images = self._check_chat(req)
        with self._turn(req.request_id, sink) as sink:
            self._start_empty()
            with StagedImages(self.options.allow_local_images) as staged:
                prompt = self._chat_prompt(req, thinking, images, staged)
                return self._generate_chat(req, prompt, thinking, sink)

    def count_chat(self, req: ChatRequest, sink: ReplySink) -> int:
        """The positions a chat request's prompt would take, without generating anything.

        It waits in line like any request (tokenizing needs the engine)."""
        thinking, images = self._check_chat(req)
        with self._turn(req.request_id, sink):
            self._start_empty()
            with StagedImages(self.options.allow_local_images) as staged:
                prompt = self._chat_prompt(req, thinking, images, staged)
            self.engine.image_clear()
            return len(prompt.ids)

    def _check_chat(self, req: ChatRequest) -> tuple[bool, list[tuple[str, str]]]:
        """What the chat format must be able to express: (thinking, the image parts)."""
        fmt = self.chat_format
        if isinstance(fmt, NoChatFormat):
            raise ApiError(400, "this model has no usable chat format (" + "; ".join(fmt.reasons)
                           + "); /v1/completions still works", param="messages",
                           code="unsupported_chat_format")
        thinking = self._thinking(req)
        if req.tools and not fmt.supports_tools:
            raise invalid("tools", f"the {fmt.name} chat format cannot declare tools")
        images = image_parts(req.messages)
        self._check_images(images)
        return thinking, images

    def _chat_prompt(self, req: ChatRequest, thinking: bool, images: list[tuple[str, str]],
                     staged: StagedImages) -> "_Prompt":
        """Render and tokenize, holding the engine; images are queued on it."""
        paths = [staged.stage(url, param) for param, url in images]
        prompts = [image_prompt(*staged.measure(self.library.image_dimensions, path, param))
                   for path, (param, _) in zip(paths, images)]
        # The conversation and the generation prompt are tokenized apart (as
        # segments always are) so that the end of the conversation, which the
        # next turn's prompt will repeat, is a known position worth a snapshot.
        messages, replies = self._recall(req, thinking, prompts)
        conversation = self._render(req, messages, thinking, prompts)
        self._check_fits(sum(len(segment.text) for segment in conversation), "messages")
        try:
            history = tokenize_history(self.engine, conversation, replies)
        except UnencodableText as e:
            raise invalid("messages", f"a message cannot be tokenized: {e}") from None
        generation = self.engine.tokenize_segments(self.chat_format.generation_prompt(thinking))
        ids = history + generation
        for path, (param, _) in zip(paths, images):
            try:
                self.engine.image_add(path)  # validates the image, and counts its positions
            except WasteError as e:
                self.engine.image_clear()
                raise invalid(param, f"image could not be encoded: {e}") from None
        prompt = _Prompt(ids, snapshot_at=[
            *self._preamble_ends(req, messages, thinking, conversation, history),
            len(history)], generation=generation, conversation=conversation)
        if paths:
            prompt = _Prompt(self.engine.image_expand(ids), snapshot_at=prompt.snapshot_at,
                             text_ids=ids, image_start=ids.index(self.chat_format.media_pad),
                             image_paths=paths, generation=generation,
                             conversation=conversation)
        return prompt

    def _thinking(self, req: ChatRequest) -> bool:
        if not self.chat_format.supports_reasoning:
            if req.thinking:
                raise invalid("reasoning_effort",
                              f"the {self.chat_format.name} chat format has no reasoning channel")
            return False
        return self.options.thinking if req.thinking is None else req.thinking

    def warm(self, req: ChatRequest, progress: Callable[[int, int], None],
             cancelled: Callable[[], bool]) -> tuple[int, int]:
        """Prefill and checkpoint a request's conversation as chat() would, and answer
        nothing.  Returns (positions the conversation holds, positions restored)."""
        cache = self.options.prefix_cache
        if cache is None or isinstance(self.chat_format, NoChatFormat):
            raise invalid("messages", "warming needs the prefix cache and a chat format")
        if image_parts(req.messages):
            raise invalid("messages", "a conversation with images is not warmed")
        thinking = self._thinking(req)
        with self._engine_turn():
            self._start_empty()
            with StagedImages(self.options.allow_local_images) as no_images:
                prompt = self._chat_prompt(req, thinking, [], no_images)
            ids, held = prompt.ids, len(prompt.ids) - len(prompt.generation)
            if len(ids) > self.engine.info.ctx_max:
                raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds "
                                    f"{self.engine.info.ctx_max}", param="messages",
                               code="context_length_exceeded")
            try:
                restored = prefill(self.engine, ids, held, cache=cache,
                                   snapshot_at=prompt.snapshot_at,
                                   chunk=self.options.prefill_chunk, progress=progress,
                                   cancelled=cancelled)
            finally:
                self.engine.reset()
        return held, restored

    def _preamble_ends(self, req: ChatRequest, messages: list, thinking: bool, segments: list,
                       history: list[int]) -> list[int]:
        """Token positions where the tool declarations, the leading system messages and
        the messages before the trailing notes end (where `history` agrees exactly)."""
        if self.options.prefix_cache is None:
            return []

        def render(part: list) -> list:
            return self.chat_format.render(
                part, tools=req.tools, thinking=thinking, add_generation_prompt=False,
                thinking_effort=req.thinking_effort if thinking else None)

        def size(part: list) -> int:
            return sum(len(segment.text) for segment in part)

        ends = []
        notes = req.tool_choice not in (None, "auto") or req.response_format is not None
        for n in preamble_ends(render, messages, segments, notes):
            # Whichever side of the boundary is shorter is tokenized again; the history
            # may hold a remembered reply's ids, so the match is checked, never assumed.
            if size(segments[:n]) <= size(segments[n:]):
                ids = self.engine.tokenize_segments(segments[:n])
                if history[:len(ids)] == ids:
                    ends.append(len(ids))
            else:
                ids = self.engine.tokenize_segments(segments[n:])
                if 0 < len(ids) < len(history) and history[len(history) - len(ids):] == ids:
                    ends.append(len(history) - len(ids))
        return ends

    def _check_images(self, images: list[tuple[str, str]]) -> None:
        if not images:
            return
        param = images[0][0]
        if not self.options.vision:
            raise invalid(param, "images need the vision tower: start the server with --vision")
        if not self.chat_format.supports_images:
            raise invalid(param, f"the {self.chat_format.name} chat format cannot carry images")

    def _recall(self, req: ChatRequest, thinking: bool, prompts: list[str]) -> tuple[list, list]:
        """The messages (with --keep-reasoning, remembered reasoning restored) and, for each
        assistant message that renders as a remembered reply, (its rendering, the reply's ids)."""
        memory = self.options.reply_memory
        if memory is None or not len(memory):
            return req.messages, []
        messages, replies = list(req.messages), []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            rendered = self._render_reply(message, thinking)
            entry = memory.recall(rendered) if rendered else None
            if entry is None and rendered and self.options.keep_reasoning:
                entry = memory.recall_without_reasoning(
                    rendered, lambda: self._render(req, messages[:i], thinking, prompts))
                if entry is not None:
                    message = {k: v for k, v in message.items() if k != "reasoning"}
                    message["reasoning_content"] = entry.reasoning
                    messages[i], rendered = message, self._render_reply(message, thinking)
            if entry is not None:
                replies.append((rendered, entry.ids))
        return messages, replies

    def _render_reply(self, message: dict, thinking: bool) -> list:
        """One assistant message rendered as history; [] when it cannot be rendered on its own
        (the whole conversation's rendering then reports what is wrong with it)."""
        try:
            return self.chat_format.render([message], thinking=thinking, add_generation_prompt=False)
        except (ChatFormatError, ValueError, RecursionError):
            return []

    def _render(self, req: ChatRequest, messages: list, thinking: bool, prompts: list[str]) -> list:
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

    def _generate_chat(self, req: ChatRequest, prompt: "_Prompt", thinking: bool,
                       sink: ReplySink) -> ChatReply:
        ours, sink = self._decoder(req.sampling, req.logprobs, sink, "content",
                                      self._chat_grammar(req, thinking))
        parser = self.chat_format.new_parser(thinking)
        stops = StopFilter(req.sampling.stop)
        reasoning: list[str] = []
        content: list[str] = []

        def forward(deltas: list) -> None:
            for d in deltas:
                if d.reasoning_content:
                    reasoning.append(d.reasoning_content)
                    sink.emit({"reasoning_content": d.reasoning_content})
                elif d.content:
                    shown = stops.feed(d.content)
                    if shown:
                        content.append(shown)
                        sink.emit({"content": shown})
                elif d.tool_call:
                    sink.emit({"tool_calls": [d.tool_call]})

        stop_ids = frozenset(self.chat_format.stop_tokens)

        def on_piece(token: int, piece: bytes) -> bool:
            closed = parser.ended
            forward(parser.feed_token(token, piece))
            if stops.hit:
                return True
            # A stop token ends generation by itself, and an uncancelled generate leaves a
            # state worth a snapshot. So once the message has closed, the model gets one more
            # token for the stop token that follows: anything else is cancelled.
            return closed and token not in stop_ids

        run, result, ms = self._run(prompt, req.sampling, self.chat_format.stop_tokens, sink, on_piece,
                                    ours)
        if not stops.hit and not run.client_gone:
            forward(parser.finish())
            tail = stops.flush()
            if tail:
                content.append(tail)
                sink.emit({"content": tail})
        tool_calls = parser.reply.tool_calls
        finish = self._finish_reason(run, result, stops.hit or parser.ended, bool(tool_calls))
        message = api.chat_message("".join(content), "".join(reasoning), tool_calls)
        if not run.client_gone:
            self._remember(prompt, thinking, run, result, message)
        return ChatReply(message, finish, self._usage(len(prompt.ids), run, result, ms),
                         run.client_gone, _trail(sink, chat_logprobs), stops.matched)

    def _remember(self, prompt: "_Prompt", thinking: bool, run: _Run, result: GenResult,
                  message: dict) -> None:
        """Keep the reply's ids for the history of later turns, and a snapshot of the state
        that holds them."""
        memory, cache = self.options.reply_memory, self.options.prefix_cache
        rendered = self._render_reply(message, thinking) if run.tokens else []
        ids = [*prompt.generation, *run.tokens]
        if memory is not None and rendered:
            reasoning = message.get("reasoning_content") or ""
            dropped = self._render_reply({k: v for k, v in message.items() if k != "reasoning_content"},
                                         thinking) if reasoning else rendered
            memory.remember(rendered, ids, reasoning,
                            (prompt.conversation, dropped) if dropped != rendered else None)
        # A full context leaves no room for a next turn; snapshots never reach past images.
        if cache is None or result.context_full or prompt.image_paths:
            return
        held = len(ids) - run.unevaluated   # of the reply's ids, those the state holds
        saved = 0
        # A cancelled generate leaves a state the ABI does not describe (it asks for a reset).
        if not result.cancelled and held >= MIN_SPARED_TOKENS:  # else a save costs more than it spares
            try:
                if cache.store([*prompt.ids, *ids[len(prompt.generation):held]], self.engine.save_state):
                    saved = held
            except (WasteError, OSError):
                pass   # a snapshot only spares later requests work
        if memory is not None and rendered:
            # The next turn holds the whole message: after a cancel, the reply again up to a
            # stop string's cut (never past what the client saw); after max_tokens, the closing
            # markup the model never wrote. The idle engine builds that state.
            self._settle = (prompt.ids[:len(prompt.ids) - len(prompt.generation)], rendered, ids, saved)
            with self._waiting_lock:
                self._deferred += 1
            threading.Thread(target=self._settle_deferred, name="settle", daemon=True).start()

    def _settle_deferred(self) -> None:
        try:
            self.settle()
        finally:
            with self._waiting_lock:
                self._deferred -= 1

    def settle(self) -> None:
        """Make the deferred snapshot, in idle time only.

        It restores the longest snapshot of it and evaluates the rest, in small
        chunks; a request that starts waiting for the engine ends it at the next
        chunk. Runs on its own thread after a reply; tests call it to wait for it.
        """
        with self.engine.lock:
            job, self._settle = self._settle, None
            if job is None or self._closed or self._someone_waiting():
                return
            history, rendered, ids, saved = job
            try:
                tokens = history + overlay(self.engine, rendered, ids)
                if len(tokens) - len(history) < MIN_SPARED_TOKENS or tokens[len(history):] == ids[:saved]:
                    return   # too close to the snapshot before the reply, or the one after it
                self._start_empty()
                # prefill leaves one token for generate: the last one is evaluated apart.
                prefill(self.engine, tokens, len(tokens) - 1, cache=self.options.prefix_cache,
                        chunk=SETTLE_CHUNK, cancelled=self._someone_waiting)
                self.engine.eval(tokens[-1:])
                self.options.prefix_cache.store(tokens, self.engine.save_state)
            except (PrefillCancelled, UnencodableText, WasteError, OSError):
                pass   # the snapshot only spares the next turn work; that turn goes on without it
            finally:
                self._start_empty()

    def close(self) -> None:
        """No more deferred work: returns once none is running, before the engine closes."""
        self._closed = True
        with self.engine.lock:
            self._settle = None

    def _someone_waiting(self) -> bool:
        return self._waiting > 0 or self._closed

    @contextmanager
    def _engine_turn(self) -> Iterator[None]:
        """Hold the engine for one request; deferred work yields to it and is dropped."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            self.engine.lock.acquire()
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        try:
            self._settle = None
            yield
        finally:
            self.engine.lock.release()

    # -- completions ----------------------------------------------------------

    def complete(self, req: CompletionRequest, sink: ReplySink) -> CompletionReply:
        self._check_fits(len(req.prompt), "prompt")
        with self._turn(req.request_id, sink) as sink:
            self._start_empty()
            # The engine knows whether its container has a BOS to add.
            try:
                ids = self.engine.tokenize(req.prompt, markup=False, add_bos=True)
            except UnencodableText as e:
                raise invalid("prompt", f"the prompt cannot be tokenized: {e}") from None
            if not ids:
                raise invalid("prompt", "prompt is empty")
            return self._generate_text(req, ids, sink)

    def _generate_text(self, req: CompletionRequest, ids: list[int], sink: ReplySink) -> CompletionReply:
        ours, sink = self._decoder(req.sampling, req.logprobs, sink, "text")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopFilter(req.sampling.stop)
        special_ids = frozenset(self.engine.specials.values())
        text: list[str] = []

        def show(piece: str) -> None:
            if piece:
                text.append(piece)
                sink.emit({"text": piece})

        def on_piece(token: int, piece: bytes) -> bool:
            if token not in special_ids:  # control tokens (e.g. EOS) are not text
                show(stops.feed(decoder.decode(piece)))
            return stops.hit

        run, result, ms = self._run(_Prompt(ids), req.sampling, (), sink, on_piece, ours)
        if not stops.hit and not run.client_gone:
            show(stops.feed(decoder.decode(b"", final=True)))
            show(stops.flush())
        finish = self._finish_reason(run, result, stops.hit, False)
        return CompletionReply("".join(text), finish, self._usage(len(ids), run, result, ms),
                               run.client_gone, _trail(sink, completion_logprobs))

    # -- decoding in serve (structure, logprobs) --------------------------------

    def _chat_grammar(self, req: ChatRequest, thinking: bool) -> Optional[Callable[[int], Any]]:
        """A matcher factory (vocabulary size -> matcher) when the reply is constrained."""
        fmt = self.chat_format
        if not grammar.check_available(req, fmt.prompts_response_format, self._decoding_off(grammar.missing())):
            return None
        if fmt.name == "xtml":
            markers = fmt.markers
            lark = grammar.xtml_grammar(req, grammar.Markup(markers.open, markers.sep, markers.close),
                                        thinking)
        else:
            lark = grammar.json_grammar(req)
        compiled = grammar.compile_grammar(lark, grammar.grammar_field(req))
        eos = tuple(fmt.stop_tokens)

        def matcher(n_vocab: int) -> Any:
            key = (n_vocab, eos)
            if key not in self._vocabularies:
                self._vocabularies[key] = grammar.Vocabulary(self.engine, n_vocab, eos)
            return self._vocabularies[key].matcher(compiled)
        return matcher

    def _decoder(self, sampling: Sampling, top_logprobs: Optional[int], sink: ReplySink,
                 text_key: str, matcher: Optional[Callable[[int], Any]] = None):
        """(decoder, sink): serve's own decoder and a sink that carries logprobs, or
        (None, sink) for waste_generate when nothing needs the logits."""
        off = self._decoding_off(decode.missing())
        if top_logprobs is not None and off is not None:
            raise invalid("logprobs", f"logprobs are off here ({off}); to enable: {grammar.ENABLE_HINT}",
                          code="logprobs_unavailable")
        if matcher is None and top_logprobs is None:
            return None, sink
        if top_logprobs is not None:
            sink = LogprobTrail(sink, frozenset(self.engine.specials.values()), text_key)
        return decode.Decoder(self.engine, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, grammar=matcher, top_logprobs=top_logprobs,
                              listener=sink if top_logprobs is not None else None), sink

    def _decoding_off(self, missing: Optional[str]) -> Optional[str]:
        """Why serve cannot decode by itself, or None."""
        return missing if self.options.eval_logits else "this engine's waste_eval gives no logits"

    # -- shared ---------------------------------------------------------------

    def _start_empty(self) -> None:
        """An empty conversation and image queue: nothing an earlier request left,
        failed or not, may reach this one (the ABI does not say reset drops the queue)."""
        self.engine.reset()
        self.engine.image_clear()

    def _check_fits(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit before tokenizing it (which costs memory in proportion).

        No token is longer than the vocabulary's longest, and `chars` characters
        are at least as many UTF-8 bytes, so they make at least chars / longest tokens.
        """
        longest, ctx = self.engine.longest_token, self.engine.info.ctx_max
        least = -(-chars // longest) if longest else 0
        if least > ctx - 1:
            raise ApiError(400, f"the prompt is at least {least} tokens; the context holds {ctx} "
                                "including at least one generated token",
                           param=param, code="context_length_exceeded")

    def _run(self, prompt: "_Prompt", sampling: Sampling, stop_tokens, sink: ReplySink,
             on_piece, decoder: Optional[decode.Decoder] = None) -> tuple[_Run, GenResult, float]:
        """Prefill, then generate; `on_piece(token, bytes)` returns True when the reply is done."""
        ids = prompt.ids
        room = self.engine.info.ctx_max - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds "
                                f"{self.engine.info.ctx_max} including at least one generated token",
                           param="messages", code="context_length_exceeded")
        wanted = sampling.max_tokens or self.options.max_tokens
        params = GenParams(temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k,
                           seed=secrets.randbits(64) if sampling.seed is None else sampling.seed,
                           max_tokens=min(wanted, room), stop_tokens=tuple(stop_tokens))
        run = _Run(stop_ids=frozenset(stop_tokens), max_tokens=params.max_tokens)

        def on_token(info: TokenInfo, piece: bytes) -> bool:
            now = time.monotonic()
            run.first_token_at = run.first_token_at or now
            run.last_token_at = now
            run.tokens.append(info.token)
            if sink.gone():
                run.client_gone = True
                return True
            try:
                return on_piece(info.token, piece)
            except OSError:  # the client went away while we were writing to it
                run.client_gone = True
                return True

        before = self.engine.stats()
        sink.start()
        started = run.started_at = time.monotonic()
        try:
            rest = self._prefill(prompt, run, sink)
        except PrefillCancelled:
            run.client_gone = True
            result = GenResult(n_tokens=0, cancelled=True, context_full=False, detail=None)
        else:
            # The one branch: serve decodes itself when a grammar or logprobs need the logits.
            result = (decoder or self.engine).generate(rest, params, on_token)
            if decoder is not None:
                run.decoding = decoder.report.waste()
                run.unevaluated = 1 if run.tokens else 0
        ms = (time.monotonic() - started) * 1000.0
        after = self.engine.stats()
        self.metrics.engine_stats(after)
        run.stats = _stats_delta(before, after)
        return run, result, ms

    def _prefill(self, prompt: "_Prompt", run: _Run, sink: ReplySink) -> list[int]:
        """Restore and evaluate all but the tail of the prompt; returns the tail for generate."""
        log, chunk, cache = self.options.log, self.options.prefill_chunk, self.options.prefix_cache

        def progress(done: int, total: int) -> None:
            if total <= chunk:
                return  # one chunk is over before anyone could be waiting on it
            sink.progress(done, total)
            if log is not None:
                log(f"{self._request_id} prefill {done}/{total}")

        def run_prefill(tokens: list[int], upto: int) -> None:
            run.cached_tokens = prefill(self.engine, tokens, upto, cache=cache,
                                        snapshot_at=prompt.snapshot_at, chunk=chunk,
                                        progress=progress, cancelled=sink.gone,
                                        min_snapshot=self.options.snapshot_min_tokens)
            if cache is not None:
                self.metrics.prefix_lookup(run.cached_tokens > 0)

        try:
            if not prompt.image_paths:
                run_prefill(prompt.ids, len(prompt.ids) - 1)
                return prompt.ids[-1:]
            # An engine may consume its whole image queue on the next eval (the ABI
            # allows it), so the text before the first image is prefilled with the
            # queue empty, and the images are queued again right before generate.
            # When there is nothing to restore or to chunk, one generate does it all.
            upto = prompt.image_start
            if upto <= chunk and (cache is None or cache.lookup(prompt.text_ids, limit=upto) is None):
                return prompt.ids
            self.engine.image_clear()
            run_prefill(prompt.text_ids, upto)
            for path in prompt.image_paths:
                self.engine.image_add(path)
            return self.engine.image_expand(prompt.text_ids[upto:])
        except BaseException:
            self.engine.reset()  # a half-evaluated prompt must not survive into the next request
            raise

    @staticmethod
    def _finish_reason(run: _Run, result: GenResult, ended: bool, has_tool_calls: bool) -> str:
        natural = ended or run.last_token in run.stop_ids or not (
            result.context_full or run.n_tokens >= run.max_tokens or result.cancelled)
        if not natural:
            return "length"
        return "tool_calls" if has_tool_calls else "stop"

    def _usage(self, prompt_tokens: int, run: _Run, result: GenResult, ms: float) -> Usage:
        decode_s = run.last_token_at - run.first_token_at
        tps = (run.n_tokens - 1) / decode_s if run.n_tokens > 1 and decode_s > 0 else 0.0
        self.metrics.reply(prompt_tokens, run.cached_tokens, run.n_tokens,
                           run.first_token_at - run.started_at if run.n_tokens else None,
                           tps if tps else None)
        s = run.stats
        looked_up = s.experts_hit + s.experts_missed
        return Usage(prompt_tokens, run.n_tokens, cached_tokens=run.cached_tokens, waste={
            "prompt_tokens": prompt_tokens, "completion_tokens": run.n_tokens,
            "cached_tokens": run.cached_tokens,
            "experts_hit": s.experts_hit, "experts_missed": s.experts_missed,
            "expert_hit_rate": s.experts_hit / looked_up if looked_up else 0.0,
            "bytes_read": s.bytes_read, "direct_io": s.direct_io, "ms": round(ms, 3),
            "tokens_per_second": round(tps, 3), "context_full": result.context_full,
            **run.decoding})


def _stats_delta(before: Stats, after: Stats) -> Stats:
    return Stats(tokens_generated=after.tokens_generated - before.tokens_generated,
                 experts_hit=after.experts_hit - before.experts_hit,
                 experts_missed=after.experts_missed - before.experts_missed,
                 bytes_read=after.bytes_read - before.bytes_read,
                 sec_total=after.sec_total - before.sec_total,
                 sec_io=after.sec_io - before.sec_io, direct_io=after.direct_io)


def _trail(sink: Any, shape: Callable[[list], dict]) -> Optional[dict]:
    """The reply's logprobs in `shape`, when the sink is a LogprobTrail (they were asked for)."""
    return shape(sink.entries) if isinstance(sink, LogprobTrail) else None
