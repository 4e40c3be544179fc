"""`--api-keys FILE`: one person a line, `NAME sha256:HEX`, HEX the SHA-256 of that person's key.

Blank lines and lines that begin with `#` are ignored. The key itself is never
stored, here or anywhere serve writes: a presented key is hashed, and its hash
compared with every line's in constant time (hmac.compare_digest, each line
compared, none skipped once one matched), so neither the answer's time nor
its content says which line, if any, came near. The file is read again on
SIGHUP (serve/app/main.py); a file that no longer parses keeps the keys read
before it, and says why.

`python3 -m serve keygen NAME` prints a new random key and the line for it
(serve/app/keygen.py).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import threading
from typing import Optional

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")   # in /metrics labels and log lines as is
HASH = re.compile(r"sha256:([0-9a-fA-F]{64})")


class KeyFileError(ValueError):
    """A keys file that cannot be read, or a line of it that is not `NAME sha256:HEX`."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def line_for(name: str, key: str) -> str:
    """The keys file's line for a person holding `key`."""
    return f"{name} sha256:{digest(key).hex()}"


def parse(text: str, path: str) -> tuple[tuple[str, bytes], ...]:
    """(name, sha256 of the key) of each line; a name may appear once, and so may a hash."""
    entries: list[tuple[str, bytes]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        hashed = HASH.fullmatch(fields[1]) if len(fields) == 2 else None
        if hashed is None or not NAME.fullmatch(fields[0]):
            # The line is not echoed: a key pasted where its hash belongs would reach the log.
            raise KeyFileError(f"{path} line {number}: not 'NAME sha256:HEX' (NAME: letters, "
                               "digits, . _ @ -, at most 64)")
        entries.append((fields[0], bytes.fromhex(hashed.group(1))))
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise KeyFileError(f"{path}: a name appears on two lines")
    if len({h for _, h in entries}) != len(entries):
        raise KeyFileError(f"{path}: two lines hold the same key")
    return tuple(entries)


def read(path: str) -> tuple[tuple[str, bytes], ...]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    return parse(text, path)


class KeyRing:
    """The people of a keys file, read again on reload(). Thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._entries = read(path)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def reload(self) -> int:
        """Read the file again; the number of people it holds now. Raises KeyFileError (and
        keeps the keys it had) when it cannot be read."""
        entries = read(self.path)
        with self._lock:
            self._entries = entries
        return len(entries)

    def name_of(self, key: str) -> Optional[str]:
        """The name of the person whose key this is, or None."""
        presented = digest(key)
        with self._lock:
            entries = self._entries
        found: Optional[str] = None
        for name, hashed in entries:   # every line, whichever matches
            if hmac.compare_digest(presented, hashed):
                found = name
        return found
