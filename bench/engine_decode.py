#!/usr/bin/env python3
"""Greedy decode speed of libwaste through ctypes, at 1 thread and at one per core.

    .venv/bin/python bench/engine_decode.py [CONTAINER] [--lib PATH] [--tokens N]

Prints a small table; the numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import os

from common import DEMO, decode_rate, machine

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"engine decode, greedy, {args.tokens} tokens — {machine()}")
    print(f"{'threads':>7} {'tok/s':>9}")
    for threads in sorted({1, cores}):
        tok_s, _ = decode_rate(args.lib, args.container, PROMPT, threads=threads,
                               max_tokens=args.tokens)
        print(f"{threads:>7} {tok_s:>9.1f}")


if __name__ == "__main__":
    main()
