#!/usr/bin/env python3
"""Streaming overhead: decode tokens/s through /v1/chat/completions (SSE) versus a bare
ctypes waste_generate loop on the same library and container.

    .venv/bin/python bench/stream_overhead.py [CONTAINER] [--lib PATH] [--tokens N] [--runs N]
                                              [--before CHECKOUT]

The server runs in its own process, as in production; the client reads the
stream as a client would. Decode rate counts from the first streamed token to
the last, so prefill is excluded on both sides, and both run the same prompt
ids (the chat template rendered with thinking off). Prints a small table.
With --before, a second server runs another checkout's serve (say `git worktree
add /tmp/before main`) on the same library, and each round streams from both,
so that the two paths' per-token cost is compared pair by pair.
"""
from __future__ import annotations

import argparse
import os
import statistics
from contextlib import ExitStack
from pathlib import Path

from common import DEMO, decode_rate, machine, rate, server, split_cpus, stream_chat


def pin(cpus) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads on both sides (default 1: leaves a core to the client)")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout whose serve streams too, each round (a before-and-after)")
    args = ap.parse_args()
    body = {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": args.tokens, "temperature": 0, "reasoning_effort": "none"}
    bare, streamed, before, where = [], [], [], machine()
    server_cpus, client_cpus = split_cpus()
    flags = ("--ctx", "4096", "--no-prefix-cache", "--threads", str(args.threads))
    with ExitStack() as stack:
        port = stack.enter_context(server(args.container, *flags, lib=args.lib, cpus=server_cpus))
        old = None if args.before is None else stack.enter_context(
            server(args.container, *flags, lib=args.lib, cpus=server_cpus, root=args.before))
        for _ in range(args.runs):
            # The bare loop runs on the server's cores (virtual cores differ in
            # speed: the first often takes the interrupts), the client on the others.
            pin(server_cpus)
            bare.append(decode_rate(args.lib, args.container, body["messages"],
                                    threads=args.threads, max_tokens=args.tokens, ctx=4096)[0])
            pin(client_cpus)
            streamed.append(rate(stream_chat(port, body, keep_text=False).token_stamps))
            if old is not None:
                before.append(rate(stream_chat(old, body, keep_text=False).token_stamps))
    # Each streamed run is paired with the bare run just before it, so that
    # drift in the machine's speed cancels out of the ratio.
    ratios = sorted(s / b for b, s in zip(bare, streamed))
    print(f"streaming overhead, {args.tokens} tokens, {args.threads} engine thread(s), "
          f"{args.runs} paired runs — {where}")
    if server_cpus:
        print(f"server and bare loop on cpus {sorted(server_cpus)}, client on {sorted(client_cpus)}")
    print(f"{'path':<28} {'tok/s (median)':>14}")
    print(f"{'bare waste_generate (ctypes)':<28} {statistics.median(bare):>14.1f}")
    print(f"{'SSE /v1/chat/completions':<28} {statistics.median(streamed):>14.1f}")
    print(f"{'ratio, median of pairs':<28} {statistics.median(ratios):>14.3f}")
    print(f"{'ratio, min .. max':<28} {f'{ratios[0]:.3f} .. {ratios[-1]:.3f}':>14}")
    if before:
        olds = sorted(o / b for b, o in zip(bare, before))
        news = sorted(s / o for o, s in zip(before, streamed))
        print(f"{'SSE, --before checkout':<28} {statistics.median(before):>14.1f}")
        print(f"{'its ratio, median of pairs':<28} {statistics.median(olds):>14.3f}")
        print(f"{'this ÷ before, median':<28} {statistics.median(news):>14.3f}")
        print(f"{'this ÷ before, min .. max':<28} {f'{news[0]:.3f} .. {news[-1]:.3f}':>14}")


if __name__ == "__main__":
    main()
