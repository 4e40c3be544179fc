#!/usr/bin/env python3
"""Where a streamed token's time goes in the server: cProfile on every server thread.

    .venv/bin/python bench/stream_profile.py [CONTAINER] [--lib PATH] [--tokens N]
                                             [--dialect NAME] [--top N]

Streams N tokens in one dialect from a server whose threads each run under
cProfile (bench/profiled/sitecustomize.py: no such code is in serve), then
prints, per kind of thread (the job's, the connection's, the stream writer's),
the functions that cost most of their own time, per generated token. cProfile
slows Python several times over, so the figures rank the costs; they are not
the costs themselves.
"""
from __future__ import annotations

import argparse
import glob
import os
import pstats
import re
import tempfile
from pathlib import Path

from common import DEMO, machine, server
from dialect_streams import DIALECTS, QUESTION, stream

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--lib", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dialect", default="chat", choices=list(DIALECTS))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    dialect = DIALECTS[args.dialect]
    body = dialect.body([{"role": "user", "content": QUESTION}], QUESTION, args.tokens)
    with tempfile.TemporaryDirectory(prefix="stream-profile-") as out:
        env = {"PYTHONPATH": str(HERE / "profiled"), "SERVE_PROFILE_DIR": out}
        with server(args.container, "--ctx", "4096", "--no-prefix-cache", "--threads", "1",
                    lib=args.lib, env=env) as port:
            stream(port, dialect, body)    # warm: the first request's imports and expert reads
            for path in glob.glob(os.path.join(out, "*.prof")):
                os.unlink(path)
            _, generated = stream(port, dialect, body)
        # Threads of one kind are named alike up to their numbers (job-3, Thread-7).
        kinds: dict[str, list[str]] = {}
        for path in sorted(glob.glob(os.path.join(out, "*.prof"))):
            kind = re.sub(r"[-_ ]?\d+", "", Path(path).stem.rsplit("-", 1)[0]) or "thread"
            kinds.setdefault(kind, []).append(path)
        print(f"cProfile of the server's threads, {generated} tokens streamed in {args.dialect} "
              f"— {machine()}")
        for kind, paths in kinds.items():
            stats = pstats.Stats(*paths)
            rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])   # own time
            total = sum(row[2] for _, row in stats.stats.items())
            print(f"\n{kind} ({len(paths)} thread(s)): {total / generated * 1e6:.1f} µs per token "
                  f"under the profiler")
            print(f"  {'µs/token':>8} {'calls/token':>11}  function")
            for (file, line, name), (_, calls, own, _, _) in rows[:args.top]:
                where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
                print(f"  {own / generated * 1e6:>8.2f} {calls / generated:>11.2f}  {name} ({where})")


if __name__ == "__main__":
    main()
