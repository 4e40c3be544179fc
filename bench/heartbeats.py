#!/usr/bin/env python3
"""The longest silence before the first token, per dialect, as each dialect's clients count it.

    .venv/bin/python bench/heartbeats.py [CONTAINER] [--delay-ms 9] [--heartbeat 1]
                                         [--items 60] [--checkout DIR]

Serves the container with the reference engine slowed to DELAY_MS per evaluated
token (WASTE_DELAY_MS: a 512-token prefill chunk lasts seconds, as one lasts
17 minutes on K3) and no prefix cache, then streams one request per dialect
through a raw socket. Silence is counted as the clients count it: any byte for
the openai clients, data events for Codex, events other than ping for Claude
Code. `--checkout DIR` runs another checkout's serve (e.g. main, before the
heartbeats; `--heartbeat 0` then passes no such flag), for a before and after.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DEMO, ROOT, machine

sys.path.insert(0, str(ROOT / "tests"))
from scripted import longest_silence, timed_blocks  # noqa: E402
from slow_clock import COUNTED_BY, DIALECTS, prompt_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container", nargs="?", default=str(DEMO))
    ap.add_argument("--delay-ms", type=float, default=9.0)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="0: pass no --heartbeat flag")
    ap.add_argument("--items", type=int, default=60, help="prompt size (about 13 tokens each)")
    ap.add_argument("--checkout", default=str(ROOT), help="the serve checkout to run")
    ap.add_argument("--lib", default=None)
    args = ap.parse_args()
    lib = os.path.abspath(args.lib) if args.lib else str(ROOT / "libwaste.so")
    flags = ["--heartbeat", str(args.heartbeat)] if args.heartbeat else []
    with tempfile.TemporaryDirectory(prefix="bench-heartbeats-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", os.path.abspath(args.container), "--lib", lib,
             "--port", "0", "--quiet", "--no-prefix-cache", "--usage", os.path.join(tmp, "usage"),
             *flags], cwd=args.checkout, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env={**os.environ, "WASTE_DELAY_MS": str(args.delay_ms),
                            "PYTHONDONTWRITEBYTECODE": "1"})   # another checkout stays as it is
        try:
            port = next((int(line.rsplit(":", 1)[1].split("/")[0]) for line in proc.stdout
                         if line.startswith("listen")), None)
            if port is None:
                raise SystemExit("the server did not start")
            print(f"# {machine()}; checkout {Path(args.checkout).name}, WASTE_DELAY_MS="
                  f"{args.delay_ms:g}, heartbeat {args.heartbeat:g} s")
            print(f"{'dialect':<12} {'counted as a sign of life':<30} {'first token':>11} "
                  f"{'longest silence':>15}")
            for name, dialect in DIALECTS.items():
                sent, blocks = timed_blocks(port, dialect.path,
                                            dialect.body(prompt_text(args.items, name)), timeout=3600)
                first = next(at for at, block in blocks if dialect.token(block)) - sent
                silence = longest_silence(sent, blocks, dialect.counts, dialect.token)
                print(f"{name:<12} {COUNTED_BY[name]:<30} {first:>10.1f}s {silence:>14.2f}s",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            proc.stdout.close()


if __name__ == "__main__":
    main()
