#!/usr/bin/env python3
"""What a request that needs no engine waits while a long prefill (or a long reply) holds it:
count_tokens and a refused prompt (too long for the context), with serve's own tokenizer
and with --engine-tokenizer, side by side.

    .venv/bin/python bench/busy_answers.py [--delay-ms 10] [--items 215] [--n 3]
                                           [--during prefill|reply] [CONTAINER]

One streamed chat request prefills `--items` items of text (~16 tokens each on
the demo container) at WASTE_DELAY_MS (with `--during reply`: one streamed
completion samples some 2,900 tokens instead, a single waste_generate call,
measured once it has streamed 40); meanwhile `--n` count_tokens requests
and `--n` too-long chat requests go, alternately, one after another. Per
server: the median and the worst answer time, the prefill's length (what an
answer behind it would have waited), and how many answers came after the
prefill ended (0, or the figures do not measure a busy engine).
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

from common import DEMO, ROOT, machine, server

sys.path.insert(0, str(ROOT / "tests"))
from slow_clock import LongPrefill, Streamed, prompt_text  # noqa: E402

REPLY = {"prompt": "Once", "max_tokens": 3000, "temperature": 1.0, "seed": 1}   # ~2,900 tokens


def hold(port: int, during: str, items: int) -> Streamed:
    """The request that holds the engine, once it does."""
    if during == "prefill":
        long: Streamed = LongPrefill(port, items)
        long.holding.wait(120)
        return long
    long = Streamed(port, "/v1/completions", REPLY)
    deadline = time.monotonic() + 120
    while long.raw.count(b"data: {") < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    return long


def post(port: int, path: str, body: dict) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, time.perf_counter() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("container", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--delay-ms", type=float, default=10)
    parser.add_argument("--items", type=int, default=215)
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--during", choices=("prefill", "reply"), default="prefill")
    args = parser.parse_args()
    print(machine())
    print(f"{'tokenizer':<10} {'request':<13} {'status':>6} {'median ms':>10} {'worst ms':>9} "
          f"{args.during + ' s':>10} {'late':>5}")
    too_long = {"messages": [{"role": "user", "content": prompt_text(400, "long")}]}
    count = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    for name, flags in (("serve's", ()), ("engine's", ("--engine-tokenizer",))):
        with server(args.container, "--ctx", "4096", "--no-prefix-cache", "--no-finish-abandoned",
                    *flags, env={"WASTE_DELAY_MS": str(args.delay_ms)}) as port:
            started = time.perf_counter()
            long = hold(port, args.during, args.items)
            kinds = (("count_tokens", "/v1/messages/count_tokens", count),
                     ("too long", "/v1/chat/completions", too_long))
            answers: dict[str, list[tuple[int, float, bool]]] = {label: [] for label, _, _ in kinds}
            for _ in range(args.n):
                for label, path, body in kinds:
                    status, took = post(port, path, body)
                    answers[label].append((status, took, long.ended.is_set()))
            long.ended.wait(600)
            prefill = time.perf_counter() - started
            long.close()
            for label, rows in answers.items():
                times = [took for _, took, _ in rows]
                print(f"{name:<10} {label:<13} {rows[0][0]:>6} {statistics.median(times) * 1000:>10.1f} "
                      f"{max(times) * 1000:>9.1f} {prefill:>10.1f} {sum(late for *_, late in rows):>5}")


if __name__ == "__main__":
    main()
