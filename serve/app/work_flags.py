"""The flags for classes of work and prefill steps, what they make of the options, and their banner lines."""
from __future__ import annotations

import argparse
import re
from typing import Callable

from serve.service.prefill import REFERENCE_STEP, WARP_STEP, engine_step
from serve.engine.queue import STARVE_AFTER_SECONDS

DEFAULT_BACKGROUND_MAX_TOKENS = 256


def _pattern(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return text


def add_flags(p: argparse.ArgumentParser, positive: Callable[[str], int],
              seconds: Callable[[str], float]) -> None:
    p.add_argument("--background-model", action="append", default=[], metavar="NAME",
                   help="a model name whose requests are chores (background work), e.g. the "
                        "value of Claude Code's ANTHROPIC_SMALL_FAST_MODEL or Open-WebUI's task "
                        "model; repeatable")
    p.add_argument("--background-match", action="append", default=[], type=_pattern,
                   metavar="REGEX", help="a pattern on the prompt (a chat's last user message, a "
                                         "completion's prompt) that marks a chore; repeatable")
    p.add_argument("--background-max-tokens", type=positive, default=DEFAULT_BACKGROUND_MAX_TOKENS,
                   metavar="N", help="max_tokens of a chore that sets none, and the most a "
                                     "chore the server recognised may ask for (default "
                                     f"{DEFAULT_BACKGROUND_MAX_TOKENS})")
    p.add_argument("--chore-max-wait", type=seconds, default=STARVE_AFTER_SECONDS,
                   metavar="SECONDS", help="a chore that waited this long runs one engine step "
                                           "ahead of people (default "
                                           f"{STARVE_AFTER_SECONDS:g})")
    p.add_argument("--no-work-classes", action="store_true",
                   help="serve every request in arrival order, chores too (none is preempted)")
    p.add_argument("--prefill-step", type=positive, default=None, metavar="N",
                   help=f"positions per prefill call (default: the engine's own batch: "
                        f"{WARP_STEP} on WARP's libwaste, {REFERENCE_STEP} on the reference engine)")


def options(args: argparse.Namespace, build_info: str) -> dict:
    """ServiceOptions' fields these flags set."""
    return {"work_classes": not args.no_work_classes,
            "background_max_tokens": args.background_max_tokens,
            "chore_max_wait": args.chore_max_wait,
            "background_models": tuple(args.background_model),
            "background_match": tuple(args.background_match),
            "prefill_chunk": args.prefill_step or engine_step(build_info)}


def banner_lines(args: argparse.Namespace, build_info: str, snapshots: bool) -> list[str]:
    step = args.prefill_step or engine_step(build_info)
    whose = ("--prefill-step" if args.prefill_step else
             "the reference engine's batch" if step == REFERENCE_STEP else "WARP's batch")
    lines = [f"prefill  steps of {step} positions ({whose})"]
    if args.no_work_classes:
        return lines + ["chores   off: every request in arrival order (--no-work-classes)"]
    named = "".join(f"; model {name}" for name in args.background_model) + \
        "".join(f"; prompt /{p}/" for p in args.background_match)
    preempt = ("step aside for them at their next engine call" if snapshots else
               "are not preempted (no prefix cache to save them in)")
    lines += [f"chores   background: Open-WebUI's tasks, agents' side requests (opencode, Claude "
              f"Code, Codex, Aider, Continue), priority > 0, X-Serve-Class{named}",
              f"chores   wait behind people and {preempt}; one waiting "
              f"{args.chore_max_wait:g} s runs a step (--chore-max-wait); max_tokens "
              f"{args.background_max_tokens} unless set, and at most that when recognised "
              f"(--background-max-tokens)"]
    return lines
