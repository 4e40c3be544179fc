"""Writing a reference container's files (engine/FORMAT.md): expert banks,
JSON files, and the atomic move of a finished container into place."""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

PAGE = 4096
RECORD_HEADER = 64
# The bank header's quant_kind: how quant_group's codes are stored.
QUANT_KIND = {"f32": 0, "q8g32": 0, "q4_1": 1}


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def write_bank(path: Path, layer: int, payloads: list[bytes], quant_group: int,
               quant_kind: int = 0) -> None:
    """One MoE layer's bank: a header page, then one page-aligned record per expert."""
    payload_bytes = len(payloads[0])
    stride = round_up(RECORD_HEADER + payload_bytes, PAGE)
    with open(path, "wb") as f:
        header = struct.pack("<4s7I", b"WBNK", 1, layer, len(payloads), stride, payload_bytes,
                             quant_group, quant_kind)
        f.write(header.ljust(PAGE, b"\0"))
        for expert, payload in enumerate(payloads):
            record = struct.pack("<4s4I", b"WEXP", layer, expert, payload_bytes,
                                 zlib.crc32(payload)).ljust(RECORD_HEADER, b"\0")
            f.write((record + payload).ljust(stride, b"\0"))


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def publish(tmp: Path, out: Path) -> None:
    """Move the finished temp dir to out, replacing an old one only at the end."""
    if not out.exists():
        os.rename(tmp, out)
        return
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, aside / "old")
    os.rename(tmp, out)
    shutil.rmtree(aside)
