"""A local snapshot entry's files, and the private directories that hold them.

An entry is a directory of two files: `state` (what Engine.save_state wrote)
and `meta`: MAGIC, a little-endian u32 header length, a JSON header
(identity, key, anchor, n_tokens, state_bytes, state_crc32), then the token
ids. The CRC is checked before a state is handed to the engine.
"""
from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

from serve.snapshots.keys import ID_BYTES, ids_of, raw_ids

MAGIC = b"serve-prefix 1\n"
MAX_HEADER = 4096           # a meta header longer than this is damage, not an entry
_LEN = struct.Struct("<I")


class PrefixCacheError(Exception):
    """The cache directory cannot be used (not a directory, not private, a symlink)."""


@dataclass(slots=True)
class Entry:
    """What RAM holds per entry: no tokens, only hashes and sizes."""
    key: bytes
    anchor: Optional[bytes]   # None: another namespace's entry, counted but never found
    n_tokens: int
    size: int
    dir: str


def encode_meta(identity: str, key: bytes, anchor: bytes, tokens: tuple[int, ...], state: str,
                size: int) -> bytes:
    header = json.dumps({"identity": identity, "key": key.hex(), "anchor": anchor.hex(),
                         "n_tokens": len(tokens), "state_bytes": size,
                         "state_crc32": crc32(state, size)}).encode()
    return MAGIC + _LEN.pack(len(header)) + header + raw_ids(tokens)


def read_meta(path: str, with_tokens: bool) -> tuple[dict, tuple[int, ...]]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a snapshot meta file")
        (length,) = _LEN.unpack(f.read(_LEN.size) or b"\xff\xff\xff\xff")
        if length > MAX_HEADER:
            raise ValueError("meta header too long")
        header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("meta header is not an object")
        if not with_tokens:
            return header, ()
        body = f.read()
    n = header.get("n_tokens")
    if not isinstance(n, int) or len(body) != ID_BYTES * n:
        raise ValueError("meta token count does not match")
    return header, ids_of(body)


def scan_entry(entry_dir: str, own: bool) -> Optional[tuple[int, Entry]]:
    """(recency, entry) from an entry's meta header, or None when it is damaged."""
    try:
        meta = os.path.join(entry_dir, "meta")
        header, _ = read_meta(meta, with_tokens=False)
        key, anchor = bytes.fromhex(header["key"]), bytes.fromhex(header["anchor"])
        n, state_bytes = header["n_tokens"], header["state_bytes"]
        st_meta = os.lstat(meta)
        st_state = os.lstat(os.path.join(entry_dir, "state"))
        if (os.path.basename(entry_dir) != header["key"] or not isinstance(n, int)
                or not stat.S_ISREG(st_state.st_mode) or st_state.st_size != state_bytes):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # Another namespace's entries count toward the bounds but can never be found.
    entry = Entry(key, anchor if own else None, n, st_meta.st_size + state_bytes, entry_dir)
    return st_meta.st_mtime_ns, entry


def scan_root(root: str, namespace: str, damaged: Callable[[str], None]) -> list[Entry]:
    """Every namespace's entries under a cache directory, least recently used first (the
    meta's mtime); `damaged(entry_dir)` is told of each that fails its scan."""
    found: list[tuple[int, Entry]] = []
    for ns in listdir(root):
        ns_dir = os.path.join(root, ns)
        if len(ns) != 32 or not is_private_dir(ns_dir):
            continue
        for name in listdir(ns_dir):
            entry_dir = os.path.join(ns_dir, name)
            entry = scan_entry(entry_dir, own=ns == namespace)
            if entry is None:
                damaged(entry_dir)
            else:
                found.append(entry)
    found.sort(key=lambda pair: pair[0])
    return [entry for _, entry in found]


def crc32(path: str, expected_size: object) -> Optional[int]:
    """zlib CRC-32 of a file, or None when its size is not `expected_size`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size != expected_size:
            return None
        crc = 0
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def private_dir(path: str, created_only: bool = False) -> None:
    """Make `path` a 0700 directory, or check it is one of ours.

    With created_only, an existing directory need only be a real directory
    (the operator may point at a shared one, e.g. /tmp); everything inside is
    private."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        if created_only:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise PrefixCacheError(f"{path} is not a directory (symlinks are not followed)")
            return
    except OSError as e:
        raise PrefixCacheError(f"cannot create {path}: {e.strerror or e}") from None
    if not is_private_dir(path):
        raise PrefixCacheError(f"{path} must be a directory of this user's with mode 0700, "
                               "not a symlink")


def is_private_dir(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
