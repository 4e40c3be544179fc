"""One run of the engine for a request: prefill the prompt, generate, and account for it.

The engine state must be empty on entry. Prefill restores the longest snapshot
and evaluates the rest in chunks the request's observer can watch and a vanished client can
interrupt; generation goes through waste_generate, or through serve's own
decoder (serve/engine/decode.py) when a grammar, logprobs or an adjustment of the
logits (logit_bias, the penalties) need them.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from serve.engine import decode

from serve.formats import grammar
from serve.core.errors import invalid
from serve.core.reply import Usage
from serve.core.request import Sampling
from serve.engine.types import GenParams, GenResult, Stats, TokenInfo
from serve.engine.api import EngineApi
from serve.engine.queue import LostTurn
from serve.service.logprobs import LogprobLedger
from serve.service.journal import Journal, Prefilling, Progress, Started
from serve.service.metrics import Metrics
from serve.service.prefill import DEFAULT_CHUNK, Pause, Prefill, PrefillCancelled
from serve.snapshots.cache import PrefixCache
from serve.snapshots.lookup import Lookup
from serve.service.prompt import Prompt, check_room
from serve.service.reply_reader import ReplyReader
from serve.service import steer
from serve.snapshots.policy import SnapshotPolicy


@dataclass
class Outcome:
    """How a run ended, and what it generated."""
    finish_reason: str
    usage: Usage
    client_left: bool
    tokens: list[int]                      # every generated id
    unevaluated: int                       # of those, how many the state lacks (serve's decoder: the last)
    result: GenResult
    logprobs: Optional[list[dict]] = None  # the answer's logprob entries, when asked for
    saved: int = 0                         # prompt positions the longest snapshot of it holds
    context_full: bool = False             # the context's end cut the reply


@dataclass
class _Clock:
    """What the token callback learns while generation runs."""
    started_at: float = 0.0         # when prefill began, after any wait for the engine
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    tokens: list[int] = field(default_factory=list)
    client_left: bool = False
    cached_tokens: int = 0          # prompt positions restored from a snapshot
    saved: int = 0                  # prompt positions the longest snapshot of it holds
    asked_at: float = 0.0           # when the token callback last asked whether to stop


# How often the token callback asks whether to stop (a poll of each reader's socket) and
# runs the queue's errands: at most once a millisecond. A K3 token takes seconds, so each
# one still asks; a 4,000 tokens/s model asks every few tokens, and a client's leaving
# costs it at most a millisecond of tokens, not a syscall on every one (docs/engine.md).
ASK_EVERY_S = 0.001


class Generation:
    def __init__(self, engine: EngineApi, metrics: Metrics, *, max_tokens: int,
                 prefix_cache: Optional[PrefixCache], policy: SnapshotPolicy,
                 prefill_chunk: int = DEFAULT_CHUNK, eval_logits: bool = True,
                 log: Optional[Callable[[str], None]] = None, context_beyond: str = "",
                 between_tokens: Callable[[], None] = lambda: None):
        self.engine = engine
        self.metrics = metrics
        self.max_tokens = max_tokens          # when a request sets none
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.policy = policy                  # where snapshots pay, from measured costs
        self.eval_logits = eval_logits        # False: waste_eval gives no logits to decode with
        self.log = log
        self.context_beyond = context_beyond  # a too-long prompt's word on a larger context
        # Run from the token callback: waste_generate is one engine call for a whole reply,
        # and work that only reads the tokenizer need not wait for its end (docs/engine.md).
        self.between_tokens = between_tokens
        # llguidance's view of the vocabulary, built once per (size, stop tokens)
        self._vocabularies: dict[tuple[int, tuple[int, ...]], grammar.Vocabulary] = {}

    def produce(self, prompt: Prompt, sampling: Sampling, journal: Journal, reader: ReplyReader, *,
            stop_tokens: Sequence[int] = (), logprobs: Optional[int] = None,
            constraint: Optional[str] = None, label: str = "",
            stop: Optional[Callable[[], bool]] = None,
            stop_decoding: Optional[Callable[[], bool]] = None, pause: Optional[Pause] = None,
            max_tokens: Optional[int] = None, lookup: Optional[Lookup] = None) -> Outcome:
        """Prefill, generate until the reader says the reply is done, and account for it.

        `logprobs`: passed by check_decoding already, before the request waited;
        `constraint`: a compiled grammar the reply must follow; `label` names the
        request in log lines; `stop`: asked between prefill chunks whether to stop
        (by default, whether the journal should stop). A prefill that runs to its end for a
        client that left is snapshotted there, and nothing is generated. `stop_decoding`:
        the same question before each generated token (serve/service/detach.py answers
        both). A journal stopped on purpose (Journal.stop) ends as a normal finish. `pause`: a
        chore's, asked before each engine call (a chore decodes in serve, when it can, so
        that it can step aside between two tokens); `max_tokens`: the default when the
        request sets none (else the server's); `lookup`: the prompt's prefix-cache lookup,
        made while the request waited (tiers.find). The journal's `reasoning` says when the think
        channel is closed for the model (serve/service/steer.py)."""
        if prompt.image_paths:
            pause = None   # snapshots never reach past images
        if pause is not None and self.decoding_off(decode.missing()) is None:
            pause_at: Optional[Callable[[Sequence[int]], None]] = _pause_at(pause, prompt.ids)
        else:
            pause_at = None
        decoder = self._decoder(sampling, logprobs, journal, constraint, stop_tokens, pause_at)
        check_room(len(prompt.ids), self.engine.info.ctx_max, "messages", self.context_beyond)
        room = self.engine.info.ctx_max - len(prompt.ids)
        params = GenParams(temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k,
                           seed=secrets.randbits(64) if sampling.seed is None else sampling.seed,
                           max_tokens=min(sampling.max_tokens or max_tokens or self.max_tokens,
                                          room),
                           stop_tokens=tuple(stop_tokens))
        clock = _Clock()
        halt = stop_decoding or journal.should_stop

        def on_token(info: TokenInfo, piece: bytes) -> bool:
            now = time.monotonic()
            clock.first_token_at = clock.first_token_at or now
            clock.last_token_at = now
            clock.tokens.append(info.token)
            if now - clock.asked_at >= ASK_EVERY_S:
                clock.asked_at = now
                if halt():
                    clock.client_left = not journal.stopped
                    return True
                self.between_tokens()
            return reader.feed(info.token, piece, journal.emit)   # the Journal only keeps it

        before = self.engine.stats()
        journal.post(Started())
        clock.started_at = time.monotonic()
        report = decode.Report(constrained=False).waste()
        unevaluated = 0
        try:
            rest = self._prefill(prompt, clock, journal, label, stop or journal.should_stop, halt, pause, lookup)
        except PrefillCancelled:
            clock.client_left = not journal.stopped
            result = GenResult(n_tokens=0, cancelled=True, context_full=False, detail=None)
        else:
            # The one branch: serve decodes itself when the reply needs the logits.
            rebuild = None if prompt.image_paths else (
                lambda generated: self._rebuild([*prompt.ids, *generated]))
            if journal.reasoning is not None:
                journal.reasoning.anytime = decoder is not None or rebuild is not None
            result = steer.generate(self.engine, decoder, rest, params, on_token, reader,
                                    journal.reasoning, rebuild)
            if decoder is not None:
                report = decoder.report.waste()
                unevaluated = 1 if clock.tokens else 0
        ms = (time.monotonic() - clock.started_at) * 1000.0
        after = self.engine.stats()
        self.metrics.engine_stats(after)
        if not reader.stopped and not clock.client_left:
            reader.finish(journal.emit)
        finish = "stop" if journal.stopped else _finish_reason(reader, clock.tokens, params, result)
        # The context's end cut the reply: the engine says so, or max_tokens was lowered to
        # the room left and the reply used all of it.
        full = result.context_full or (finish == "length" and params.max_tokens == room
                                       and len(clock.tokens) >= room)
        usage = self._usage(len(prompt.ids), clock, full, ms, _stats_delta(before, after), report)
        if journal.reasoning is not None:
            journal.reasoning.account(usage)
        return Outcome(finish, usage, clock.client_left, clock.tokens, unevaluated, result,
                       journal.logprobs.entries if journal.logprobs is not None else None, clock.saved, full)

    # -- decoding in serve (structure, logprobs) --------------------------------------

    def decoding_off(self, missing: Optional[str]) -> Optional[str]:
        """Why serve cannot decode by itself, or None."""
        return missing if self.eval_logits else "this engine's waste_eval gives no logits"

    def check_decoding(self, top_logprobs: Optional[int], sampling: Sampling) -> None:
        """Refuse logprobs, and the logits' adjustments, when serve cannot decode by itself
        (the service asks before the request waits for the engine)."""
        off = self.decoding_off(decode.missing())
        if off is None:
            return
        if top_logprobs is not None:
            raise invalid("logprobs", f"logprobs are off here ({off}); to enable: {grammar.ENABLE_HINT}",
                          code="logprobs_unavailable")
        adjusted = sampling.adjusted
        if adjusted is not None:
            raise invalid(adjusted, f"{adjusted} needs serve's own decoder, which is off here "
                                    f"({off}): the engine's sampler cannot apply it; to enable: "
                                    f"{grammar.ENABLE_HINT}", code="decoding_unavailable")

    def _decoder(self, sampling: Sampling, top_logprobs: Optional[int], journal: Journal,
                 constraint: Optional[str], stop_tokens: Sequence[int],
                 pause: Optional[Callable[[Sequence[int]], None]] = None
                 ) -> Optional[decode.Decoder]:
        """Serve's own decoder, its logprobs kept on the journal when they are asked for;
        no decoder (waste_generate) when nothing needs the logits or a pause."""
        if constraint is None and top_logprobs is None and pause is None \
                and sampling.adjusted is None:
            return None
        if top_logprobs is not None:
            journal.logprobs = LogprobLedger(frozenset(self.engine.specials.values()))
        matcher = None if constraint is None else self._matcher(constraint, tuple(stop_tokens))
        return decode.Decoder(self.engine, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, grammar=matcher, top_logprobs=top_logprobs,
                              listener=journal.logprobs, pause=pause,
                              adjust=decode.Adjustment(sampling.logit_bias,
                                                       sampling.frequency_penalty,
                                                       sampling.presence_penalty))

    def _matcher(self, compiled: str, eos: tuple[int, ...]) -> Callable[[int], decode.Grammar]:
        """A matcher factory (vocabulary size -> matcher) for a compiled grammar."""
        def matcher(n_vocab: int) -> decode.Grammar:
            key = (n_vocab, eos)
            if key not in self._vocabularies:
                self._vocabularies[key] = grammar.Vocabulary(self.engine, n_vocab, eos)
            return self._vocabularies[key].matcher(compiled)
        return matcher

    # -- prefill --------------------------------------------------------------------------

    def _prefill(self, prompt: Prompt, clock: _Clock, journal: Journal, label: str,
                 stop: Callable[[], bool], halt: Callable[[], bool], pause: Optional[Pause],
                 lookup: Optional[Lookup]) -> list[int]:
        """Restore and evaluate all but the tail of the prompt; returns the tail for generate.
        `halt`: asked once it is evaluated, would generating stop at once?"""
        log, chunk, cache = self.log, self.prefill_chunk, self.prefix_cache

        def progress(done: int, total: int) -> None:
            if total <= chunk:
                return  # one chunk is over before anyone could be waiting on it
            journal.post(Progress(done, total, self.policy.costs.token_seconds))   # as of this chunk
            if log is not None:
                log(f"{label} prefill {done}/{total}")

        def run_prefill(tokens: list[int], upto: int) -> None:
            prefill = Prefill(self.engine, tokens, cache=cache, policy=self.policy, chunk=chunk,
                              progress=progress, stop=stop, pause=pause, scope=prompt.scope)
            clock.cached_tokens = prefill.restore(upto, lookup)
            journal.post(Prefilling(len(prompt.ids), clock.cached_tokens,
                                    self.policy.costs.token_seconds))
            if cache is not None:
                self.metrics.prefix_lookup(clock.cached_tokens > 0)
            clock.saved = prefill.evaluate(upto, prompt.snapshot_at).saved
            if halt():
                # Evaluated for a client that left (or to the end, for its retry): kept for
                # whoever sends the same prompt next, and nothing is generated.
                prefill.snapshot("stopped")
                raise PrefillCancelled()

        # The prefix the lookup made in line was of (Service._look_up): the two must agree.
        ids, upto = prompt.restorable
        try:
            if not prompt.image_paths:
                run_prefill(ids, upto)
                return prompt.ids[-1:]
            # An engine may consume its whole image queue on the next eval (the ABI
            # allows it), so the text before the first image is prefilled with the
            # queue empty, and the images are queued again right before generate.
            # When there is nothing to restore or to chunk, one generate does it all.
            if upto <= chunk and (lookup is None or lookup.found is None):
                # Nothing found while it waited (a snapshot stored since holds at most a chunk).
                if cache is not None and lookup is not None:
                    cache.counted(lookup)
                journal.post(Prefilling(len(prompt.ids), 0))
                return prompt.ids
            self.engine.image_clear()
            run_prefill(ids, upto)
            for path in prompt.image_paths:
                self.engine.image_add(path)
            return self.engine.image_expand(prompt.text_ids[upto:])
        except LostTurn:
            raise   # a chore that stepped aside: the engine is another request's now
        except BaseException:
            self.engine.reset()  # a half-evaluated prompt must not survive into the next request
            raise

    def _rebuild(self, tokens: list[int]) -> None:
        """The engine, reset by a cancelled generate, brought back to hold `tokens` (the
        prompt's snapshot restored, the rest evaluated)."""
        prefill = Prefill(self.engine, tokens, cache=self.prefix_cache, policy=self.policy,
                          chunk=self.prefill_chunk, insure=False)
        prefill.restore(len(tokens))
        prefill.evaluate(len(tokens))

    # -- accounting -----------------------------------------------------------------------

    def _usage(self, prompt_tokens: int, clock: _Clock, context_full: bool, ms: float,
               s: Stats, decoding: dict) -> Usage:
        n = len(clock.tokens)
        decode_s = clock.last_token_at - clock.first_token_at
        tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        self.metrics.reply(prompt_tokens, clock.cached_tokens, n,
                           clock.first_token_at - clock.started_at if n else None,
                           tps if tps else None)
        looked_up = s.experts_hit + s.experts_missed
        # The reply's time in two: to its first token (the prompt's prefill, restored part
        # included), and from there to its last (what Ollama's timings report apart).
        first_ms = (clock.first_token_at - clock.started_at) * 1000.0 if n else ms
        return Usage(prompt_tokens, n, cached_tokens=clock.cached_tokens, waste={
            "prompt_tokens": prompt_tokens, "completion_tokens": n,
            "cached_tokens": clock.cached_tokens,
            "experts_hit": s.experts_hit, "experts_missed": s.experts_missed,
            "expert_hit_rate": s.experts_hit / looked_up if looked_up else 0.0,
            "bytes_read": s.bytes_read, "io_ms": round(s.sec_io * 1000.0, 3),
            "direct_io": s.direct_io, "ms": round(ms, 3), "first_token_ms": round(first_ms, 3),
            "decode_ms": round(decode_s * 1000.0, 3),
            "tokens_per_second": round(tps, 3), "context_full": context_full,
            **decoding})


def _pause_at(pause: Pause, prompt: Sequence[int]) -> Callable[[Sequence[int]], None]:
    """The decoder's pause: before evaluating a token the engine holds the prompt and the
    tokens generated before it."""
    def at(generated: Sequence[int]) -> None:
        if pause.due():
            tokens = [*prompt, *generated]
            pause.step_aside(tokens, len(tokens) - 1)
    return at


def _finish_reason(reader: ReplyReader, tokens: list[int], params: GenParams, result: GenResult) -> str:
    """`length` when the reply was cut (max_tokens, a full context, a cancel); else `stop`,
    or `tool_calls` when it called tools."""
    natural = reader.ended or (tokens and tokens[-1] in params.stop_tokens) or not (
        result.context_full or len(tokens) >= params.max_tokens or result.cancelled)
    if not natural:
        return "length"
    return "tool_calls" if reader.has_tool_calls else "stop"


def _stats_delta(before: Stats, after: Stats) -> Stats:
    return Stats(tokens_generated=after.tokens_generated - before.tokens_generated,
                 experts_hit=after.experts_hit - before.experts_hit,
                 experts_missed=after.experts_missed - before.experts_missed,
                 bytes_read=after.bytes_read - before.bytes_read,
                 sec_total=after.sec_total - before.sec_total,
                 sec_io=after.sec_io - before.sec_io, direct_io=after.direct_io)
