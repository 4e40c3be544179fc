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
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from . import api
from .api import ApiError, ChatRequest, CompletionRequest, Sampling, Usage, invalid
from .chatfmt import ChatFormatError, NoChatFormat
from .checkpoints import preamble_ends
from .engine import GenParams, GenResult, Stats, TokenInfo, UnencodableText, WasteError
from .images import StagedImages, image_parts, measure
from .prefill import DEFAULT_CHUNK, PrefillCancelled, prefill
from .prefix_cache import PrefixCache
from .stops import StopFilter
from .xtml import PromptError, image_prompt


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


@dataclass
class ServiceOptions:
    model_id: str
    max_tokens: int = 4096
    thinking: bool = True          # the default when a request does not say
    vision: bool = False
    allow_local_images: bool = False
    prefix_cache: Optional[PrefixCache] = None   # None: prefill every request from scratch
    prefill_chunk: int = DEFAULT_CHUNK
    snapshot_min_tokens: int = 0   # a shorter prompt that restored nothing is not snapshotted
    log: Optional[Callable[[str], None]] = None  # prefill progress of long prompts


@dataclass
class ChatReply:
    message: dict
    finish_reason: str
    usage: Usage
    client_gone: bool


@dataclass
class CompletionReply:
    text: str
    finish_reason: str
    usage: Usage
    client_gone: bool


@dataclass
class _Prompt:
    """A tokenized prompt and what prefilling it needs to know."""
    ids: list[int]                        # what the engine will hold, images expanded
    snapshot_at: Sequence[int] = ()       # positions worth a prefix snapshot
    text_ids: list[int] = field(default_factory=list)  # with images: the ids before expansion
    image_start: int = 0                  # with images: where the first placeholder is in text_ids
    image_paths: Sequence[str] = ()       # with images: the files, to queue again after prefill


@dataclass
class _Run:
    """What the token callback learns while generation runs."""
    stop_ids: frozenset[int]
    max_tokens: int
    client_gone: bool = False
    last_token: int = -1
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    n_tokens: int = 0
    cached_tokens: int = 0          # prompt positions restored from a snapshot
    stats: Optional[Stats] = None   # engine counters for this request only


class Service:
    def __init__(self, engine: Any, library: Any, chat_format: Any, options: ServiceOptions):
        self.engine = engine
        self.library = library
        self.chat_format = chat_format
        self.options = options
        self.created = api.now()
        self.warming: Optional[dict] = None   # while --warm runs: what /health reports

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
        with self.engine.lock:
            self._start_empty()
            with StagedImages(self.options.allow_local_images) as staged:
                paths = [staged.stage(url, param) for param, url in images]
                prompts = [image_prompt(*measure(self.library.image_dimensions, path, param))
                           for path, (param, _) in zip(paths, images)]
                # The conversation and the generation prompt are tokenized apart (as
                # segments always are) so that the end of the conversation, which the
                # next turn's prompt will repeat, is a known position worth a snapshot.
                segments = self._render(req, thinking, prompts)
                try:
                    history = self.engine.tokenize_segments(segments)
                except UnencodableText as e:
                    raise invalid("messages", f"a message cannot be tokenized: {e}") from None
                ids = history + self.engine.tokenize_segments(
                    self.chat_format.generation_prompt(thinking))
                for path, (param, _) in zip(paths, images):
                    try:
                        self.engine.image_add(path)  # validates the image, and counts its positions
                    except WasteError as e:
                        self.engine.image_clear()
                        raise invalid(param, f"image could not be encoded: {e}") from None
                prompt = _Prompt(ids, snapshot_at=[*self._preamble_ends(req, thinking, segments),
                                                   len(history)])
                if paths:
                    prompt = _Prompt(self.engine.image_expand(ids), snapshot_at=prompt.snapshot_at,
                                     text_ids=ids, image_start=ids.index(self.chat_format.media_pad),
                                     image_paths=paths)
                return self._generate_chat(req, prompt, thinking, sink)

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
        with self.engine.lock:
            self._start_empty()
            segments = self._render(req, thinking, [])
            history = self.engine.tokenize_segments(segments)
            ids = history + self.engine.tokenize_segments(self.chat_format.generation_prompt(thinking))
            if len(ids) > self.engine.info.ctx_max:
                raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds "
                                    f"{self.engine.info.ctx_max}", param="messages",
                               code="context_length_exceeded")
            try:
                restored = prefill(self.engine, ids, len(history), cache=cache,
                                   snapshot_at=[*self._preamble_ends(req, thinking, segments),
                                                len(history)],
                                   chunk=self.options.prefill_chunk, progress=progress,
                                   cancelled=cancelled)
            finally:
                self.engine.reset()
        return len(history), restored

    def _preamble_ends(self, req: ChatRequest, thinking: bool, segments: list) -> list[int]:
        """Token positions where the tool declarations and the leading system messages end."""
        if self.options.prefix_cache is None:
            return []

        def render(messages: list) -> list:
            return self.chat_format.render(
                messages, tools=req.tools, thinking=thinking, add_generation_prompt=False,
                thinking_effort=req.thinking_effort if thinking else None)

        return [len(self.engine.tokenize_segments(segments[:n]))
                for n in preamble_ends(render, req.messages, segments)]

    def _check_images(self, images: list[tuple[str, str]]) -> None:
        if not images:
            return
        param = images[0][0]
        if not self.options.vision:
            raise invalid(param, "images need the vision tower: start the server with --vision")
        if not self.chat_format.supports_images:
            raise invalid(param, f"the {self.chat_format.name} chat format cannot carry images")

    def _render(self, req: ChatRequest, thinking: bool, prompts: list[str]) -> list:
        try:
            return self.chat_format.render(
                req.messages, tools=req.tools, tool_choice=req.tool_choice,
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

        def on_piece(token: int, piece: bytes) -> bool:
            forward(parser.feed_token(token, piece))
            return stops.hit or parser.ended

        run, result, ms = self._run(prompt, req.sampling, self.chat_format.stop_tokens, sink, on_piece)
        if not stops.hit and not run.client_gone:
            forward(parser.finish())
            tail = stops.flush()
            if tail:
                content.append(tail)
                sink.emit({"content": tail})
        tool_calls = parser.reply.tool_calls
        finish = self._finish_reason(run, result, stops.hit or parser.ended, bool(tool_calls))
        message = api.chat_message("".join(content), "".join(reasoning), tool_calls)
        return ChatReply(message, finish, self._usage(len(prompt.ids), run, result, ms),
                         run.client_gone)

    # -- completions ----------------------------------------------------------

    def complete(self, req: CompletionRequest, sink: ReplySink) -> CompletionReply:
        with self.engine.lock:
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

        run, result, ms = self._run(_Prompt(ids), req.sampling, (), sink, on_piece)
        if not stops.hit and not run.client_gone:
            show(stops.feed(decoder.decode(b"", final=True)))
            show(stops.flush())
        finish = self._finish_reason(run, result, stops.hit, False)
        return CompletionReply("".join(text), finish, self._usage(len(ids), run, result, ms),
                               run.client_gone)

    # -- shared ---------------------------------------------------------------

    def _start_empty(self) -> None:
        """An empty conversation and image queue: nothing an earlier request left,
        failed or not, may reach this one (the ABI does not say reset drops the queue)."""
        self.engine.reset()
        self.engine.image_clear()

    def _run(self, prompt: "_Prompt", sampling: Sampling, stop_tokens, sink: ReplySink,
             on_piece) -> tuple[_Run, GenResult, float]:
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
            run.last_token = info.token
            run.n_tokens += 1
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
        started = time.monotonic()
        try:
            rest = self._prefill(prompt, run, sink)
        except PrefillCancelled:
            run.client_gone = True
            result = GenResult(n_tokens=0, cancelled=True, context_full=False, detail=None)
        else:
            result = self.engine.generate(rest, params, on_token)
        ms = (time.monotonic() - started) * 1000.0
        run.stats = _stats_delta(before, self.engine.stats())
        return run, result, ms

    def _prefill(self, prompt: "_Prompt", run: _Run, sink: ReplySink) -> list[int]:
        """Restore and evaluate all but the tail of the prompt; returns the tail for generate."""
        log, chunk, cache = self.options.log, self.options.prefill_chunk, self.options.prefix_cache

        def progress(done: int, total: int) -> None:
            if total <= chunk:
                return  # one chunk is over before anyone could be waiting on it
            sink.progress(done, total)
            if log is not None:
                log(f"prefill {done}/{total}")

        def run_prefill(tokens: list[int], upto: int) -> None:
            run.cached_tokens = prefill(self.engine, tokens, upto, cache=cache,
                                        snapshot_at=prompt.snapshot_at, chunk=chunk,
                                        progress=progress, cancelled=sink.gone,
                                        min_snapshot=self.options.snapshot_min_tokens)

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

    @staticmethod
    def _usage(prompt_tokens: int, run: _Run, result: GenResult, ms: float) -> Usage:
        decode_s = run.last_token_at - run.first_token_at
        tps = (run.n_tokens - 1) / decode_s if run.n_tokens > 1 and decode_s > 0 else 0.0
        s = run.stats
        looked_up = s.experts_hit + s.experts_missed
        return Usage(prompt_tokens, run.n_tokens, cached_tokens=run.cached_tokens, waste={
            "prompt_tokens": prompt_tokens, "completion_tokens": run.n_tokens,
            "cached_tokens": run.cached_tokens,
            "experts_hit": s.experts_hit, "experts_missed": s.experts_missed,
            "expert_hit_rate": s.experts_hit / looked_up if looked_up else 0.0,
            "bytes_read": s.bytes_read, "direct_io": s.direct_io, "ms": round(ms, 3),
            "tokens_per_second": round(tps, 3), "context_full": result.context_full})


def _stats_delta(before: Stats, after: Stats) -> Stats:
    return Stats(tokens_generated=after.tokens_generated - before.tokens_generated,
                 experts_hit=after.experts_hit - before.experts_hit,
                 experts_missed=after.experts_missed - before.experts_missed,
                 bytes_read=after.bytes_read - before.bytes_read,
                 sec_total=after.sec_total - before.sec_total,
                 sec_io=after.sec_io - before.sec_io, direct_io=after.direct_io)
