"""What makes an engine state mean something: the namespace of a prefix snapshot.

A saved state is only valid for the exact weights, tokenizer and engine build
that produced it, at the same context size.  Hashing a 100 GB container at
every start is not acceptable, and sizes and mtimes are not identity, so:

- every small file of the container (manifest, tokenizer, specials, chat
  template, vision config: up to SMALL_FILE bytes) is hashed whole;
- every larger file (the weights) contributes its path, its size and up to
  PIECES pieces spread evenly from its first byte to its last (header and
  tail included), of up to PIECE bytes each, so a changed header, shape or
  tensor is seen.  The pieces shrink (to MIN_PIECE, and to two per file)
  as the weight files multiply, so the reads stay near READ_BUDGET whatever
  the container's size (64 MiB, or 8 KiB a file past 8,192 files);
- the learned expert hotlist (rewritten at every shutdown) and hidden files
  are left out: they change no state;
- the engine library file is hashed whole (a rebuilt library may lay out its
  state differently), with its version string, version number and build info;
- the context size the engine was opened with.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from serve.engine.binding import Library
from serve.engine.api import EngineApi

SMALL_FILE = 1 << 20
PIECE = 64 << 10
MIN_PIECE = 4 << 10
PIECES = 10
READ_BUDGET = 64 << 20


def container_digest(model_dir: str | os.PathLike, skip: Iterable[str | os.PathLike] = ()) -> str:
    """A hash of the files that define a container's weights and tokenizer."""
    root = Path(model_dir).resolve()
    skipped = {Path(p).resolve() for p in skip}
    files = [(path, path.stat().st_size) for path in sorted(_files(root))
             if path not in skipped and path.name != "usage.waste"]
    large = sum(1 for _, size in files if size > SMALL_FILE) or 1
    pieces = max(2, min(PIECES, READ_BUDGET // (large * MIN_PIECE)))
    piece = max(MIN_PIECE, min(PIECE, READ_BUDGET // (large * pieces)))
    h = hashlib.sha256()
    for path, size in files:
        h.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= SMALL_FILE:
                h.update(f.read())
                continue
            for k in range(pieces):
                f.seek((size - piece) * k // (pieces - 1))
                h.update(f.read(piece))
    return h.hexdigest()


def _files(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                yield path


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def state_identity(lib: Library, engine: EngineApi, model_dir: str | os.PathLike,
                   skip: Iterable[str | os.PathLike] = ()) -> str:
    """The identity string a prefix snapshot is namespaced by (stored in each entry)."""
    return json.dumps({
        "container": container_digest(model_dir, skip),
        "library": file_digest(lib.path),
        "version": lib.version(),
        "version_number": lib.version_number(),
        "build_info": lib.build_info(),
        "ctx": engine.info.ctx_max,
    }, sort_keys=True)
