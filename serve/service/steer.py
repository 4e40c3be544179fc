"""Generate a reply whose reasoning may be closed for it: by its budget, or "answer now".

On serve's own decoder (serve/engine/decode.py) the format's closing ids are forced
after the token that spent the budget, or the next one after `answer_now()`.

waste_generate cannot be stopped and resumed: a cancelled generate leaves a state that
must be reset (the ABI: "after any failure call waste_state_reset"), and a resumed one
needs a prompt token. So the reply is generated in pieces that end as the ABI allows:
- the budget: the first piece's `max_tokens` is the budget left (the reply opens in the
  think channel), and its first closing id (K3's `<|close|>`) is a stop token, so that a
  model closing its reasoning early ends the piece too. The next piece's prompt is the
  closing markup (the rest of it, after the model's own first id).
- "answer now": the piece is cancelled at the next token, the state is rebuilt (the
  prompt's snapshot restored, the reply so far evaluated: `rebuild`), and the next piece's
  prompt is the closing markup. Without a rebuild (a prompt with images) the request
  says so: ReasoningBudget.anytime is False.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from serve.engine.api import EngineApi
from serve.engine.decode import Decoder
from serve.engine.types import GenParams, GenResult, TokenInfo
from serve.service.reasoning_budget import ANSWER_NOW, BUDGET, MODEL, ReasoningBudget
from serve.service.reply_reader import ReplyReader

TokenCallback = Callable[[TokenInfo, bytes], bool]


def generate(engine: EngineApi, decoder: Optional[Decoder], prompt: Sequence[int],
             params: GenParams, on_token: TokenCallback, reader: ReplyReader,
             budget: Optional[ReasoningBudget],
             rebuild: Optional[Callable[[Sequence[int]], None]]) -> GenResult:
    """Generate as engine.generate (or the decoder) would, closing the think channel when
    `budget` says; `rebuild(generated)`: the engine, reset, brought back to the prompt and
    the tokens generated so far (None: answer now cannot interrupt waste_generate).
    The reasoning is closed only where its markup and one answer token fit in max_tokens."""
    if budget is None or not budget.closing:
        return (decoder or engine).generate(prompt, params, on_token)
    room = params.max_tokens - len(budget.closing)   # tokens after which a close cannot fit
    if decoder is not None:
        count = 0

        def counted(info: TokenInfo, piece: bytes) -> bool:
            nonlocal count
            count += 1
            return on_token(info, piece)

        def forced() -> Sequence[int]:
            by = budget.due(reader.thinking) if count < room else None
            return budget.close(by) if by is not None else ()
        decoder.forced = forced
        return decoder.generate(prompt, params, counted)
    return _pieces(engine, prompt, params, on_token, reader, budget, room, rebuild)


def _pieces(engine: EngineApi, prompt: Sequence[int], params: GenParams,
            on_token: TokenCallback, reader: ReplyReader, budget: ReasoningBudget, room: int,
            rebuild: Optional[Callable[[Sequence[int]], None]]) -> GenResult:
    generated: list[int] = []
    closing = budget.closing
    interrupted = False

    def piece_token(info: TokenInfo, piece: bytes) -> bool:
        nonlocal interrupted
        generated.append(info.token)
        if on_token(info, piece):
            return True
        interrupted = rebuild is not None and len(generated) < room \
            and budget.due(reader.thinking) == ANSWER_NOW
        return interrupted

    def forced(ids: Sequence[int]) -> bool:
        """The closing ids, read as the model's own (the next piece's prompt)."""
        for token in ids:
            generated.append(token)
            if on_token(TokenInfo(len(generated) - 1, token, 0.0, 0, 0, 0, 0.0, 0.0),
                        engine.detokenize([token])):
                return True
        return False

    while True:
        left = params.max_tokens - len(generated)
        # A budget ends the piece only where its close still fits; else max_tokens ends it.
        limit = budget.left() if budget.ended_by is None else None
        if limit is not None and (limit >= room or len(closing) < 2):
            limit = None   # (a one-id close could not follow a model's own first id)
        result = engine.generate(prompt, GenParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=(params.seed + len(generated)) % 2 ** 64,
            max_tokens=left if limit is None else min(left, limit),
            stop_tokens=params.stop_tokens if limit is None else (*params.stop_tokens, closing[0])),
            piece_token)
        if interrupted:
            assert rebuild is not None   # only then is a piece interrupted
            rebuild(generated)
            interrupted = False
            prompt = budget.close(ANSWER_NOW)
        elif result.cancelled or result.context_full or limit is None or not generated \
                or generated[-1] in params.stop_tokens:
            break   # (without a limit, only an interruption ends a piece early)
        elif generated[-1] == closing[0] and not reader.thinking:
            budget.close(MODEL)   # the model began closing its reasoning: the markup finished
            prompt = closing[1:]
        elif budget.due(reader.thinking) == BUDGET:
            prompt = budget.close(BUDGET)
        else:
            break   # max_tokens
        if forced(prompt):
            break
    return GenResult(n_tokens=len(generated), cancelled=result.cancelled,
                     context_full=result.context_full, detail=result.detail)
