"""Whose a snapshot, a remembered reply or a stored response is: the namespace it is kept in.

A request's owner (ChatRequest.owner, decided at the edge from its key:
serve/http/auth.py) and its `cache_salt` make the namespace its snapshots are
stored and found under. Each namespace seeds the token-block hashes of its keys
(serve/snapshots/keys.py), so another owner's lookup computes other keys: it
cannot find, load, time or count an entry, and a listing of the cache directory or
of the shared tier shows no two owners holding the same prefix. With no key and
no salt the namespace is "", as it was before there were owners.

Sharing is opt-in: an operator's --shared-namespace NAME is a namespace every
request also looks in (its own first; the longer snapshot wins), which only
--warm stores into: a team prefills its common preamble once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SHARED_PREFIX = "shared:"   # a person's namespace begins "person:", never this


def namespace(owner: str, salt: Optional[str]) -> str:
    """The namespace of an owner's requests with this salt (a NUL never is in an owner)."""
    return owner if salt is None else f"{owner}\0salt:{salt}"


def shared_namespace(name: str) -> str:
    """--shared-namespace NAME's namespace."""
    return SHARED_PREFIX + name


@dataclass(frozen=True)
class Scope:
    """Where a request's snapshots are stored (own) and looked for (own, then shared)."""
    own: str = ""
    shared: str = ""    # "" : no shared namespace

    @property
    def searched(self) -> tuple[str, ...]:
        return (self.own,) if not self.shared or self.shared == self.own else (self.own, self.shared)


NO_SCOPE = Scope()


def scope_of(owner: str, salt: Optional[str], shared: str = "") -> Scope:
    return Scope(namespace(owner, salt), shared)
