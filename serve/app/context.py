"""The context the engine opens with when --ctx is not given: the largest that fits agents.

The ABI's default (ctx_tokens 0) is 4096 positions, and an agent's first
request is longer: Claude Code's preamble (24 tools and a system prompt) is
about 20K K3 tokens, Open-WebUI's 36 built-in tools as much again, and an
agent's conversation grows past 60K. So serve asks waste_plan_memory about
candidate contexts, largest first, and takes the first that

- the model takes: an engine refuses a context above the length its model
  declares (the reference engine's `context_length`), and the refusal says so;
- fits the RAM budget with the expert cache still its larger part: the
  context's state and scratch take at most a quarter of the budget. An
  expert-streaming model is as fast as its expert cache is large, and the
  cache gets what the context leaves;
- is at most CAP. 128K holds a 60K agent conversation twice over, and on K3
  (0.47 prompt tokens/s) prefilling even that much from scratch is 77 hours:
  a larger default would only reserve RAM no conversation reaches.

--ctx overrides all of it; the banner says what was chosen and why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve.engine.types import MemPlan, WasteError

CAP = 131072
SMALLEST = 4096     # the ABI's own default: below it, the engine's default is as good
STATE_SHARE = 4     # the context's state and scratch take at most 1/STATE_SHARE of the budget


class Planner(Protocol):
    def plan_memory(self, model_path: str, ctx: int = 0) -> MemPlan: ...

    def usable_ram(self) -> int: ...


@dataclass(frozen=True)
class ContextChoice:
    tokens: int     # the ctx_tokens to open with; 0 leaves it to the engine
    reason: str     # for the banner


def candidates() -> list[int]:
    """CAP, CAP/2, ... down to SMALLEST."""
    out, n = [], CAP
    while n >= SMALLEST:
        out.append(n)
        n //= 2
    return out


def choose_context(lib: Planner, model: str, asked: int, budget: int, vision: bool) -> ContextChoice:
    """The context to open `model` with: `asked` (--ctx) when given, else the largest candidate
    the model takes whose state fits a quarter of `budget` (0: half the RAM this process may
    use, the share an engine left to pick takes)."""
    if asked:
        return ContextChoice(asked, "--ctx")
    ram = budget or lib.usable_ram() // 2
    refused = None       # the engine's word on the largest candidate it refused
    too_big = None       # the smallest candidate the budget could not hold, so far
    for n in candidates():
        try:
            plan = lib.plan_memory(model, n)
        except WasteError as e:
            refused = refused or f"{n:,} refused: {e.detail or e.message}"
            continue
        state = plan.state_bytes + plan.scratch_bytes + (plan.vision_bytes if vision else 0)
        if ram and state * STATE_SHARE > ram:
            too_big = n
            continue
        if n == CAP:
            why = "the largest serve picks by itself; --ctx for more"
        elif too_big:
            why = (f"the largest whose state fits a quarter of the {_gib(ram)} budget "
                   f"({too_big:,} would not)")
        else:   # below CAP and not for the budget: the model refused the candidate above
            most = model_limit(lib, model, n, 2 * n)
            why = ("the most the model takes" if most == n else
                   f"the largest of serve's candidates the model takes (it takes up to {most:,}; "
                   "--ctx for more)")
        return ContextChoice(n, why)
    why = ("no candidate context fits a quarter of the budget" if too_big
           else f"the model takes none of {SMALLEST:,} to {CAP:,}" + (f" ({refused})" if refused else ""))
    return ContextChoice(0, f"the engine's default: {why}")


def model_limit(lib: Planner, model: str, taken: int, refused: int) -> int:
    """The largest context the model takes, between one it takes and one it refuses
    (a plan loads no weights: a few are cheap)."""
    while refused - taken > 1:
        middle = (taken + refused) // 2
        try:
            lib.plan_memory(model, middle)
            taken = middle
        except WasteError:
            refused = middle
    return taken


def beyond(lib: Planner, model: str, ctx: int, budget: int, vision: bool) -> str:
    """What a prompt too long for the `ctx` the engine opened with is told of a larger context:
    --ctx only when the model takes more and the memory holds it."""
    try:
        plan = lib.plan_memory(model, ctx + 1)
    except WasteError:
        return "the most this model takes"
    ram = budget or lib.usable_ram()
    if ram and plan.floor_bytes + (plan.vision_bytes if vision else 0) > ram:
        return f"the most the {_gib(ram)} {'budget' if budget else 'of memory'} holds"
    return "a server started with a larger --ctx takes more"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
