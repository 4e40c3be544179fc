"""Reasoning handed to a client and trusted when it comes back.

Anthropic thinking blocks carry a `signature` and Responses reasoning items an
`encrypted_content`: opaque values the client returns with the history so the
next prompt can hold the reasoning the model actually produced. Both are an
HMAC-SHA256 under a random key made when the process starts, so a value the
client made up (or one from another process, or from before a restart) does
not verify, and its reasoning is never put in a prompt. A team's hosts
(--shared-cache) share one key, kept in the shared directory: a conversation
that moves to another host keeps its reasoning, as it keeps its snapshots. The blob is
authenticated, not secret: the client has already seen the text it holds.

Each owner (ChatRequest.owner: its key's person, serve/http/auth.py) signs under a
key of its own, derived from that one: a value another person's key was given
does not verify, so one person cannot plant reasoning a colleague's reply holds.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from typing import Optional

_KEY = secrets.token_bytes(32)
_BLOB_PREFIX = "k3r1."   # names the blob's format, so a later one can be told apart


KEY_BYTES = 32


def use_shared_key(path: str) -> None:
    """Sign and verify with the key in `path`, made there by the first host to get there
    (a whole file linked into place: no host ever reads half a key). Raises OSError, or
    ValueError for a file that is not a key."""
    global _KEY
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)          # fails when another host's key got there first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} is not a {KEY_BYTES}-byte key")
    _KEY = key


def _owner_key(owner: str) -> bytes:
    """The key an owner signs under ("": the process's, or the team's, itself)."""
    if not owner:
        return _KEY
    return hmac.new(_KEY, b"owner\0" + owner.encode("utf-8", "surrogatepass"),
                    hashlib.sha256).digest()


def _mac(purpose: str, text: str, owner: str) -> bytes:
    # The purpose keeps a signature from being replayed as a blob, or the other way round.
    return hmac.new(_owner_key(owner), purpose.encode() + b"\0" + text.encode(),
                    hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(text: str, owner: str = "") -> str:
    """The signature of a thinking block's text (which travels beside it), for `owner`."""
    return _b64(_mac("signature", text, owner))


def verify(text: str, signature: object, owner: str = "") -> bool:
    # As bytes: compare_digest refuses a str with anything but ASCII in it.
    return isinstance(signature, str) and hmac.compare_digest(signature.encode(),
                                                              sign(text, owner).encode())


def seal(text: str, owner: str = "") -> str:
    """A blob that carries the text itself, for clients that keep nothing else."""
    return _BLOB_PREFIX + _b64(text.encode()) + "." + _b64(_mac("blob", text, owner))


def unseal(blob: object, owner: str = "") -> Optional[str]:
    """The text sealed in `blob` for `owner`, or None when the blob is not one this process
    (or its team) made for that owner."""
    if not isinstance(blob, str) or not blob.startswith(_BLOB_PREFIX):
        return None
    body, _, mac = blob[len(_BLOB_PREFIX):].partition(".")
    try:
        text = _unb64(body).decode()
        given = _unb64(mac)
    except (binascii.Error, ValueError):
        return None
    return text if hmac.compare_digest(given, _mac("blob", text, owner)) else None
