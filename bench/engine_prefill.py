#!/usr/bin/env python3
"""Prefill speed of the reference engine by position, before and after batched prefill, in one run.

    .venv/bin/python bench/engine_prefill.py [CONTAINER] [--ctx N] [--threads N] [--before COMMIT]
                                             [--before-lib PATH] [--no-agent]

CONTAINER defaults to the K3 demo container (build/demo.waste, `make build/demo.waste`).
The engine "before" is built from COMMIT (default: the last one before batched
prefill) in a temporary directory, or is --before-lib, a libwaste already built
that saves states in today's layout; "after" is ./libwaste.so (or --lib).

1. Prefill tokens/s of 512 positions starting at 0, 4K, 8K, 16K and 32K, both
   engines, at --ctx (default 65536).  The positions before a window are filled
   once, by the new engine, and handed to both as a saved state (rewritten in
   the old state layout for the old engine), so both attend to the same cache;
   each window is timed twice, the faster counts.
2. Expert bytes read from disk with a one-record expert cache, the same 512
   tokens as one chunk and one token at a time: what grouping saves.
3. The Claude Code-shaped request of tests/agents.py (24 tools, ~42K tokens on
   the demo vocabulary), prefilled by the new engine in chunks of 512 as the
   server does (--no-agent skips it; the old engine needs about 25 minutes).

Numbers are informative, never asserted.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from common import DEMO, PREVIOUS_ENGINE, ROOT, build_engine_at, machine

from serve import (Engine, EngineConfig, build_chat_segments, load_library,
                   parse_anthropic_request)  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from agents import claude_code_first_message, claude_code_request  # noqa: E402
from state_layout import HEADER, rewrite  # noqa: E402

WINDOW = 512
REPEAT = 2   # each window's best of two, for both engines: a shared machine is noisy
STARTS = (0, 4096, 8192, 16384, 32768)  # 8K: one of the goals


def timed_eval(engine: Engine, tokens: list[int]) -> float:
    started = time.perf_counter()
    engine.eval(tokens)
    return time.perf_counter() - started


def prefill(engine: Engine, tokens: list[int], chunk: int = WINDOW) -> None:
    for at in range(0, len(tokens), chunk):
        engine.eval(tokens[at:at + chunk])


def state_version(lib, container: Path, tmp: Path) -> int:
    """The version of the state files `lib` writes (and so reads)."""
    with Engine(lib, container, EngineConfig(ctx=16)) as engine:
        engine.eval([1])
        engine.save_state(tmp / "probe.state")
    return HEADER.unpack_from((tmp / "probe.state").read_bytes())[1]


def windows(old_lib, new_lib, container: Path, config: EngineConfig, tokens: list[int],
            tmp: Path, old_version: int, n_kv_heads: int) -> list[tuple[int, float, float]]:
    """(start, old tok/s, new tok/s) per window; the old engine gets each state the new one
    saved, rewritten as `old_version`."""
    starts = [start for start in STARTS if start + WINDOW <= config.ctx]  # those --ctx holds
    states = {}
    with Engine(new_lib, container, config) as engine:
        filled = 0
        for start in starts[1:]:   # fill up to each start once, keeping a state there
            prefill(engine, tokens[filled:start])
            filled = start
            states[start] = tmp / f"new-{start}.state"
            engine.save_state(states[start])
            rewrite(states[start], tmp / f"old-{start}.state", old_version, n_kv_heads)
    rows = []
    for start in starts:
        rates = []
        for lib, kind in ((old_lib, "old"), (new_lib, "new")):
            with Engine(lib, container, config) as engine:
                seconds = []
                for _ in range(REPEAT):
                    engine.reset()
                    if start:
                        engine.load_state(tmp / f"{kind}-{start}.state")
                    seconds.append(timed_eval(engine, tokens[start:start + WINDOW]))
                rates.append(WINDOW / min(seconds))
        rows.append((start, *rates))
    return rows


def expert_bytes(lib, container: Path, tokens: list[int]) -> tuple[float, float, int, int]:
    """(bytes per token read as one chunk, bytes per token read token by token, fetches of each)."""
    plan = lib.plan_memory(container, 4096)
    config = EngineConfig(ctx=4096, budget=plan.floor_bytes, usage_path=str(Path(tempfile.gettempdir())
                                                                          / "no-such-hotlist"))
    with Engine(lib, container, config) as engine:
        engine.eval(tokens)
        chunk = engine.stats()
        engine.reset()
        for token in tokens:
            engine.eval([token])
        single = engine.stats()
    per_token = single.bytes_read - chunk.bytes_read
    fetches = (chunk.experts_hit + chunk.experts_missed,
               single.experts_hit + single.experts_missed - chunk.experts_hit - chunk.experts_missed)
    return chunk.bytes_read / len(tokens), per_token / len(tokens), *fetches


def agent_prompt(engine: Engine) -> list[int]:
    body = claude_code_request([claude_code_first_message("Tidy up the README and run the tests.")])
    req = parse_anthropic_request(body).request
    segments = build_chat_segments(req.messages, req.tools, thinking=True,
                                   thinking_effort=req.thinking_effort)
    return engine.tokenize_segments(segments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=0, help="0: one per core")
    ap.add_argument("--before", default=PREVIOUS_ENGINE, help="the commit of the old engine")
    ap.add_argument("--before-lib", default=None,
                    help="an old engine already built (instead of --before)")
    ap.add_argument("--lib", default=None, help="the new engine (default ./libwaste.so)")
    ap.add_argument("--no-agent", action="store_true", help="skip the 42K-token agent prompt")
    args = ap.parse_args()
    container = Path(args.container)
    new_lib = load_library(args.lib)
    config = EngineConfig(ctx=args.ctx, threads=args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "old").mkdir()
        old_path = args.before_lib or str(build_engine_at(args.before, tmp / "old"))
        old_lib = load_library(old_path)
        manifest = json.loads((container / "manifest.json").read_text())
        n_kv_heads = manifest.get("n_kv_heads", manifest["n_heads"])
        old_version = state_version(old_lib, container, tmp)
        rng = random.Random(19)
        tokens = [rng.randrange(manifest["vocab_size"]) for _ in range(STARTS[-1] + WINDOW)]
        print(f"prefill by position, {container.name}, ctx {args.ctx}, threads "
              f"{args.threads or 'one per core'}: before {args.before_lib or args.before} ({old_lib.version()}), "
              f"after ({new_lib.version()}) — {machine()}")
        print(f"{'positions':<14} {'before tok/s':>13} {'after tok/s':>12} {'ratio':>7}")
        rows = windows(old_lib, new_lib, container, config, tokens, tmp, old_version, n_kv_heads)
        for start, old, new in rows:
            print(f"{f'{start}-{start + WINDOW}':<14} {old:>13.1f} {new:>12.1f} {new / old:>6.1f}x")
    chunk, single, fetched_chunk, fetched_single = expert_bytes(new_lib, container, tokens[:WINDOW])
    print(f"\nexpert bytes read per token, {WINDOW} tokens, a one-record expert cache:")
    print(f"  as one chunk       {chunk:>12.0f}  ({fetched_chunk} expert reads)")
    print(f"  one token at a time{single:>12.0f}  ({fetched_single} expert reads)")
    print(f"  ratio              {single / chunk:>12.1f}x")
    if not args.no_agent:
        with Engine(new_lib, container, config) as engine:
            ids = agent_prompt(engine)
            started = time.perf_counter()
            prefill(engine, ids)
            seconds = time.perf_counter() - started
        print(f"\nClaude Code-shaped request (tests/agents.py), {len(ids)} tokens, chunks of {WINDOW}: "
              f"prefilled in {seconds:.1f} s ({len(ids) / seconds:.0f} tok/s)")


if __name__ == "__main__":
    main()
