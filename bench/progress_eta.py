#!/usr/bin/env python3
"""How good a stream's first-token estimate is, and how fast a quote is answered.

    .venv/bin/python bench/progress_eta.py [--delay-ms 10] [--items 60] [--repeat 3] [CONTAINER]

`python3 -m serve --prefill-step 64 --heartbeat 0.25` at WASTE_DELAY_MS streams chat
requests of `--items` items of text (~13 tokens each on the demo container); each
`: prefill N/M {...}` comment's `first_token_seconds` is set against when the
first token came. Printed per request: the estimate's error after one chunk, and
its worst over the chunks (the last chunks' estimates are fractions of a second,
so their relative error is large); how many heartbeats carried a report, and the
error of the first one's, made before any chunk of this request ran (from the
rate earlier requests measured: none for the first request). Then `--repeat` quotes (`POST /v1/quote`) of
the same size on the idle server: the median and worst answer time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import DEMO, ROOT, machine, server

sys.path.insert(0, str(ROOT / "tests"))
from scripted import call, timed_blocks   # noqa: E402
from slow_clock import DIALECTS, prompt_text   # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--delay-ms", default="10")
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(machine())
    chat = DIALECTS["chat"]
    with server(Path(args.container), "--prefill-step", "64", "--no-prefix-cache",
                "--no-thinking", "--heartbeat", "0.25",
                env={"WASTE_DELAY_MS": args.delay_ms}) as port:
        for run in range(args.repeat):
            _, blocks = timed_blocks(port, chat.path, chat.body(prompt_text(args.items, f"b{run}")))
            first = next(at for at, block in blocks if chat.token(block))
            chunks, beats = [], []   # (error, evaluated) of each report
            for n, (at, block) in enumerate(blocks[:-1]):
                if block.startswith(": prefill "):
                    report = json.loads(block.split(" ", 3)[3])
                    eta = report["first_token_seconds"]
                    error = None if eta is None else (eta - (first - at)) / (first - at)
                    # a heartbeat's report goes out in the heartbeat's write, just before it
                    kind = beats if blocks[n + 1][1] == ": keepalive" else chunks
                    kind.append((error, report["evaluated"]))
            errors = [e for e, _ in chunks if e is not None]
            early = next((e for e, done in beats if done == 0), None)
            print(f"request {run}: {len(chunks)} chunk reports; after one chunk {errors[0]:+.1%}, "
                  f"worst {max(errors, key=abs):+.1%}; {len(beats)} heartbeat reports, "
                  f"before any chunk {'none' if early is None else format(early, '+.1%')}")
        took = []
        body = {"messages": [{"role": "user", "content": prompt_text(args.items, "quote")}]}
        for _ in range(max(args.repeat, 5)):
            sent = time.monotonic()
            assert call(port, "POST", "/v1/quote", body).status == 200
            took.append(time.monotonic() - sent)
        print(f"quote: median {statistics.median(took) * 1e3:.1f} ms, worst {max(took) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
