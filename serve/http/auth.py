"""Who sends a request: the API key, sent as OpenAI's clients send it (Authorization: Bearer)
or as Anthropic's (x-api-key), decided here at the edge as a `Principal`.

Three set-ups: no key (anyone, one person); `--api-key KEY` (one unnamed person);
`--api-keys FILE` (a person a line, serve/http/keyring.py; with --api-key as well,
its holder is the unnamed person beside them). What the server remembers belongs
to the principal's namespace (serve/snapshots/scope.py), which is made of the
name and never of the key.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from email.message import Message
from typing import Optional

from serve.core.errors import ApiError
from serve.core.owner import person_namespace
from serve.http.keyring import KeyRing


@dataclass(frozen=True)
class Principal:
    """A person, by name ("": the unnamed one of --api-key, or anyone when no key is set)."""
    name: str = ""

    @property
    def namespace(self) -> str:
        """The owner of what this person's requests leave behind (ChatRequest.owner)."""
        return person_namespace(self.name)


ANYONE = Principal()


@dataclass(frozen=True)
class Keys:
    """The keys a server takes: none, one unnamed, a file of named ones, or both."""
    key: Optional[str] = None         # --api-key
    ring: Optional[KeyRing] = None    # --api-keys

    @property
    def required(self) -> bool:
        return bool(self.key) or self.ring is not None

    def principal(self, headers: Message) -> Optional[Principal]:
        """The sender, or None when a key is needed and none presented is one."""
        if not self.required:
            return ANYONE
        for given in presented(headers):
            if self.key and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                self.key.encode("utf-8", "surrogateescape")):
                return ANYONE
            name = self.ring.name_of(given) if self.ring is not None else None
            if name is not None:
                return Principal(name)
        return None


def presented(headers: Message) -> list[str]:
    """The keys a request carries: its bearer token (the scheme is case-insensitive, RFC
    7235), then its x-api-key."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    keys = [token.strip()] if scheme.lower() == "bearer" and token.strip() else []
    anthropic_key = headers.get("x-api-key", "").strip()
    return keys + [anthropic_key] if anthropic_key else keys


def unauthorized() -> ApiError:
    """OpenAI's 401 (invalid_request_error, invalid_api_key); Anthropic's route shapes it as
    its authentication_error (serve/dialects/anthropic.py)."""
    return ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key")


def credential_digest(headers: Message) -> str:
    """Who sent a request, as far as the server can tell without naming anyone: a digest of
    the credentials it carries ("" for none), so that what one caller started (a job, by its
    id or by attaching) is another's only if both sent the same credentials."""
    given = headers.get("Authorization", "").strip() + "\n" + headers.get("x-api-key", "").strip()
    return "" if given == "\n" else hashlib.sha256(given.encode()).hexdigest()
