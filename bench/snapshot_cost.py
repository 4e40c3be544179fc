#!/usr/bin/env python3
"""What a state snapshot costs against the prefill it spares, by conversation length.

    .venv/bin/python bench/snapshot_cost.py [CONTAINER] [--lib PATH] [--runs N]
        [--lengths 500,2000,8000] [--delay-ms MS]

For each length: the time to prefill it, to save its state (median of runs)
and to load it back, the file's size, the save expressed as prefill tokens,
and what serve's snapshot policy (serve/snapshots/policy.py) would choose from
these costs: the prefill between two progress snapshots, and the least a
checkpoint must spare. --delay-ms runs the engine at a slower clock
(WASTE_DELAY_MS; K3's is 2128: use short lengths).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import DEMO, Engine, EngineConfig, load_library, machine

from serve import Costs

TEXT = "The harbour master kept a ledger of every ship that passed the breakwater. "


def timed(call, *args) -> float:
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lengths", default="500,2000,8000", help="comma-separated token counts")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="WASTE_DELAY_MS (K3: 2128)")
    args = ap.parse_args()
    if args.delay_ms:
        os.environ["WASTE_DELAY_MS"] = f"{args.delay_ms:g}"   # read by waste_open
    print(f"state snapshots — {machine()}; WASTE_DELAY_MS={args.delay_ms:g}")
    print(f"{'tokens':>7} {'prefill ms':>10} {'save ms':>8} {'load ms':>8} {'MB':>6} {'save = tokens':>13} "
          f"{'progress every':>14} {'checkpoint >':>12}")
    with Engine(load_library(args.lib), args.container, EngineConfig(ctx=8192)) as engine, \
            tempfile.TemporaryDirectory(prefix="bench-state-") as scratch:
        path = os.path.join(scratch, "state")
        words = engine.tokenize(TEXT * 600)
        for n in map(int, args.lengths.split(",")):
            engine.reset()
            prefill_s = timed(engine.eval, words[:n])
            save_s = statistics.median(timed(engine.save_state, path) for _ in range(args.runs))
            load_s = timed(engine.load_state, path)
            size = os.path.getsize(path)
            policy = Costs(token_seconds=prefill_s / n, save_seconds=save_s, load_seconds=load_s)
            print(f"{n:>7} {prefill_s * 1e3:>10.1f} {save_s * 1e3:>8.2f} {load_s * 1e3:>8.2f} "
                  f"{size / 1e6:>6.2f} {save_s / (prefill_s / n):>13.1f} {policy.spacing():>14} "
                  f"{policy.break_even():>12}")


if __name__ == "__main__":
    main()
