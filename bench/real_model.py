#!/usr/bin/env python3
"""Decode and prefill speed of the reference engine on SmolLM2-135M-Instruct, one thread.

    .venv/bin/python bench/real_model.py [CONTAINER] [--lib PATH] [--tokens N]

CONTAINER defaults to build/smollm2.waste (`make demo` or tools/fetch_model.py
writes it).  Two memory settings: the whole model in RAM, and a budget whose
expert cache holds a third of the FFNs, so the rest stream from disk (hit
rate and bytes read shown), once with no expert hotlist and once with the
hotlist the all-in-RAM run learned (each run gets its own, never the
container's).  Rates are wall-clock; "per CPU-s" divides by the
process's CPU time instead, which a loaded machine disturbs less.  Numbers
are informative, never asserted.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import ROOT, machine

from serve import Engine, EngineConfig, GenParams, load_library  # noqa: E402

PROMPT = ("<|im_start|>user\nWrite a long story about a lighthouse keeper who counts the ships "
          "that pass his island every night.<|im_end|>\n<|im_start|>assistant\n")
PREFILL_TEXT = " ".join(["The lighthouse keeper climbed the spiral stairs every evening at dusk."] * 12)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of fn()."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def measure(lib, container: Path, budget: int, tokens: int, usage: Path) -> dict:
    """Prefill and decode rates; the engine warms from, and saves, the hotlist at usage."""
    config = EngineConfig(threads=1, ctx=1024, budget=budget, usage_path=str(usage))
    with Engine(lib, container, config) as engine:
        prefill_ids = engine.tokenize(PREFILL_TEXT)
        wall, cpu = timed(lambda: engine.eval(prefill_ids))
        prefill = (len(prefill_ids) / wall, len(prefill_ids) / cpu)
        engine.reset()
        stamps: list[tuple[float, float, int, int, int]] = []

        def on_token(info, piece) -> bool:
            s = engine.stats()
            stamps.append((time.perf_counter(), time.process_time(), s.experts_hit,
                           s.experts_missed, s.bytes_read))
            return False

        # Timed from the first generated token to the last: decoding only.
        engine.generate(engine.tokenize(PROMPT, markup=True), GenParams(max_tokens=tokens), on_token)
        engine.save_usage()
    (w0, c0, h0, m0, b0), (w1, c1, h1, m1, b1) = stamps[0], stamps[-1]
    n = len(stamps) - 1
    return {"prefill": prefill, "decode": (n / (w1 - w0), n / (c1 - c0)),
            "hit_rate": (h1 - h0) / max(1, h1 - h0 + m1 - m0), "mb_per_token": (b1 - b0) / n / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(ROOT / "build" / "smollm2.waste"))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    container = Path(args.container)
    lib = load_library(args.lib)
    manifest = json.loads((container / "manifest.json").read_text())
    plan = lib.plan_memory(container, 1024)
    ffns = manifest["n_layers"] - manifest["n_dense_layers"]
    # The floor holds one record: add records until a third of the FFNs fit.
    third = plan.floor_bytes + (ffns // 3 - 1) * plan.min_expert_cache
    print(f"{manifest['flavour']}, 1 thread, {args.tokens} decoded tokens — {machine()}")
    print(f"{'memory':<22} {'prefill tok/s':>14} {'per CPU-s':>10} {'decode tok/s':>13} "
          f"{'per CPU-s':>10} {'FFN hit rate':>13} {'MB read/token':>14}")
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
        learned, cold = Path(tmp) / "learned.waste", Path(tmp) / "cold.waste"
        runs = (("all in RAM", plan.recommended_bytes, learned),
                (f"{ffns // 3}/{ffns} FFNs, no hotlist", third, cold),
                (f"{ffns // 3}/{ffns} FFNs, hotlist", third, learned))
        for name, budget, usage in runs:
            r = measure(lib, container, budget, args.tokens, usage)
            print(f"{name:<22} {r['prefill'][0]:>14.1f} {r['prefill'][1]:>10.1f} "
                  f"{r['decode'][0]:>13.1f} {r['decode'][1]:>10.1f} {r['hit_rate']:>13.0%} "
                  f"{r['mb_per_token']:>14.2f}")


if __name__ == "__main__":
    main()
