#!/usr/bin/env python3
"""The engine time a request costs when its prefix-cache lookup, and the shared tier's fetch,
are made while it waits, against the same lookup made on the engine, side by side.

    .venv/bin/python bench/lookup_before_queue.py [CONTAINER] [--lib PATH]
        [--tokens 16000] [--shared-mbps 50] [--ahead 2] [--runs 3]

One host prefills a conversation of `--tokens` positions and publishes its
snapshot to a shared directory; the shared directory is read at `--shared-mbps`
MB/s (an NFS mount's pace, emulated by pacing its reads). On a second host, with
an empty local tier, the conversation's next turn arrives while the engine is
busy for `--ahead` seconds (a request ahead of it); then the same turn again
(a local hit: the state's checksum is checked). Per way: the engine seconds the
turn held, its wall time from arrival, and the positions it restored.

- before: the lookup left to the engine (serve before the lookup moved: Prefill.restore
  hashes, verifies and fetches while holding the engine);
- after: the lookup made while the request waits (tiers.find), only rechecked on the engine.

The replies are compared: the two ways must answer alike.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from statistics import median
from typing import Any

from common import DEMO, ROOT, Quiet, machine

sys.path.insert(0, str(ROOT))
from serve import (Engine, EngineConfig, PrefixCache, Service, ServiceOptions,  # noqa: E402
                   load_library, parse_chat_request, resolve_chat_format)
from serve.core.work_classes import BACKGROUND, INTERACTIVE  # noqa: E402
from serve.snapshots import shared_dir  # noqa: E402
from serve.snapshots.shared_tier import SharedTier  # noqa: E402

IDENTITY = '{"bench": "lookup_before_queue"}'
TEXT = "The harbour master kept a ledger of every ship that passed the breakwater. "


def pace_shared_reads(mbps: float) -> None:
    """Reads of the shared directory at `mbps` MB/s, as over a network mount."""
    read = shared_dir.Reader.read

    def paced(reader: shared_dir.Reader, n: int) -> bytes:
        started = time.perf_counter()
        data = read(reader, n)
        left = len(data) / (mbps * 1e6) - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return data
    shared_dir.Reader.read = paced   # type: ignore[method-assign]


class Host:
    def __init__(self, stack: ExitStack, engine: Engine, lib: Any, container: str, root: str,
                 name: str):
        self.cache = PrefixCache(4 << 30, os.path.join(root, name), identity=IDENTITY)
        stack.callback(self.cache.close)
        self.cache.shared = SharedTier(os.path.join(root, "shared"), 8 << 30, IDENTITY)
        self.service = Service(engine, lib, resolve_chat_format(engine, container),
                               ServiceOptions(model_id="bench", thinking=False,
                                              prefix_cache=self.cache))
        stack.callback(self.service.close)

    def ask(self, messages: list) -> Any:
        body = {"messages": messages, "temperature": 0, "max_tokens": 8}
        return self.service.chat(parse_chat_request(body), Quiet())

    def published(self) -> None:
        """Wait for what the last reply queued for the team (not the next request's time)."""
        assert self.cache.shared is not None
        self.cache.shared.publisher.flush()

    def engine_seconds(self, work: str = INTERACTIVE) -> float:
        return self.service.queue.snapshot_counts()[work].engine_seconds


def turn(host: Host, messages: list, ahead: float) -> dict:
    """The request, arriving while the engine is busy for `ahead` seconds."""
    held = threading.Event()

    def busy() -> None:
        with host.service.queue.turn(Quiet(), BACKGROUND):   # the request ahead
            held.set()
            time.sleep(ahead)
    ahead_thread = threading.Thread(target=busy)
    ahead_thread.start()
    held.wait()
    before = host.engine_seconds()
    started = time.perf_counter()
    reply = host.ask(messages)
    wall = time.perf_counter() - started
    ahead_thread.join()
    host.published()
    return {"engine": host.engine_seconds() - before, "wall": wall,
            "cached": reply.usage.cached_tokens, "text": reply.message.get("content")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=16000, help="the conversation's length")
    ap.add_argument("--shared-mbps", type=float, default=50.0)
    ap.add_argument("--ahead", type=float, default=2.0, help="seconds the request ahead holds")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    lib = load_library(args.lib)
    engine = Engine(lib, args.container, EngineConfig(ctx=args.tokens + 1024))
    words = len(engine.tokenize(TEXT))
    first = [{"role": "system", "content": "You keep the harbour's records."},
             {"role": "user", "content": TEXT * (args.tokens // words)}]
    later = first + [{"role": "assistant", "content": "Noted."},
                     {"role": "user", "content": "Which ship came last?"}]
    pace_shared_reads(args.shared_mbps)
    print(f"lookup before the queue — {machine()}")
    with ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lookup-"))
        publisher = Host(stack, engine, lib, args.container, root, "publisher")
        publisher.ask(first)
        publisher.published()
        published = publisher.cache.shared.files.usage() if publisher.cache.shared else (0, 0)
        print(f"{args.tokens:,}-token conversation; shared tier: {published[0]} files, "
              f"{published[1] / 1e6:.1f} MB, read at {args.shared_mbps:g} MB/s; "
              f"{args.ahead:g} s of engine ahead of each request")
        print(f"median of {args.runs} runs, each on a fresh second host")
        print(f"{'way':<7} {'turn':<18} {'engine s':>9} {'wall s':>7} {'restored':>9}")
        texts = []
        for way in ("before", "after"):
            runs: dict[str, list[dict]] = {"fetched (shared)": [], "local hit (CRC)": []}
            for n in range(args.runs):
                host = Host(stack, engine, lib, args.container, root, f"{way}-{n}")
                if way == "before":
                    host.service._look_up = lambda prompt, run: None   # type: ignore[method-assign]
                for label in runs:
                    got = turn(host, later, args.ahead)
                    texts.append(got["text"])
                    runs[label].append(got)
            for label, got in runs.items():
                print(f"{way:<7} {label:<18} {median(g['engine'] for g in got):>9.3f} "
                      f"{median(g['wall'] for g in got):>7.3f} "
                      f"{median(g['cached'] for g in got):>9,.0f}")
        print("replies alike:", len(set(texts)) == 1)
    engine.close()


if __name__ == "__main__":
    main()
