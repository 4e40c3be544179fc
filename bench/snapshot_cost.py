"""What a state snapshot costs against the prefill it spares, by conversation length.

    .venv/bin/python bench/snapshot_cost.py [CONTAINER] [--lib PATH] [--runs N]

For each length: the time to prefill it, to save its state (median of runs)
and to load it back, the file's size, and the save expressed as prefill
tokens, which is what the server's rule for snapshots after a reply weighs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import DEMO, Engine, EngineConfig, load_library, machine

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
    args = ap.parse_args()
    print(f"state snapshots — {machine()}")
    print(f"{'tokens':>7} {'prefill ms':>10} {'save ms':>8} {'load ms':>8} {'MB':>6} {'save = tokens':>13}")
    with Engine(load_library(args.lib), args.container, EngineConfig(ctx=8192)) as engine, \
            tempfile.TemporaryDirectory(prefix="bench-state-") as scratch:
        path = os.path.join(scratch, "state")
        words = engine.tokenize(TEXT * 600)
        for n in (500, 2000, 8000):
            engine.reset()
            prefill_s = timed(engine.eval, words[:n])
            save_s = statistics.median(timed(engine.save_state, path) for _ in range(args.runs))
            load_s = timed(engine.load_state, path)
            size = os.path.getsize(path)
            print(f"{n:>7} {prefill_s * 1e3:>10.1f} {save_s * 1e3:>8.2f} {load_s * 1e3:>8.2f} "
                  f"{size / 1e6:>6.2f} {save_s / (prefill_s / n):>13.1f}")


if __name__ == "__main__":
    main()
