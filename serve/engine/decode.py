"""Decoding in serve, token by token over `waste_eval`: sample, mask, logprobs.

Used instead of the engine's own `waste_generate` when a reply must follow a
grammar, report logprobs, or have its logits adjusted (`logit_bias`, the
frequency and presence penalties, as OpenAI defines them: a token's logit less
its count in the reply so far times the one, less the other once it is there,
plus its bias); all need the logits, which only `waste_eval` hands out. Each step evaluates the last token, samples from its logits with
the request's temperature, top_k, top_p and seed (the engine's order: scale,
keep the top k, keep the top p of that mass), and reports the token exactly
as the engine's callback would. One difference: a token is evaluated after
its report, not before, so the reply's last token is never evaluated: nothing
reads the state after a reply, and on an expert-streaming model an
evaluation takes about a second.

The grammar costs little when the model already agrees with it: the model's
own pick is drawn first, and only when the grammar refuses it is the mask
computed and the pick drawn again among the allowed candidates (or, when none
of them is allowed, among the allowed tokens). With no top_k/top_p this is
exactly sampling from the masked distribution; greedy stays greedy.

numpy is optional: without it `missing()` says why and nothing here is used.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

try:
    import numpy as np
except ImportError as _e:  # the server runs without it: logprobs and structure are then off
    np = None  # type: ignore[assignment]
    _IMPORT_ERROR: Optional[str] = f"numpy is not installed ({_e})"
else:
    _IMPORT_ERROR = None

from serve.engine.types import GenParams, GenResult, TokenInfo
from serve.engine.api import EngineApi
from serve.engine.queue import LostTurn

DRAW_BLOCK = 1024     # weights summed per block when drawing
NUCLEUS_GUESS = 1024  # top_p: candidates sorted first, before sorting the whole vocabulary
BEST_WINDOW = 8.0     # top_logprobs: look first among tokens this close to the best (in log units)


def missing() -> Optional[str]:
    """Why decoding in serve is off, or None when it is on."""
    return _IMPORT_ERROR


class Grammar(Protocol):
    """What the loop needs from a grammar matcher (llguidance's LLMatcher)."""

    def validate_tokens(self, tokens: list[int]) -> int: ...
    def consume_token(self, token: int) -> bool: ...
    def compute_bitmask(self) -> bytes: ...
    def get_error(self) -> str: ...


@dataclass
class Report:
    """What the `waste` object says about decoding."""
    constrained: bool
    mask_ms: float = 0.0          # computing masks (only when the model's pick was refused)
    mask_changed: int = 0         # tokens where the grammar overruled the model's pick
    mask_times: list[float] = field(default_factory=list)   # each mask, ms (for benchmarks)

    def waste(self) -> dict:
        return {"constrained": self.constrained, "mask_ms": round(self.mask_ms, 3),
                "mask_changed": self.mask_changed}


@dataclass(frozen=True)
class Adjustment:
    """What a request changes in the logits before each draw (grammar masks come after)."""
    bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    frequency: float = 0.0   # times the token's count among the tokens generated so far
    presence: float = 0.0    # once the token is among them

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.frequency != 0 or self.presence != 0

    def apply(self, logits: "np.ndarray", generated: Sequence[int]) -> "np.ndarray":
        """The logits adjusted, a copy (the engine's buffer is read-only). A bias on an id
        past the logits (a special token the tokenizer has and the model never samples, as
        formats/grammar.py's Vocabulary also finds) has no logit to change."""
        out = np.array(logits, dtype=np.float32)
        n = out.shape[0]
        if self.bias:
            ids = np.fromiter((t for t in self.bias if t < n), dtype=np.int64)
            out[ids] += np.fromiter((self.bias[int(t)] for t in ids), dtype=np.float32,
                                    count=len(ids))
        if generated and (self.frequency or self.presence):
            seen, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            out[seen] -= counts.astype(np.float32) * np.float32(self.frequency) \
                + np.float32(self.presence)
        return out


class LogprobListener(Protocol):
    def token(self, token: int, entry: Optional[dict]) -> None:
        """Called for each token before it is reported, with its logprob entry (or None)."""


class Decoder:
    """One reply's loop; `generate` has engine.generate's signature and contract."""

    def __init__(self, engine: EngineApi, *, temperature: float, top_k: int, top_p: float,
                 grammar: Optional[Callable[[int], Grammar]] = None,
                 top_logprobs: Optional[int] = None,
                 listener: Optional[LogprobListener] = None,
                 piece: Optional[Callable[[int], bytes]] = None,
                 pause: Optional[Callable[[Sequence[int]], None]] = None,
                 adjust: Optional[Adjustment] = None,
                 forced: Optional[Callable[[], Sequence[int]]] = None):
        """`pause`: called before each evaluation with the tokens generated so far (the
        engine holds all but the last of them after the prompt): a chore steps aside there,
        and this loop's sampler and grammar go on as they were (serve/service/preempt.py).
        `forced`: asked after each token's report for ids to append without sampling (a
        think channel closed: serve/service/reasoning_budget.py); each is reported as a
        token and evaluated with the one before it."""
        self.engine = engine
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self._make_grammar = grammar   # vocabulary size -> a fresh matcher
        self.grammar: Optional[Grammar] = None
        self.top_logprobs = top_logprobs   # None: no logprobs
        self.listener = listener
        self._piece = piece or (lambda token: engine.detokenize([token]))
        self.report = Report(constrained=grammar is not None)
        self.pause = pause
        self.adjust = adjust if adjust is not None and adjust.active else None
        self.forced = forced

    def generate(self, prompt: Sequence[int], params: GenParams,
                 on_token: Callable[[TokenInfo, bytes], Optional[bool]]) -> GenResult:
        rng = np.random.Generator(np.random.PCG64(params.seed))
        stops = frozenset(params.stop_tokens)
        generated: list[int] = []
        try:
            if self.pause is not None:
                self.pause(generated)
            started = time.monotonic()
            logits = np.frombuffer(self.engine.eval(prompt), dtype=np.float32)
            if self._make_grammar is not None:   # the vocabulary's size is the logits'
                self.grammar = self._make_grammar(logits.shape[0])
            while len(generated) < params.max_tokens:
                if self.adjust is not None:   # logit_bias and the penalties
                    logits = self.adjust.apply(logits, generated)
                token, allowed = self._choose(logits, rng)
                entry = self._logprobs(logits, allowed, token) if self.top_logprobs is not None else None
                self._consume(token, entry)
                generated.append(token)
                info, started = self._info(len(generated) - 1, token, entry, started)
                if on_token(info, self._piece(token)):
                    return self._cancelled(generated)
                if token in stops or len(generated) == params.max_tokens:
                    break
                step = [token]
                for extra in (self.forced() if self.forced is not None else ()):
                    self._consume(extra, None)
                    generated.append(extra)
                    step.append(extra)
                    info, started = self._info(len(generated) - 1, extra, None, started)
                    if on_token(info, self._piece(extra)):
                        return self._cancelled(generated)
                if self.pause is not None:
                    self.pause(generated[:len(generated) - len(step) + 1])
                    started = time.monotonic()   # a pause's wait is not this token's time
                logits = np.frombuffer(self.engine.eval(step), dtype=np.float32)
        except LostTurn:
            raise   # the engine is another request's now
        except BaseException:
            self.engine.reset()
            raise
        return GenResult(n_tokens=len(generated), cancelled=False, context_full=False, detail=None)

    def _consume(self, token: int, entry: Optional[dict]) -> None:
        """The grammar and the listener hear of a token, sampled or forced."""
        if self.grammar is not None and not self.grammar.consume_token(token):
            raise RuntimeError(f"grammar refused the token {token}: {self.grammar.get_error()}")
        if self.listener is not None:
            self.listener.token(token, entry)

    @staticmethod
    def _info(index: int, token: int, entry: Optional[dict], started: float
              ) -> tuple[TokenInfo, float]:
        """The token's report as the engine's callback would have it, and the time now."""
        now = time.monotonic()
        return TokenInfo(index, token, entry["logprob"] if entry else 0.0, 0, 0, 0,
                         (now - started) * 1000.0, 0.0), now

    def _cancelled(self, generated: list[int]) -> GenResult:
        self.engine.reset()  # as after a cancelled waste_generate
        return GenResult(n_tokens=len(generated), cancelled=True, context_full=False, detail=None)

    # -- sampling ---------------------------------------------------------------------------

    def _choose(self, logits: "np.ndarray", rng: "np.random.Generator"
                ) -> tuple[int, Optional["np.ndarray"]]:
        """(token, allowed-mask or None when no mask was computed)."""
        u = rng.random()   # one draw per token on every path: same seed, same answer
        candidates, weights = self._candidates(logits)
        token = int(candidates[_draw(weights, u)]) if len(candidates) > 1 else int(candidates[0])
        if self.grammar is None:
            return token, None
        needs_mask = self.top_logprobs is not None
        if self.grammar.validate_tokens([token]) == 1 and not needs_mask:
            return token, None   # the fast path: the model's own pick is allowed
        allowed = self._mask(logits.shape[0])
        if allowed[token]:
            return token, allowed
        self.report.mask_changed += 1
        ok = allowed[candidates]
        if ok.any():   # the model's candidates that the grammar allows
            return int(candidates[ok][_draw(weights[ok], rng.random())]), allowed
        masked = np.where(allowed, logits, -np.inf).astype(np.float32)
        candidates, weights = self._candidates(masked)
        return int(candidates[_draw(weights, rng.random())]), allowed

    def _candidates(self, logits: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
        """Token ids the sampler may pick and their unnormalized weights (the engine's order).

        float32 throughout: on a K3-sized vocabulary every float64 pass costs a millisecond.
        """
        if self.temperature == 0:
            return np.array([int(np.argmax(logits))]), np.ones(1, dtype=np.float32)
        n = logits.shape[0]
        ids = np.argpartition(logits, n - self.top_k)[n - self.top_k:] if 0 < self.top_k < n else None
        weights = logits if ids is None else logits[ids]
        weights = weights - weights.max()
        weights *= np.float32(1.0 / self.temperature)
        np.exp(weights, out=weights)
        if self.top_p < 1.0:
            order = _nucleus(weights, self.top_p)
            weights = weights[order]
            ids = order if ids is None else ids[order]
        return (np.arange(n) if ids is None else ids), weights

    def _mask(self, n_vocab: int) -> "np.ndarray":
        started = time.perf_counter()
        assert self.grammar is not None   # a mask is asked for only under a grammar
        bits = np.frombuffer(self.grammar.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:n_vocab].view(bool)
        ms = (time.perf_counter() - started) * 1000.0
        self.report.mask_ms += ms
        self.report.mask_times.append(ms)
        return allowed

    # -- logprobs ---------------------------------------------------------------------------

    def _logprobs(self, logits: "np.ndarray", allowed: Optional["np.ndarray"], token: int) -> dict:
        """The chosen token's entry: the log-softmax of the logits the sampler drew from
        (masked by the grammar, divided by the temperature; greedy divides by 1)."""
        scaled = logits * np.float32(1.0 / (self.temperature or 1.0))
        if allowed is not None:
            scaled[~allowed] = -np.inf
        top = scaled.max()
        norm = float(top) + math.log(float(np.exp(scaled - top).sum(dtype=np.float64)))
        entry = self._entry(token, float(scaled[token]) - norm)
        entry["top_logprobs"] = [self._entry(int(t), float(scaled[t]) - norm)
                                 for t in _best(scaled, self.top_logprobs or 0)]
        return entry

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self._piece(token)
        return {"token": token_text(piece), "logprob": max(logprob, -9999.0), "bytes": list(piece)}


def token_text(piece: bytes) -> str:
    """A token as logprobs name it: its text, or (part of a character) `bytes:\\xNN...`."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _draw(weights: "np.ndarray", u: float) -> int:
    """Index of the weight whose cumulative span holds u (0 <= u < 1) of the total.

    Two levels (block sums, then one block) because a cumulative sum over a
    whole vocabulary is slow; numpy's sums are not.
    """
    n = weights.shape[0]
    block = DRAW_BLOCK if n > DRAW_BLOCK else n
    full = n - n % block
    sums = np.empty(full // block + (n > full), dtype=np.float64)
    sums[:full // block] = weights[:full].reshape(-1, block).sum(axis=1, dtype=np.float64)
    if n > full:
        sums[-1] = weights[full:].sum(dtype=np.float64)
    spans = np.cumsum(sums)
    target = u * spans[-1]
    b = min(int(np.searchsorted(spans, target, side="right")), len(spans) - 1)
    start = b * block
    inside = np.cumsum(weights[start:start + block], dtype=np.float64)
    at = int(np.searchsorted(inside, target - (spans[b - 1] if b else 0.0), side="right"))
    return min(start + at, n - 1)


def _nucleus(weights: "np.ndarray", top_p: float) -> "np.ndarray":
    """Indices of the heaviest weights holding top_p of the mass, heaviest first.

    The nucleus is usually a small part of a large vocabulary: sort the
    heaviest NUCLEUS_GUESS first, and the whole only when they fall short.
    """
    target = top_p * float(weights.sum(dtype=np.float64))
    order = None
    if len(weights) > NUCLEUS_GUESS:
        guess = np.argpartition(weights, len(weights) - NUCLEUS_GUESS)[-NUCLEUS_GUESS:]
        if float(weights[guess].sum(dtype=np.float64)) >= target:
            order = guess[np.argsort(-weights[guess], kind="stable")]
    if order is None:
        order = np.argsort(-weights, kind="stable")
    mass = np.cumsum(weights[order], dtype=np.float64)
    return order[:int(np.searchsorted(mass, target)) + 1]


def _best(scaled: "np.ndarray", n: int) -> list[int]:
    """The n highest finite entries, best first (ties by id)."""
    if n == 0:
        return []
    top = scaled.max()
    near = np.flatnonzero(scaled >= top - BEST_WINDOW)   # usually far fewer than the vocabulary
    if len(near) < n:
        near = np.flatnonzero(scaled > -np.inf)
    values = scaled[near]
    if len(near) > n:   # a random model's logits are all "near": partition before sorting
        part = np.argpartition(-values, n - 1)[:n]
        near, values = near[part], values[part]
    return [int(t) for t in near[np.lexsort((near, -values))]]
