"""One memory plan for two containers in one process: the main model and the chores model.

Each engine is opened with a RAM budget of its own, and the two add up to the
server's: --budget, or without one half the RAM this process may use (the most
an engine left to pick takes by itself, serve/app/context.py). The rule:

1. the chores model is planned first. Its context is --chores-ctx, else chosen
   as the main model's is, against a quarter of the budget; its budget is
   --chores-budget, else what waste_plan_memory recommends for it at that
   context, at most a quarter of the whole and never below its floor. A
   chores model is small and its replies short: its expert cache matters
   far less than the main model's, which streams experts off the SSD;
2. the main model takes the rest, and its context is chosen against the rest
   (--ctx overrides) as it would be against a budget of its own.

A split that leaves either model below its floor (waste_plan_memory's
floor_bytes, the vision tower added when asked) is refused at start, in one
line that says what each side needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from serve.app.context import ContextChoice, Planner, choose_context
from serve.engine.types import MemPlan, WasteError

CHORES_SHARE = 4   # the chores model takes at most 1/CHORES_SHARE of the budget unless told


class BudgetError(Exception):
    """The budget cannot hold both models (or one cannot be planned at all)."""


@dataclass(frozen=True)
class Share:
    """One model's part of the plan: the budget and context it is opened with."""
    model: str
    budget: int
    context: ContextChoice
    plan: MemPlan      # waste_plan_memory at that context
    reason: str        # how the budget was arrived at, for the banner and --plan


@dataclass(frozen=True)
class Split:
    total: int
    origin: str        # where the total comes from
    main: Share
    chores: Share


def split_budget(lib: Planner, main: str, chores: str, *, budget: int, ctx: int, chores_ctx: int,
                 chores_budget: Optional[int], vision: bool) -> Split:
    total = budget or lib.usable_ram() // 2
    origin = "--budget" if budget else "half the usable RAM"
    if chores_budget is not None and chores_budget >= total:
        raise BudgetError(f"--chores-budget {gib(chores_budget)} leaves nothing of the "
                          f"{gib(total)} budget ({origin}) for {main}")
    # The chores model's context is its own choice: no smaller than it would be alone.
    chores_context = (ContextChoice(chores_ctx, "--chores-ctx") if chores_ctx else
                      choose_context(lib, chores, 0, chores_budget or total // CHORES_SHARE, False))
    chores_plan = _plan(lib, chores, chores_context)
    if chores_budget is not None:
        mine, why = chores_budget, "--chores-budget"
    else:
        mine = max(chores_plan.floor_bytes, min(chores_plan.recommended_bytes, total // CHORES_SHARE))
        why = ("its recommended size" if mine == chores_plan.recommended_bytes else
               "its floor" if mine == chores_plan.floor_bytes else
               f"1/{CHORES_SHARE} of the budget (its recommended size is "
               f"{gib(chores_plan.recommended_bytes)})")
    if mine < chores_plan.floor_bytes:
        raise BudgetError(f"the chores model {chores} needs {gib(chores_plan.floor_bytes)} at "
                          f"ctx {chores_context.tokens or 'default'} (its floor), "
                          f"more than --chores-budget {gib(mine)}")
    rest = total - mine
    main_context = choose_context(lib, main, ctx, rest, vision)
    main_plan = _plan(lib, main, main_context)
    need = main_plan.floor_bytes + (main_plan.vision_bytes if vision else 0)
    if rest < need:
        raise BudgetError(
            f"a budget of {gib(total)} ({origin}) cannot hold both models: the chores model "
            f"{chores} takes {gib(mine)} ({why}), leaving {gib(rest)} for {main}, whose floor "
            f"is {gib(need)} at ctx {main_context.tokens or 'default'}; raise --budget, or "
            "lower --chores-budget, --chores-ctx or --ctx")
    return Split(total, origin, Share(main, rest, main_context, main_plan, "the rest"),
                 Share(chores, mine, chores_context, chores_plan, why))


def _plan(lib: Planner, model: str, context: ContextChoice) -> MemPlan:
    try:
        return lib.plan_memory(model, context.tokens)
    except (WasteError, ValueError) as e:
        raise BudgetError(f"cannot plan {model}: {e}") from None


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
