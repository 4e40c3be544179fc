#!/usr/bin/env python3
"""Greedy decode speed of libwaste through ctypes, at 1 thread and at one per core.

    bench/engine_decode.py [CONTAINER] [--lib PATH] [--tokens N] [--ctx N]

Expects an already built ./libwaste.so and a container (default
build/demo.waste; `make build/demo.waste` writes it).  Prints a small table;
the numbers are informative only.
"""
from __future__ import annotations

import argparse
import ctypes as C
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_abi import OK, Stats, detail_of, gen_params, load_library, opened, \
    tokenize, TOKEN_CB  # noqa: E402  (the ctypes mirror of waste.h lives with the ABI tests)

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk."


def decode_rate(lib: C.CDLL, container: Path, threads: int, n_tokens: int, ctx_tokens: int) -> dict:
    """Tokens/s between the first and the last generated token (prefill excluded)."""
    stamps: list[float] = []
    io_ms = [0.0]

    def on_token(info, _piece, _user) -> int:
        stamps.append(time.perf_counter())
        io_ms[0] += info.contents.ms_io
        return 0

    with opened(lib, container, n_threads=threads, ctx_tokens=ctx_tokens) as ctx:
        prompt = tokenize(lib, ctx, PROMPT, bos=True)
        params = gen_params(lib, max_tokens=n_tokens)
        status = lib.waste_generate(ctx, (C.c_int32 * len(prompt))(*prompt), len(prompt),
                                    C.byref(params), TOKEN_CB(on_token), None)
        if status != OK:
            raise SystemExit(f"waste_generate failed ({status}): {detail_of(lib, ctx)}")
        stats = Stats()
        lib.waste_get_stats(ctx, C.byref(stats))
    seconds = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    lookups = stats.experts_hit + stats.experts_missed
    return {"threads": threads, "tokens": len(stamps), "tok_s": (len(stamps) - 1) / seconds,
            "hit_rate": stats.experts_hit / lookups if lookups else 0.0,
            "mb_read": stats.bytes_read / 1e6, "direct_io": stats.direct_io}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", type=Path, nargs="?", default=ROOT / "build" / "demo.waste")
    ap.add_argument("--lib", type=Path, default=ROOT / "libwaste.so")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args(argv)
    if not args.lib.exists():
        ap.error(f"{args.lib} is not built (run `make`)")
    if not (args.container / "manifest.json").exists():
        ap.error(f"{args.container} is not a container (run `make build/demo.waste`)")
    lib = load_library(args.lib)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(lib.waste_build_info().decode())
    print(f"{'threads':>7} {'tokens':>6} {'tok/s':>9} {'hit rate':>8} {'MB read':>8} {'direct':>6}")
    for threads in sorted({1, cores}):
        r = decode_rate(lib, args.container, threads, args.tokens, args.ctx)
        print(f"{r['threads']:>7} {r['tokens']:>6} {r['tok_s']:>9.1f} {r['hit_rate']:>8.1%} "
              f"{r['mb_read']:>8.2f} {'yes' if r['direct_io'] else 'no':>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
