"""Runs one request on the engine, with no HTTP in sight: the stages, called once each in order.

Chat: check and build the prompt (serve/service/prompt.py) before waiting, so
that a request that will be refused is refused at once however busy the engine
is -> wait in line for the engine -> encode its images -> run it
(serve/service/generation.py), the reply read by the chat format's parser
(serve/service/reply_reader.py) -> remember the reply and settle the next
turn's state in idle time (serve/service/settle.py). Completions skip the chat
format. Every request starts from an empty conversation and holds the engine
from its images' encoding to the last token, so requests cannot see or disturb
each other's state or image queue. A request whose client leaves mid-prefill
keeps the engine only as idle-time work: its prefill goes on for the client's
retry, and yields at its next chunk to any request that waits.

Threads: the caller (a job's thread, serve/service/jobs.py) checks, builds the
prompt and waits in line; once the line gives it the engine, the part that
calls the engine (from the images' encoding to settling's start) is handed to
the engine's one worker (serve/engine/worker.py, `_on_engine`) and the caller
waits for it. Nothing else here calls the engine once the Service is built.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

from serve.core.reply import Delta, Usage
from serve.core.ids import now

from serve.formats import grammar
from serve.core.activity import Activity, ClassActivity
from serve.core.work_classes import BACKGROUND, INTERACTIVE
from serve.core.work import Classifier
from serve.core.request import ChatRequest, CompletionRequest
from serve.formats.base import ChatFormat
from serve.engine.api import EngineApi, ImageProbe
from serve.engine.queue import EngineQueue, LostTurn, shutting_down, STARVE_AFTER_SECONDS
from serve.engine.worker import EngineWorker
from serve.service.detach import DEFAULT_KEEP_SECONDS, DetachRule, StopCheck
from serve.service.generation import Generation
from serve.service.image_positions import Grid, ImagePositions
from serve.service.images import StagedImages
from serve.service.logprobs import chat_logprobs, completion_logprobs
from serve.service.metrics import Metrics
from serve.service.model_card import context_fields
from serve.service.preempt import Preemption
from serve.service.prefill import DEFAULT_CHUNK, start_empty
from serve.snapshots import tiers
from serve.snapshots.cache import PrefixCache
from serve.snapshots.lookup import Lookup
from serve.snapshots.scope import Scope
from serve.snapshots.shared_dir import SharedDir
from serve.service.prompt import check_fits, Prompt, PromptBuilder
from serve.service.replies import ChatReply, CompletionReply
from serve.service.journal import Accepted, Fetching, Journal, Listener
from serve.snapshots.reply_memory import ReplyMemory
from serve.service.reasoning_budget import closing_ids, ReasoningBudget
from serve.service.reply_reader import ChatReader, TextReader
from serve.service.response_store import ResponseStore
from serve.service.settle import Settler
from serve.snapshots.policy import SnapshotPolicy
from serve.tokenizer.api import Tokenizer, at_once
from serve.tokenizer.tokenizer_choice import engine_bos
from serve.tokenizer.engine_side import EngineTokenizer

T = TypeVar("T")


@dataclass
class ServiceOptions:
    model_id: str
    max_tokens: int = 4096
    thinking: bool = True          # the default when a request does not say
    reasoning_budget: Optional[int] = None   # think-channel tokens when a request does not say
    vision: bool = False
    allow_local_images: Optional[str] = None    # a directory clients may name image files in
    prefix_cache: Optional[PrefixCache] = None   # None: prefill every request from scratch
    prefill_chunk: int = DEFAULT_CHUNK
    snapshot_policy: Optional[SnapshotPolicy] = None  # None: by measured cost, no overrides
    finish_abandoned: bool = True  # a prefill whose client left goes on, for its retry
    attach: bool = True            # an identical request may come back for a job (jobs.py)
    keep_detached: float = DEFAULT_KEEP_SECONDS   # and its work goes on this long meanwhile
    log: Optional[Callable[[str], None]] = None  # prefill progress of long prompts
    reply_memory: Optional[ReplyMemory] = None   # None: history is always re-tokenized
    keep_reasoning: bool = False   # render remembered reasoning into replies a client returns without it
    eval_logits: bool = True       # False: the engine's waste_eval gives no logits to decode with
    max_queue: int = 32            # requests that may wait for the engine; more get a 503
    responses: Optional[ResponseStore] = None   # None: a store of this process's own
    context_beyond: str = ""       # a too-long prompt's word on a larger context (app/context.py)
    work_classes: bool = True      # False: one line in arrival order, no chore preempted
    background_max_tokens: int = 256   # a chore's max_tokens when it sets none
    chore_max_wait: float = STARVE_AFTER_SECONDS   # a chore waiting this long runs one step
    background_models: tuple[str, ...] = ()    # model names that mean "a chore"
    background_match: tuple[str, ...] = ()     # patterns on the prompt that mean "a chore"
    tokenizer: Optional[Tokenizer] = None   # serve's own, equal to the engine's (tokenizer/tokenizer_choice.py);
                                            # None: the engine's, between its calls
    bos: Optional[Sequence[int]] = None     # add_bos's ids (choice.py); None: asked of the engine
    image_grid: Optional[Grid] = None       # the engine's rule for images' positions
                                            # (image_positions.read_grid); None: the engine counts
    shared_namespace: str = ""              # every request finds its snapshots too (--warm's)
    max_waiting_per_person: Optional[int] = None   # more waiting get a 429; None: no bound


class Service:
    def __init__(self, engine: EngineApi, library: ImageProbe, chat_format: ChatFormat,
                 options: ServiceOptions):
        self.engine = engine
        self.chat_format = chat_format
        self.options = options
        self.created = now()
        self.warming: Optional[dict] = None   # while --warm runs: what /health reports
        # For the Responses API's previous_response_id.
        self.responses = options.responses if options.responses is not None else ResponseStore()
        # The one thread that calls the engine once this is built (serve/engine/worker.py).
        self.worker = EngineWorker(f"engine-{options.model_id}", shutting_down)
        self.queue = EngineQueue(options.max_queue, classes=options.work_classes,
                                 starve_after=options.chore_max_wait,
                                 max_per_owner=options.max_waiting_per_person)
        self.classifier = Classifier(options.background_models, options.background_match,
                                     bound=options.background_max_tokens)
        self._stopping = threading.Event()
        self.policy = options.snapshot_policy or SnapshotPolicy(log=options.log)
        self.metrics = Metrics(engine.stats(), self.activity, options.prefix_cache, self.policy,
                               lambda: engine.evaluated, shared=self._shared_dirs(),
                               turns=self.queue.snapshot_owner_counts)
        # Serve's figure of images' positions: probed on the engine while it is still idle.
        self.positions = ImagePositions(options.image_grid if options.vision else None, options.log)
        self.positions.probe(engine)
        # Serve's own tokenizer, called by any thread; or the engine's, called as an errand
        # between engine calls by a request not yet holding the engine.
        tokenizer = options.tokenizer or EngineTokenizer(engine)
        tokenizing = at_once if options.tokenizer else self._errand
        bos = options.bos if options.bos is not None else engine_bos(engine)
        self.prompts = PromptBuilder(engine, library, chat_format, tokenizer=tokenizer, bos=bos,
                                     tokenizing=tokenizing, vision=options.vision,
                                     reply_memory=options.reply_memory,
                                     keep_reasoning=options.keep_reasoning,
                                     snapshots=options.prefix_cache is not None,
                                     default_thinking=options.thinking,
                                     context_beyond=options.context_beyond,
                                     positions=self.positions,
                                     shared_namespace=options.shared_namespace,
                                     reasoning_budget=options.reasoning_budget)
        self.reasoning_end = closing_ids(chat_format, EngineTokenizer(engine))   # closes a think channel
        self.generation = Generation(engine, self.metrics, max_tokens=options.max_tokens,
                                     prefix_cache=options.prefix_cache, policy=self.policy,
                                     prefill_chunk=options.prefill_chunk,
                                     eval_logits=options.eval_logits, log=options.log,
                                     context_beyond=options.context_beyond,
                                     between_tokens=self.queue.run_errands)
        self.settler = Settler(engine, tokenizer, self.queue, options.prefix_cache, self.policy,
                               options.reply_memory, self.prompts.reply, self.worker.call)

    def _shared_dirs(self) -> dict[str, SharedDir]:
        """The shared tier's directories (--shared-cache), for /metrics."""
        cache, memory = self.options.prefix_cache, self.options.reply_memory
        found = {"snapshots": cache.shared.files if cache is not None and cache.shared else None,
                 "replies": memory.shared if memory is not None else None,
                 "responses": self.responses.shared}
        return {what: d for what, d in found.items() if d is not None}

    def activity(self) -> Activity:
        # Deferred work first: a settle job is counted until its thread has let the engine go,
        # a snapshot until it is published for the team.
        cache = self.options.prefix_cache
        deferred = self.settler.deferred or self.queue.idle_work \
            or bool(cache is not None and cache.shared is not None and cache.shared.publisher.pending)
        queue = self.queue
        waiting, counts = queue.waiting(), queue.snapshot_counts()
        classes = {work: ClassActivity(waiting[work][0], waiting[work][1], c.waits,
                                       c.wait_seconds, c.engine_seconds)
                   for work, c in counts.items()}
        return Activity(queue.busy, len(queue), deferred, self.warming is not None,
                        queue.holder(), classes, queue.preemptions)

    def model(self) -> dict:
        info = self.engine.info
        return {"id": self.options.model_id, "object": "model", "created": self.created,
                "owned_by": "serve", **context_fields(info.ctx_max),
                "waste": {"arch": info.arch, "n_layers": info.n_layers, "n_experts": info.n_experts,
                          "top_k": info.top_k, "hidden": info.hidden, "ctx": info.ctx_max,
                          "params_total": info.params_total, "params_active": info.params_active,
                          "quant": info.quant_summary,
                          "chat_format": self.chat_format.name or "none",
                          "vision": self.options.vision}}

    # -- requests -------------------------------------------------------------

    def chat(self, req: ChatRequest, sink: Listener | Journal) -> ChatReply:
        check = self.prompts.check(req)
        # Built before the engine is held: a schema the grammar cannot enforce is a 400
        # before any stream opens, and a large one compiles while others use the engine.
        constraint = self._constraint(req, check.thinking)
        self.generation.check_decoding(req.logprobs, req.sampling)
        self.prompts.pieces(list(req.sampling.logit_bias), "logit_bias", indexed=False)
        with StagedImages(self.options.allow_local_images) as staged:
            early = self.prompts.of_chat(req, check, staged)
            run = self._journal(sink)
            stops = self._stop_check(run, req.request_id)
            run.post(Accepted(check.thinking))
            run.reasoning = ReasoningBudget(self.prompts.budget(req), self.reasoning_end) if check.thinking else None

            def held(lookup: Optional[Lookup]) -> ChatReply:
                prompt = self.prompts.with_images(early)
                reader = ChatReader(self.chat_format.new_parser(check.thinking), req.sampling.stop,
                                    self.chat_format.stop_tokens,
                                    None if req.parallel_tool_calls else 1, run.reasoning)
                outcome = self.generation.produce(
                    prompt, req.sampling, run, reader, stop_tokens=self.chat_format.stop_tokens,
                    logprobs=req.logprobs, constraint=constraint, label=req.request_id,
                    stop=stops.prefill_stop, stop_decoding=stops.decode_stop,
                    pause=self._pause(run, req.work, req.request_id, prompt.scope),
                    max_tokens=self._max_tokens(req.work), lookup=lookup)
                message = reader.message()
                outcome.usage.waste["reasoning"] = check.reasoning
                self._account(outcome.usage, req, run)
                if not outcome.client_left:
                    self.settler.after_reply(prompt, outcome, message)
                return ChatReply(message, outcome.finish_reason, outcome.usage,
                                 outcome.client_left,
                                 None if outcome.logprobs is None else chat_logprobs(outcome.logprobs),
                                 reader.stop_sequence)
            return self._on_engine(run, held, req.work, early, req.owner)

    def count_chat(self, req: ChatRequest, client_left: Callable[[], bool]) -> int:
        """The positions a chat request's prompt would take, without generating anything:
        without the engine, unless serve does not figure its images' positions (silently)."""
        check = self.prompts.check(req)
        with StagedImages(self.options.allow_local_images) as staged:
            prompt = self.prompts.of_chat(req, check, staged)
            if prompt.expanded_length is not None:
                return prompt.expanded_length
            run = self.new_journal(client_left)   # its events are never taken: the count is the answer

            def held(_: Optional[Lookup]) -> int:
                expanded = self.prompts.with_images(prompt)
                self.engine.image_clear()
                return len(expanded.ids)
            return self._on_engine(run, held, owner=req.owner)

    def complete(self, req: CompletionRequest, sink: Listener | Journal) -> CompletionReply:
        check_fits(self.engine, len(req.prompt), "prompt", self.options.context_beyond)
        prompt = Prompt(self.prompts.text(req.prompt), scope=self.prompts.scope(req))
        self.generation.check_decoding(req.logprobs, req.sampling)
        self.prompts.pieces(list(req.sampling.logit_bias), "logit_bias", indexed=False)
        run = self._journal(sink)
        stops = self._stop_check(run, req.request_id)

        def held(lookup: Optional[Lookup]) -> CompletionReply:
            reader = TextReader(req.sampling.stop, self.engine.specials.values())
            outcome = self.generation.produce(prompt, req.sampling, run, reader,
                                          logprobs=req.logprobs, label=req.request_id,
                                          stop=stops.prefill_stop,
                                          stop_decoding=stops.decode_stop,
                                          pause=self._pause(run, req.work, req.request_id,
                                                            prompt.scope),
                                          max_tokens=self._max_tokens(req.work), lookup=lookup)
            self._account(outcome.usage, req, run)
            return CompletionReply(reader.text, outcome.finish_reason, outcome.usage,
                                   outcome.client_left, None if outcome.logprobs is None
                                   else completion_logprobs(outcome.logprobs))
        return self._on_engine(run, held, req.work, prompt, req.owner)

    def _constraint(self, req: ChatRequest, thinking: bool) -> Optional[str]:
        """The compiled grammar the reply must follow, when the request asks for structure."""
        fmt = self.chat_format
        off = self.generation.decoding_off(grammar.missing())
        if not grammar.check_available(req, fmt.prompts_response_format, fmt.prompts_tools, off):
            return None
        return grammar.compile_grammar(fmt.grammar(req, thinking))

    def _look_up(self, prompt: Prompt, run: Journal) -> Optional[Lookup]:
        """The prompt's snapshot, found (and fetched from the shared tier) while the request
        waits, not on the engine: the engine only brings it up to date (serve/snapshots/lookup.py).
        A client that leaves stops a fetch between two chunks."""
        cache = self.options.prefix_cache
        if cache is None or self._stopping.is_set():
            return None
        tokens, limit = prompt.restorable
        return tiers.find(cache, self.policy, tokens, limit, stop=run.should_stop,
                          fetching=lambda positions: run.post(Fetching(positions)),
                          scope=prompt.scope)

    @property
    def stopping(self) -> bool:
        """stop() was called: work that only spares later requests time ends."""
        return self._stopping.is_set()

    def new_journal(self, client_left: Callable[[], bool] = lambda: False) -> Journal:
        """A Journal whose events readers follow (Journal.read): a job's (serve/service/jobs.py), which
        knows its readers, or a caller's that asks `client_left()`. Cut at shutdown."""
        return Journal(self._stopping, client_left)

    def _journal(self, sink: Listener | Journal) -> Journal:
        """The caller's Journal, or one that hands a Listener each event as it is made."""
        return sink if isinstance(sink, Journal) else Journal(self._stopping, sink.client_left, sink)

    def _on_engine(self, run: Journal, body: Callable[[Optional[Lookup]], T], work: str = INTERACTIVE,
                   prompt: Optional[Prompt] = None, owner: str = "") -> T:
        """Wait in line for the engine on this thread, then run `body` on the engine's worker,
        the engine empty, and return what it returns; a run cut by shutdown ends in its 503.
        `body` gets the prompt's snapshot, found while the request waits in line, its place
        kept (serve/snapshots/lookup.py): None without a prompt or a prefix cache."""
        found: Optional[Lookup] = None

        def look_up() -> None:
            nonlocal found
            if prompt is not None:
                found = self._look_up(prompt, run)

        def held() -> T:
            self.settler.drop()
            start_empty(self.engine)
            try:
                return body(found)
            except LostTurn as lost:   # a chore that stepped aside and could not come back
                raise lost.cause from None

        with self.queue.turn(run, work, meanwhile=look_up, owner=owner) as run.turn:
            result = self.worker.call(held)
        if run.cut:
            raise shutting_down()
        return result

    def _errand(self, work: Callable[[], T]) -> T:
        """The engine's tokenizer for a thread that does not hold the engine: one errand,
        run by the worker at its next moment between engine calls."""
        return self.queue.errand(lambda: self.worker.call(work))

    # -- classes of work (docs/chores.md) -------------------------------------------

    def _pause(self, run: Journal, work: str, label: str, scope: Scope) -> Optional[Preemption]:
        """A chore's way to step aside for a person (it needs the prefix cache to save to)."""
        cache = self.options.prefix_cache
        if work != BACKGROUND or not self.options.work_classes or cache is None:
            return None
        assert run.turn is not None   # asked inside the turn
        return Preemption(self.engine, run.turn, run, self.worker.away, cache, self.policy,
                          self.options.prefill_chunk, scope, self.options.log, label)

    def _max_tokens(self, work: str) -> Optional[int]:
        """The default max_tokens of a request of this class (None: the server's)."""
        return self.options.background_max_tokens if work == BACKGROUND else None

    def _account(self, usage: Usage, req: ChatRequest | CompletionRequest, run: Journal) -> None:
        """The reply's class, how long it waited while chores held the engine (the chat page
        shows it: serve/static/chat.html), and its tokens, for its sender."""
        assert run.turn is not None   # asked inside the turn
        usage.waste.update(work=req.work, behind_chores_ms=round(run.turn.behind_chores * 1000, 3))
        self.metrics.person_reply(req.owner, usage)

    def _stop_check(self, run: Journal, label: str) -> StopCheck:
        """What the run's work may do once nobody follows it (serve/service/detach.py)."""
        options = self.options
        rule = DetachRule(options.attach, options.keep_detached,
                          options.finish_abandoned and options.prefix_cache is not None)
        return StopCheck(run, rule, self.queue.run_errands, options.log, label)

    # -- idle time ------------------------------------------------------------

    def settle(self) -> None:
        """Build the state a reply left for idle time (tests call it to wait for it)."""
        self.settler.settle()

    # -- shutdown -------------------------------------------------------------

    def stop(self) -> None:
        """Refuse new and queued work; what runs stops at its next token or prefill chunk
        (idle-time work too: the closed line tells it to yield)."""
        self._stopping.set()
        self.queue.close()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """After stop(): True once nothing uses the engine (it may then be closed)."""
        return self.queue.wait_idle(timeout)

    def close(self) -> None:
        """No more idle-time work: returns once none is running, and the worker has ended,
        before the engine closes (its opener's again, to save and close)."""
        self.settler.close()
        self.worker.stop()
