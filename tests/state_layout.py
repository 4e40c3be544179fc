"""State files of the reference engine: today's version 3 rewritten as an older version.

Version 1 (engine 0.6.0) stored each layer's keys, then values, position by
position ([positions][kv_dim]), in f32; version 2 (engine 0.6.1) stored them head
by head ([n_kv_heads][positions][head_dim]), as the cache holds them, still in
f32; version 3 (0.6.2 on) the same in f16 (engine/checkpoint.h). Every f16 is
exactly a float, so the older files hold the very cache the newer one does. The
ABI tests use this to check that an older file is refused; the prefill benchmark,
to hand an old engine the cache the new one filled.
"""
from __future__ import annotations

import struct
import zlib
from array import array
from pathlib import Path

HEADER = struct.Struct("<4s5I")   # magic, version, fingerprint, n_layers, kv_dim, positions


def rewrite(src: str | Path, dst: str | Path, version: int, n_kv_heads: int) -> None:
    """The version-3 state file `src` as a file of `version` (1, 2 or 3) at `dst`."""
    data = Path(src).read_bytes()
    magic, found, fingerprint, n_layers, kv_dim, pos = HEADER.unpack_from(data)
    assert (magic, found) == (b"WSTA", 3), src
    assert version in (1, 2, 3), version
    if version == 3:
        Path(dst).write_bytes(data)
        return
    head_dim, halves = kv_dim // n_kv_heads, pos * kv_dim
    header = HEADER.pack(magic, version, fingerprint, n_layers, kv_dim, pos)
    crc, body = zlib.crc32(header), []
    for plane in range(2 * n_layers):   # each layer's keys, then its values
        start = HEADER.size + 2 * halves * plane
        by_head = array("f", struct.unpack_from(f"<{halves}e", data, start))
        if version == 2:
            chunk = by_head.tobytes()
        else:
            by_pos = array("f", bytes(4 * halves))
            for h in range(n_kv_heads):
                for c in range(head_dim):
                    column = by_head[h * pos * head_dim + c:(h + 1) * pos * head_dim:head_dim]
                    by_pos[h * head_dim + c::kv_dim] = column
            chunk = by_pos.tobytes()
        crc = zlib.crc32(chunk, crc)
        body.append(chunk)
    Path(dst).write_bytes(header + b"".join(body) + struct.pack("<I", crc))
