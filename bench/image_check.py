#!/usr/bin/env python3
"""What serve's pixel check before the queue (serve/service/image_check.py) costs, on the
largest images a client may send: 32 MB files, the most pixels an engine takes, and a
bomb (a small file whose zlib stream inflates past its rows).

    .venv/bin/python bench/image_check.py [--runs 3]

Each image is made in memory, then checked `--runs` times; the best time is printed with
the file's size and what its data inflates to (or would, for the bomb).
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

from common import ROOT, machine

sys.path.insert(0, str(ROOT))
from serve import Undecodable, check_pixels  # noqa: E402

MB = 1 << 20


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png(w: int, h: int, depth: int, ctype: int, stream: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", w, h, depth, ctype, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream)
            + chunk(b"IEND", b""))


def noise_png() -> tuple[bytes, int]:
    """3,300 x 3,300 RGB noise: a 32 MB file inflating to about as much."""
    w = h = 3300
    row = w * 3 + 1
    raw = b"".join(b"\0" + os.urandom(row - 1) for _ in range(h))
    return png(w, h, 8, 2, zlib.compress(raw, 1)), len(raw)


def photo_like_png() -> tuple[bytes, int]:
    """8,192 x 8,192 RGBA (the most pixels WARP takes): runs and noise, ~32 MB."""
    w = h = 8192
    row = w * 4
    noisy = os.urandom(row // 8)
    line = b"\x01" + (noisy + bytes(row // 8 * 7))
    raw = line * h
    return png(w, h, 8, 6, zlib.compress(raw, 1)), len(raw)


def largest_png() -> tuple[bytes, int]:
    """8,192 x 8,192 RGBA at 16 bits, all zero: the most an engine's header admits, tiny on disk."""
    w = h = 8192
    row = w * 8 + 1
    z = zlib.compressobj(9)
    blank = bytes(row)
    stream = b"".join(z.compress(blank) for _ in range(h)) + z.flush()
    return png(w, h, 16, 6, stream), row * h


def bomb_png() -> tuple[bytes, int]:
    """A bomb: a 64 x 64 header over 1 GB of zeros."""
    z = zlib.compressobj(9)
    block = bytes(MB)
    stream = b"".join(z.compress(block) for _ in range(1024)) + z.flush()
    return png(64, 64, 8, 2, stream), 1024 * MB


def best(check: Callable[[], None], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        check()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"# {machine()}")
    print(f"{'image':<56} {'file':>9} {'inflates to':>12} {'check':>9}  verdict")
    for make in (noise_png, photo_like_png, largest_png, bomb_png):
        data, raw = make()
        verdict = "accepted"

        def check() -> None:
            nonlocal verdict
            try:
                check_pixels(data)
            except Undecodable as e:
                verdict = f"refused: {e}"
        took = best(check, args.runs)
        name = (make.__doc__ or make.__name__).split(":")[0]
        print(f"{name:<56} {len(data) / MB:>7.1f}MB {raw / MB:>10.0f}MB {took * 1000:>7.0f}ms  "
              f"{verdict[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
