"""State files of the reference engine: version 2 (engine 0.6.1 on) rewritten as version 1.

Version 1 (engine 0.6.0) stored each layer's keys, then values, position by
position ([positions][kv_dim]); version 2 stores them head by head
([n_kv_heads][positions][head_dim]), as the cache holds them (engine/checkpoint.h).
The ABI tests use this to check that a version-1 file is refused; the prefill
benchmark, to hand the old engine the cache the new one filled.
"""
from __future__ import annotations

import struct
import zlib
from array import array
from pathlib import Path

HEADER = struct.Struct("<4s5I")   # magic, version, fingerprint, n_layers, kv_dim, positions


def v2_to_v1(src: str | Path, dst: str | Path, n_kv_heads: int) -> None:
    data = Path(src).read_bytes()
    magic, version, fingerprint, n_layers, kv_dim, pos = HEADER.unpack_from(data)
    assert (magic, version) == (b"WSTA", 2), src
    head_dim, floats = kv_dim // n_kv_heads, pos * kv_dim
    header = HEADER.pack(magic, 1, fingerprint, n_layers, kv_dim, pos)
    crc, body = zlib.crc32(header), []
    for plane in range(2 * n_layers):   # each layer's keys, then its values
        start = HEADER.size + 4 * floats * plane
        by_head = array("f", data[start:start + 4 * floats])
        by_pos = array("f", bytes(4 * floats))
        for h in range(n_kv_heads):
            for c in range(head_dim):
                column = by_head[h * pos * head_dim + c:(h + 1) * pos * head_dim:head_dim]
                by_pos[h * head_dim + c::kv_dim] = column
        chunk = by_pos.tobytes()
        crc = zlib.crc32(chunk, crc)
        body.append(chunk)
    Path(dst).write_bytes(header + b"".join(body) + struct.pack("<I", crc))
