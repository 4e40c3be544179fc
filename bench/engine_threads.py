#!/usr/bin/env python3
"""The thread pool's two constants, measured: the work threshold and the spin time.

    .venv/bin/python bench/engine_threads.py [--threads N] [--rounds N] [--spins US,US,...]

1. bench/pool_threshold.c, built against engine/ with the threshold at 0:
   the time of q4_1 matrix-vector products of growing size on one thread and
   on N, helpers hot.  WPOOL_WORK_THRESHOLD in engine/pool.c is where a
   second thread starts to pay.  Then a decode step's shapes from memory
   (matrices past the caches, as a step meets them), each beside a plain
   read of its bytes through the pool: what N threads gain on runs that short.
2. Greedy decode on the SmolLM2 demo container (build/smollm2.waste, as
   bench/vs_llamacpp.py) with N threads, on libwaste built with each
   WPOOL_SPIN_US of --spins (how long an idle helper polls before it
   sleeps).  The builds take turns, --rounds times; medians.

Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine

from serve import Engine, EngineConfig, GenParams, load_library

CONTAINER = ROOT / "build" / "smollm2.waste"
TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 40


def build_with(directory: Path, defines: list[str]) -> Path:
    """./libwaste.so's sources built into directory with extra -D defines."""
    lib = directory / "libwaste.so"
    subprocess.run(["make", "-s", "-C", str(ROOT), f"LIB={lib}", str(lib),
                    f"CFLAGS=-O2 -g {' '.join('-D' + d for d in defines)}"], check=True)
    return lib


def threshold_table(threads: int, directory: Path) -> None:
    exe = directory / "pool_threshold"
    sources = sorted(str(p) for p in (ROOT / "engine").glob("*.c"))
    subprocess.run(["cc", "-std=c11", "-O2", "-D_GNU_SOURCE", "-DWPOOL_WORK_THRESHOLD=0",
                    f"-I{ROOT / 'engine'}", "-o", str(exe), str(ROOT / "bench" / "pool_threshold.c"),
                    *sources, "-lm", "-lpthread", "-lz"], check=True)
    print(subprocess.run([str(exe), str(threads)], check=True, capture_output=True,
                         text=True).stdout, end="")


def decode_rates(libs: dict[str, Path], threads: int, rounds: int, tokens: int) -> dict[str, list]:
    """tokens/s of each build, taking turns: 255 prompt tokens, then `tokens` greedy ones."""
    engines = {name: Engine(load_library(str(lib)), CONTAINER, EngineConfig(ctx=1024, threads=threads))
               for name, lib in libs.items()}
    prompt = next(iter(engines.values())).tokenize(TEXT)[:256]
    rates: dict[str, list] = {name: [] for name in libs}
    try:
        for _ in range(rounds):
            for name, engine in engines.items():
                engine.reset()
                engine.eval(prompt[:-1])
                stamps: list[float] = []
                engine.generate(prompt[-1:], GenParams(max_tokens=tokens + 1),
                                lambda info, piece: stamps.append(time.perf_counter()))
                rates[name].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    finally:
        for engine in engines.values():
            engine.close()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cores)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--spins", default="0,50,200,1000,5000", help="WPOOL_SPIN_US values, microseconds")
    args = ap.parse_args()
    print(f"{machine()}\n\nq4_1 products of 576 columns, helpers hot:")
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        threshold_table(args.threads, Path(tmp))
        libs = {}
        for us in args.spins.split(","):
            (Path(tmp) / us).mkdir()
            libs[us] = build_with(Path(tmp) / us, [f"WPOOL_SPIN_US={us}"])
        rates = decode_rates(libs, args.threads, args.rounds, args.tokens)
    print(f"\ndecode tok/s, {args.threads} threads, {args.tokens} tokens after 255, "
          f"median of {args.rounds} turns:")
    for us, runs in rates.items():
        print(f"  spin {us:>5} us: {statistics.median(runs):6.1f}   "
              f"(runs {', '.join(f'{r:.0f}' for r in sorted(runs))})")


if __name__ == "__main__":
    sys.exit(main())
