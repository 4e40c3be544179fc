"""`python3 -m serve keygen NAME`: a new random key, and its line for --api-keys FILE.

The line goes to stdout (`python3 -m serve keygen alice >> keys` adds it), the key to
stderr, once, for its person: the line holds only the key's SHA-256, which is all the
server ever keeps (serve/http/keyring.py).
"""
from __future__ import annotations

import secrets
import sys
from typing import Optional

from serve.http.keyring import NAME, line_for

KEY_BYTES = 32
PREFIX = "sk-serve-"   # says what the key is for, in a password manager or a leak scanner


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(KEY_BYTES)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[2:] if argv is None else argv
    if len(args) != 1 or not NAME.fullmatch(args[0]):
        print("usage: python3 -m serve keygen NAME   (NAME: letters, digits, . _ @ -, at most "
              "64)\nprints the line for the --api-keys file, and NAME's new key on stderr",
              file=sys.stderr)
        return 2
    key = new_key()
    print(f"key for {args[0]} (give it to them; it is not kept anywhere): {key}", file=sys.stderr)
    print(line_for(args[0], key))
    return 0
