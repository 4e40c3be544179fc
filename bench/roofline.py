#!/usr/bin/env python3
"""Decode against the machine's memory bandwidth: how close to the roofline it runs.

    .venv/bin/python bench/roofline.py [--threads N] [--runs N] [--lib PATH] [--before PATH]

bench/bandwidth.c (built here with the system cc) measures a plain read and
a memcpy over buffers far past the caches, on one thread and on N.  Then
greedy decode on the SmolLM2 demo container (build/smollm2.waste, as
bench/vs_llamacpp.py: 128 tokens after a 512-token prompt) on one thread and
on N, --runs turns each, medians.  A decoded token reads every weight it
uses once: the whole trunk (with tied embeddings the output layer reads the
table) and top_k experts of each expert bank; that many bytes per token
times tokens/s is the bandwidth decode draws, shown against the read
bandwidth.  The KV cache it also reads is shown apart.  --before measures
another library in the same turns, each of its runs right before this one's,
and gives this ÷ before turn by turn.

Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine

from serve import Engine, EngineConfig, GenParams, load_library

CONTAINER = ROOT / "build" / "smollm2.waste"
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counted the ships "
        "that passed the island, and wrote their names in a book that nobody ever read. ")
PROMPT, DECODE = 512, 128


def bandwidth(threads: list[int]) -> dict[tuple[str, int], float]:
    """{(read|copy, threads): GB/s}."""
    with tempfile.TemporaryDirectory(prefix="bench-bandwidth-") as tmp:
        exe = Path(tmp) / "bandwidth"
        subprocess.run(["cc", "-std=c11", "-O3", "-march=native", "-o", str(exe),
                        str(ROOT / "bench" / "bandwidth.c"), "-lpthread"], check=True)
        out = {}
        for n in threads:
            lines = subprocess.run([str(exe), str(n)], check=True, capture_output=True, text=True).stdout
            for line in lines.splitlines():
                row = json.loads(line)
                out[(row["test"], n)] = row["gb_per_s"]
    return out


def weight_bytes_per_token(container: Path) -> int:
    """The trunk, plus top_k records' payload from each expert bank."""
    manifest = json.loads((container / "manifest.json").read_text())
    total = (container / "trunk.bin").stat().st_size
    for bank in sorted((container / "experts").glob("layer-*.bank")):
        payload = struct.unpack_from("<I", bank.read_bytes()[:32], 20)[0]
        total += manifest["top_k"] * payload
    return total


def kv_bytes_per_token(lib, container: Path, position: int) -> int:
    """Keys and values of `position` earlier tokens, every layer, in the library's own number
    format: its state for a context of 4096, per position."""
    return lib.plan_memory(container, 4096).state_bytes * position // 4096


def decode_rate(lib, threads: int, prompt: list[int]) -> float:
    with Engine(lib, CONTAINER, EngineConfig(ctx=PROMPT + DECODE + 16, threads=threads)) as engine:
        engine.eval(prompt[:-1])
        stamps: list[float] = []
        engine.generate(prompt[-1:], GenParams(max_tokens=DECODE + 1),
                        lambda info, piece: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cores)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lib", default=None, help="libwaste to measure (default ./libwaste.so)")
    ap.add_argument("--before", default=None, help="another libwaste, measured in the same turns")
    args = ap.parse_args()
    if not CONTAINER.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_model.py"), str(CONTAINER)], check=True)
    counts = sorted({1, args.threads})
    bw = bandwidth(counts)
    lib = load_library(args.lib)
    with Engine(lib, CONTAINER, EngineConfig(ctx=64)) as engine:
        prompt = engine.tokenize(TEXT * 40)[:PROMPT]
    before = load_library(args.before) if args.before else None
    rates: dict[int, list[float]] = {n: [] for n in counts}
    before_rates: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.runs):
        for n in counts:
            if before is not None:
                before_rates[n].append(decode_rate(before, n, prompt))
            rates[n].append(decode_rate(lib, n, prompt))
    weights = weight_bytes_per_token(CONTAINER)
    kv = kv_bytes_per_token(lib, CONTAINER, PROMPT + DECODE // 2)
    print(f"SmolLM2-135M-Instruct Q4_1 container, libwaste {lib.version()} — {machine()}")
    print(f"weights read per token: {weights / 1e6:.1f} MB; KV cache at the mean position "
          f"{PROMPT + DECODE // 2}: {kv / 1e6:.1f} MB")
    print(f"{'threads':>7} {'read GB/s':>10} {'copy GB/s':>10} {'decode tok/s':>13} "
          f"{'weights GB/s':>13} {'of read':>8} {'+KV GB/s':>9}")
    for n in counts:
        tps = statistics.median(rates[n])
        drawn = weights * tps / 1e9
        print(f"{n:>7} {bw[('read', n)]:>10.2f} {bw[('copy', n)]:>10.2f} {tps:>13.1f} {drawn:>13.2f} "
              f"{drawn / bw[('read', n)]:>7.0%} {(weights + kv) * tps / 1e9:>9.2f}")

    if before is not None:
        print(f"before: {before.version()} ({args.before})")
        print(f"{'threads':>7} {'before tok/s':>13} {'of read':>8} {'this / before':>14} {'min .. max':>14}")
        for n in counts:
            tps = statistics.median(before_rates[n])
            pairs = [a / b for a, b in zip(rates[n], before_rates[n])]
            print(f"{n:>7} {tps:>13.1f} {weights * tps / 1e9 / bw[('read', n)]:>7.0%} "
                  f"{statistics.median(pairs):>14.3f} {min(pairs):>6.3f} .. {max(pairs):.3f}")


if __name__ == "__main__":
    main()
