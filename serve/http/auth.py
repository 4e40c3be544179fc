"""The API key: sent as OpenAI's clients send it (Authorization: Bearer) or as Anthropic's (x-api-key)."""
from __future__ import annotations

import hashlib
import hmac
from email.message import Message
from typing import Optional

from serve.core.errors import ApiError


def authorized(headers: Message, key: Optional[str]) -> bool:
    """Does the request carry `key` (None or "": no key is needed)?"""
    if not key:
        return True
    scheme, _, given = headers.get("Authorization", "").strip().partition(" ")
    # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
    bearer = hmac.compare_digest(given.strip().encode(), key.encode()) and scheme.lower() == "bearer"
    anthropic_key = headers.get("x-api-key", "").strip().encode()
    return bearer or hmac.compare_digest(anthropic_key, key.encode())


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key")


def credential_digest(headers: Message) -> str:
    """Who sent a request, as far as the server can tell without naming anyone: a digest of
    the credentials it carries ("" for none), so that what one caller started (a job, by its
    id or by attaching) is another's only if both sent the same credentials."""
    given = headers.get("Authorization", "").strip() + "\n" + headers.get("x-api-key", "").strip()
    return "" if given == "\n" else hashlib.sha256(given.encode()).hexdigest()
