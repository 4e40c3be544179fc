#!/usr/bin/env python3
"""Prefill cost per position by step size: what one call to waste_eval should hand the engine.

    .venv/bin/python bench/prefill_step.py [CONTAINER] [--lib PATH] [--positions N] [--repeat N]

serve hands a prompt to the engine in steps (serve/service/prefill.py): a step
is the longest the engine is held without a chance to preempt a chore, notice
a hang-up or serve a waiting request, so it should be no longer than the
engine's own batch. This measures, side by side on one engine, the seconds per
position of prefilling the same N positions (default 2048) from empty in steps
of 64 to 1024 (64: WARP's batch; 512: the reference engine's default), and from position 4096 on (where attention costs more); each
figure is the best of --repeat runs (a shared machine is noisy).

WARP's libwaste evaluates at most 64 positions per internal step
(WASTE_CHUNK_MAX in its src/model.h), so a longer call cannot be cheaper per
position there; it cannot be measured on this machine (no WARP build, no K3).
Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import random
import time

from common import DEMO, machine

from serve import Engine, EngineConfig, load_library  # noqa: E402

STEPS = (64, 128, 256, 512, 1024)
SENTENCE = "The harbour master kept a ledger of every ship that passed the breakwater at dawn"
OFFSETS = (0, 4096)


def seconds_per_position(engine: Engine, prefix: list[int], tokens: list[int], step: int) -> float:
    """Prefill `tokens` after `prefix` (restored, not timed) in steps of `step`."""
    engine.reset()
    for at in range(0, len(prefix), 512):
        engine.eval(prefix[at:at + 512])
    started = time.perf_counter()
    for at in range(0, len(tokens), step):
        engine.eval(tokens[at:at + step])
    return (time.perf_counter() - started) / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    lib = load_library(args.lib)
    engine = Engine(lib, args.container, EngineConfig(ctx=max(OFFSETS) + args.positions + 8))
    words = random.Random(7).choices(SENTENCE.split(), k=4 * (max(OFFSETS) + args.positions))
    ids = engine.tokenize(" ".join(words), markup=False, add_bos=False)
    ids = ids[:max(OFFSETS) + args.positions]
    print(f"engine   libwaste {lib.version()} — {lib.build_info()}")
    print(f"machine  {machine()}")
    print(f"{'from position':>14} {'step':>6} {'ms/position':>12} {'vs 512':>8}")
    try:
        for offset in OFFSETS:
            prefix, tokens = ids[:offset], ids[offset:offset + args.positions]
            best = {step: min(seconds_per_position(engine, prefix, tokens, step)
                              for _ in range(args.repeat)) for step in STEPS}
            for step in STEPS:
                print(f"{offset:>14} {step:>6} {best[step] * 1000:>12.3f} "
                      f"{best[step] / best[512]:>7.2f}x")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
