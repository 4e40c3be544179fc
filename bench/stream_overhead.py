#!/usr/bin/env python3
"""Streaming overhead: decode tokens/s streamed in each dialect versus a bare ctypes
waste_generate loop on the same library and container.

    .venv/bin/python bench/stream_overhead.py [CONTAINER] [--lib PATH] [--tokens N] [--runs N]
        [--dialects chat,completions,messages,responses,ollama] [--cpus SERVER/CLIENT]
        [--before CHECKOUT]

The server runs in its own process, as in production; the client reads each
stream as a client would. Decode rate counts from the first streamed token to
the last, so prefill is excluded on both sides, and all run the same number of
prompt positions (the chat template rendered with thinking off; the completion's
raw prompt padded to as many). A round runs each dialect, in an order that
turns each round, right after a bare run of its own; each stream's rate is
divided by that bare rate, so drift in the machine's speed cancels out of the ratio, and the
table gives the median and the range of those paired ratios.
With --before, a second server runs another checkout's serve (say `git worktree
add /tmp/before main`) on the same library, streamed each round too, so that
the two paths' per-token cost is compared pair by pair.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from common import DEMO, Engine, EngineConfig, GenParams, build_chat_segments, load_library, \
    machine, rate, server, split_cpus
from dialect_streams import DIALECTS, QUESTION, stream, token_rate


def pin(cpus: Optional[set[int]]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def cpu_split(spec: Optional[str]) -> tuple[Optional[set[int]], Optional[set[int]]]:
    """`--cpus 0/1` (server and bare loop on 0, client on 1), `0,1/0,1` (no split), or the
    default halves."""
    if spec is None:
        return split_cpus()
    server_cpus, client_cpus = ({int(c) for c in side.split(",")} for side in spec.split("/"))
    return server_cpus, client_cpus


def padded_prompt(engine: Engine, positions: int) -> str:
    """The question as raw text, padded to `positions` prompt ids (the chat rendering's)."""
    text = QUESTION
    while len(engine.tokenize(text + " The sea.", add_bos=True)) <= positions:
        text += " The sea."
    return text


class Bare:
    """The bare loop: waste_generate through ctypes, each token stamped, on an engine that
    stays open and warm across rounds as the server's does (a fresh one would read its
    experts from disk while it decodes)."""

    def __init__(self, engine: Engine, ids: list[int], tokens: int):
        self._engine, self._ids, self._params = engine, ids, GenParams(max_tokens=tokens)
        self()

    def __call__(self) -> float:
        stamps: list[float] = []
        self._engine.reset()
        self._engine.generate(self._ids, self._params, lambda info, piece: stamps.append(time.perf_counter()))
        return rate(stamps)


def paired(bare: list[float], other: list[float]) -> list[float]:
    return sorted(o / b for b, o in zip(bare, other))


def spread(ratios: list[float]) -> str:
    return f"{ratios[0]:.3f} .. {ratios[-1]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads on both sides (default 1: leaves a core to the client)")
    ap.add_argument("--dialects", default=",".join(DIALECTS),
                    help=f"comma-separated, of {', '.join(DIALECTS)} (default: all)")
    ap.add_argument("--cpus", default=None,
                    help="SERVER/CLIENT cpu lists, e.g. 0/1 (default: the first half/the rest)")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout whose serve streams too, each round (a before-and-after)")
    args = ap.parse_args()
    names = args.dialects.split(",")
    unknown = [name for name in names if name not in DIALECTS]
    if unknown:
        ap.error(f"unknown dialect(s) {', '.join(unknown)}; known: {', '.join(DIALECTS)}")
    where, messages = machine(), [{"role": "user", "content": QUESTION}]
    server_cpus, client_cpus = cpu_split(args.cpus)
    flags = ("--ctx", "4096", "--no-prefix-cache", "--threads", str(args.threads))
    bare: dict[str, list[float]] = {name: [] for name in names}
    new: dict[str, list[float]] = {name: [] for name in names}
    old: dict[str, list[float]] = {name: [] for name in names}
    with ExitStack() as stack:
        pin(server_cpus)   # the bare loop runs on the server's cores, its engine threads too
        engine = stack.enter_context(Engine(load_library(args.lib), args.container,
                                            EngineConfig(threads=args.threads, ctx=4096)))
        ids = engine.tokenize_segments(build_chat_segments(messages, thinking=False))
        positions = len(ids)
        prompt = padded_prompt(engine, positions)
        bodies = {name: DIALECTS[name].body(messages, prompt, args.tokens) for name in names}
        bare_rate = Bare(engine, ids, args.tokens)
        port = stack.enter_context(server(args.container, *flags, lib=args.lib, cpus=server_cpus))
        old_port = None if args.before is None else stack.enter_context(
            server(args.container, *flags, lib=args.lib, cpus=server_cpus, root=args.before))
        for name in names:   # a first request warms each path (its expert reads, its imports)
            stream(port, DIALECTS[name], bodies[name])
            if old_port is not None:
                stream(old_port, DIALECTS[name], bodies[name])
        for round_ in range(args.runs):
            turn = round_ % len(names)
            for name in names[turn:] + names[:turn]:
                # The bare loop runs on the server's cores (virtual cores differ in speed:
                # the first often takes the interrupts), the client on the others; each
                # stream right after its own bare run, the machine's speed drifting in seconds.
                pin(server_cpus)
                bare[name].append(bare_rate())
                pin(client_cpus)
                new[name].append(token_rate(*stream(port, DIALECTS[name], bodies[name])))
                if old_port is not None:
                    old[name].append(token_rate(*stream(old_port, DIALECTS[name], bodies[name])))
    print(f"streaming overhead, {args.tokens} tokens, {args.threads} engine thread(s), "
          f"{args.runs} paired rounds, {positions} prompt positions — {where}")
    if server_cpus:
        print(f"server and bare loop on cpus {sorted(server_cpus)}, client on {sorted(client_cpus or ())}")
    every = [r for rates in bare.values() for r in rates]
    print(f"bare waste_generate (ctypes): {statistics.median(every):.1f} tok/s median, "
          f"{min(every):.1f} .. {max(every):.1f}")
    head = f"{'dialect':<12} {'tok/s':>8} {'÷ bare':>7} {'÷ bare, min .. max':>19}"
    if old_port is not None:
        head += f" {'before ÷ bare':>13} {'min .. max':>15} {'÷ before':>8} {'min .. max':>15}"
    print(head)
    for name in names:
        ratios = paired(bare[name], new[name])
        line = (f"{name:<12} {statistics.median(new[name]):>8.1f} "
                f"{statistics.median(ratios):>7.3f} {spread(ratios):>19}")
        if old_port is not None:
            olds, news = paired(bare[name], old[name]), paired(old[name], new[name])
            line += (f" {statistics.median(olds):>13.3f} {spread(olds):>15}"
                     f" {statistics.median(news):>8.3f} {spread(news):>15}")
        print(line)


if __name__ == "__main__":
    main()
