"""An owner: the namespace of what a person's requests leave behind (ChatRequest.owner).

Made at the edge from the name a key belongs to (serve/http/auth.py), never from
the key; "" is the unnamed person (one --api-key, or no key at all).
"""
from __future__ import annotations

PERSON = "person:"


def person_namespace(name: str) -> str:
    return PERSON + name if name else ""


def person_name(owner: str) -> str:
    """The name an owner was made of ("" for the unnamed person, or an operator's namespace)."""
    return owner[len(PERSON):] if owner.startswith(PERSON) else ""
