"""What makes an engine state mean something: the namespace of a prefix snapshot.

A saved state is only valid for the exact weights, tokenizer and engine build
that produced it, at the same context size.  Hashing a 100 GB container at
every start is not acceptable, and sizes and mtimes are not identity, so:

- every small file of the container (manifest, tokenizer, specials, chat
  template, vision config: up to SMALL_FILE bytes) is hashed whole;
- every larger file (the weights) contributes its path, its size, its first
  and last SAMPLE bytes and SAMPLES more SAMPLE-byte pieces spread evenly
  through it, so a changed header, shape or tensor is seen for a few MB of
  reads whatever the container's size;
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

SMALL_FILE = 1 << 20
SAMPLE = 64 << 10
SAMPLES = 8


def container_digest(model_dir: str | os.PathLike, skip: Iterable[str | os.PathLike] = ()) -> str:
    """A hash of the files that define a container's weights and tokenizer."""
    root = Path(model_dir).resolve()
    skipped = {Path(p).resolve() for p in skip}
    h = hashlib.sha256()
    for path in sorted(_files(root)):
        if path in skipped or path.name == "usage.waste":
            continue
        size = path.stat().st_size
        h.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= SMALL_FILE:
                h.update(f.read())
                continue
            step = (size - SAMPLE) // (SAMPLES + 1)
            for offset in [0, *(step * k for k in range(1, SAMPLES + 1)), size - SAMPLE]:
                f.seek(offset)
                h.update(f.read(SAMPLE))
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


def state_identity(lib, engine, model_dir: str | os.PathLike,
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
