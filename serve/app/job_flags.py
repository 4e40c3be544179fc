"""The flags for what a request's job does once its client leaves, what they make of the
options, and their banner lines (serve/service/detach.py holds the rule)."""
from __future__ import annotations

import argparse
from typing import Any, Callable

from serve.service.detach import DEFAULT_KEEP_SECONDS


def add_flags(p: argparse.ArgumentParser, seconds: Callable[[str], float]) -> None:
    p.add_argument("--no-finish-abandoned", action="store_true",
                   help="a prefill whose client left stops at its next chunk, instead of going "
                        "on to the end of the prompt for the client's retry while no one waits")
    p.add_argument("--no-attach", action="store_true",
                   help="a request never attaches to an identical request's job, and a job "
                        "whose client left ends at its next token (its prefill still goes on "
                        "for the prefix cache, unless --no-finish-abandoned)")
    p.add_argument("--keep-detached", type=seconds, default=DEFAULT_KEEP_SECONDS, metavar="SECONDS",
                   help="how long a job whose client left goes on, while no one waits, for the "
                        f"client to come back (default: {DEFAULT_KEEP_SECONDS:g})")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """ServiceOptions' fields these flags set."""
    return {"finish_abandoned": not args.no_finish_abandoned, "attach": not args.no_attach,
            "keep_detached": args.keep_detached}


def banner_lines(args: argparse.Namespace) -> list[str]:
    return [("abandon  a prefill whose client left stops at its next chunk (--no-finish-abandoned)"
             if args.no_finish_abandoned else
             "abandon  a prefill whose client left goes on for its retry while no one waits"),
            ("jobs     a request's job ends when its client leaves (--no-attach)" if args.no_attach
             else f"jobs     a job whose client left goes on for {args.keep_detached:g} s while "
                  "no one waits; the same request sent again attaches to it")]
