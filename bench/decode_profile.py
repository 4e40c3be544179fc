#!/usr/bin/env python3
"""Where a decoded token's time goes, per operation, at several positions.

    .venv/bin/python bench/decode_profile.py [--positions 512,4096,16384] [--threads N]
                                             [--decode N] [--lib build/libwaste-profile.so]

The engine built with -DWASTE_PROFILE (`make build/libwaste-profile.so`,
engine/prof.h) times each operation of waste_generate's steps after the
prompt: the weight matrix products by stored format, the int16 quantisation
of their inputs, attention, norms, sampling and the token callback (here a
Python function through ctypes, as serve's).  Each position runs in a process
of its own (the totals are written at exit): the SmolLM2 container
(build/smollm2.waste) is prefilled to the position, then --decode greedy
tokens follow.  Printed: milliseconds per token and the share of the step;
with several threads also the time spent in the pool's chunks on the caller
and on the helpers, the caller's wait for the helpers at each job's end, and
how long after a job opens a helper joins it.
The timer costs about 0.03 ms per token; the plain build times nothing.
Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine

CONTAINER = ROOT / "build" / "smollm2.waste"
PROFILE_LIB = ROOT / "build" / "libwaste-profile.so"
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counted the ships "
        "that passed the island, and wrote their names in a book that nobody ever read. ")
ROWS = [("matmul_q4_1", "matmul q4_1 (attention, FFN)"), ("matmul_q8", "matmul q8 (output layer)"),
        ("matmul_f32", "matmul f32"), ("quantize", "int16 activation codes"),
        ("attention", "attention"), ("kv_store", "KV cache store"), ("norm", "RMSNorm"),
        ("rope", "rotary"), ("swiglu", "SwiGLU"), ("residual", "residual adds"),
        ("sample", "sampling (greedy + logprob)"), ("callback", "token callback (Python)")]

POOL_ROWS = [("chunk_caller", "caller's chunks (ms, count)"), ("chunk_helper", "helpers' chunks (ms, count)"),
             ("job_wait", "caller waiting for helpers")]


def child(lib_path: str, position: int, threads: int, decode: int) -> None:
    """Prefill to `position`, decode, report tokens/s on stdout; the library writes its totals."""
    sys.path.insert(0, str(ROOT))
    from serve import Engine, EngineConfig, GenParams, load_library
    lib = load_library(lib_path)
    with Engine(lib, CONTAINER, EngineConfig(ctx=position + decode + 16, threads=threads)) as engine:
        ids = engine.tokenize(TEXT * (position // 30 + 2))[:position]
        engine.eval(ids[:-1])
        stamps: list[float] = []
        engine.generate(ids[-1:], GenParams(max_tokens=decode + 1),
                        lambda info, piece: stamps.append(time.perf_counter()))
    print(json.dumps({"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", default="512,4096,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--lib", default=str(PROFILE_LIB))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.lib, args.child, args.threads, args.decode)
        return
    if not Path(args.lib).exists():
        raise SystemExit(f"{args.lib} is missing: make build/libwaste-profile.so")
    if not CONTAINER.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_model.py"), str(CONTAINER)], check=True)
    positions = [int(p) for p in args.positions.split(",")]
    columns: dict[int, dict] = {}
    for position in positions:
        with tempfile.NamedTemporaryFile(prefix="decode-profile-", suffix=".json") as out:
            env = {**os.environ, "WASTE_PROFILE": out.name}
            run = subprocess.run([sys.executable, __file__, "--child", str(position), "--lib", args.lib,
                                  "--threads", str(args.threads), "--decode", str(args.decode)],
                                 env=env, check=True, capture_output=True, text=True)
            totals = json.loads(Path(out.name).read_text())
        totals["tok_s"] = json.loads(run.stdout)["tok_s"]
        columns[position] = totals
    print(f"SmolLM2-135M Q4_1, {args.threads} thread(s), {args.decode} greedy tokens after each "
          f"position, ms per token (share of the step) — {machine()}")
    print(f"{'operation':<30}" + "".join(f" {p:>15}" for p in positions))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:<30}" + "".join(f" {v:>15}" for v in values))

    def per_token(totals: dict, key: str) -> float:
        return totals[key]["ns"] / 1e6 / totals["step"]["calls"]
    for key, label in ROWS:
        row(label, [f"{per_token(t, key):.3f} ({per_token(t, key) / per_token(t, 'step'):.0%})"
                    for t in columns.values()])
    rest = {p: per_token(t, "step") - sum(per_token(t, key) for key, _ in ROWS)
            for p, t in columns.items()}
    row("everything else", [f"{rest[p]:.3f} ({rest[p] / per_token(t, 'step'):.0%})"
                            for p, t in columns.items()])
    row("whole step", [f"{per_token(t, 'step'):.3f}" for t in columns.values()])
    row("tok/s (profiled)", [f"{t['tok_s']:.1f}" for t in columns.values()])
    if args.threads > 1:
        print("inside the pool's jobs, per token (not in the sums above):")
        for key, label in POOL_ROWS:
            row(label, [f"{per_token(t, key):.3f} ms, {t[key]['calls'] / t['step']['calls']:.0f}"
                        for t in columns.values()])
        row("helper's delay to join, mean", [
            f"{t['helper_join']['ns'] / 1e3 / max(t['helper_join']['calls'], 1):.2f} µs"
            for t in columns.values()])


if __name__ == "__main__":
    main()
