#!/usr/bin/env python3
"""What serve's reading of a reply costs the engine's thread per token, in place.

    .venv/bin/python bench/token_path.py [CONTAINER] [--lib PATH] [--tokens N] [--rounds N]

One process, one warm engine, one core: greedy runs of N tokens through
ctypes, taking turns, with a token callback that only keeps the token (as
the bare loop of bench/stream_overhead.py keeps its time) and one that also reads each token as
a chat stream's job does (serve/service/reply_reader.py's ChatReader into a
serve/service/journal.py Journal, the chat format the container speaks).
Each reading run sits between two bare runs and is set against their mean,
so the machine's drift cancels; it prints the median of those paired
differences and their quartiles, beside the same reading replayed on the
run's tokens alone (hot in the caches, the best of the rounds).  The gap
between the two is what interleaving with the engine costs the interpreter.

Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Callable

from common import DEMO, Engine, EngineConfig, GenParams, build_chat_segments, load_library, machine
from dialect_streams import QUESTION

from serve.formats.format_choice import resolve_chat_format
from serve.service.journal import Journal
from serve.service.reply_reader import ChatReader


def quartiles(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"{statistics.median(ordered):+6.1f} "
            f"({ordered[len(ordered) // 4]:+.1f} .. {ordered[3 * len(ordered) // 4]:+.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    where = machine()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with Engine(load_library(args.lib), args.container, EngineConfig(threads=1, ctx=4096)) as engine:
        chat = resolve_chat_format(engine, args.container)
        ids = engine.tokenize_segments(build_chat_segments([{"role": "user", "content": QUESTION}],
                                                           thinking=False))
        params = GenParams(max_tokens=args.tokens, stop_tokens=tuple(chat.stop_tokens))

        def reader() -> Callable[[int, bytes], bool]:
            journal = Journal(threading.Event())
            reading = ChatReader(chat.new_parser(False), [], chat.stop_tokens)
            return lambda token, piece: reading.feed(token, piece, journal.emit)

        def run(on_token: Callable[[int, bytes], bool]) -> tuple[float, list[tuple[int, bytes]]]:
            """µs a token, and the tokens."""
            seen: list[tuple[int, bytes]] = []

            def callback(info, piece: bytes) -> bool:
                seen.append((info.token, piece))
                return on_token(info.token, piece)
            engine.reset()
            started = time.perf_counter()
            engine.generate(ids, params, callback)
            return (time.perf_counter() - started) / len(seen) * 1e6, seen

        def bare() -> float:
            return run(lambda token, piece: False)[0]

        bare()   # warm: the first run reads the experts
        differences, bares, replays = [], [], []
        for _ in range(args.rounds):
            before = bare()
            read_us, tokens = run(reader())
            after = bare()
            bares.append((before + after) / 2)
            differences.append(read_us - bares[-1])
            feed = reader()
            started = time.perf_counter()
            for token, piece in tokens:
                feed(token, piece)
            replays.append((time.perf_counter() - started) / len(tokens) * 1e6)
    print(f"reading a chat reply on the engine's thread, {args.tokens} tokens, "
          f"{args.rounds} paired rounds — {where}")
    print(f"bare loop: {statistics.median(bares):.0f} µs a token")
    print(f"reading, in place (µs a token more, median (quartiles)): {quartiles(differences)}")
    print(f"the same reading replayed alone (best round): {min(replays):.2f} µs a token")


if __name__ == "__main__":
    main()
