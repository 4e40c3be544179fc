"""The flags for a team's people: their keys, what they share, their turns; and SIGHUP.

`--api-keys FILE` names a person per key (serve/http/keyring.py), read again on
SIGHUP; `--shared-namespace NAME` is what every key finds too, and what --warm
stores into (serve/snapshots/scope.py); `--max-waiting-per-person N` bounds one
person's waiting requests (429); `--metrics-open` answers /metrics without a key.
"""
from __future__ import annotations

import argparse
import signal
from typing import Callable, Optional

from serve.core.request import ChatRequest
from serve.http.auth import Keys
from serve.http.keyring import NAME, KeyRing
from serve.snapshots.scope import shared_namespace


def _name(text: str) -> str:
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a name: {text!r} (letters, digits, . _ @ -)")
    return text


def add_flags(p: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    p.add_argument("--api-keys", metavar="FILE",
                   help="a key per person: lines 'NAME sha256:HEX' (`python3 -m serve keygen "
                        "NAME` makes one); read again on SIGHUP. What a person's requests "
                        "leave behind (snapshots, replies, stored responses) is theirs alone")
    p.add_argument("--shared-namespace", type=_name, metavar="NAME",
                   help="snapshots every key finds: --warm prefills its requests into it, so "
                        "a team prefills its common preamble once (default: none is shared)")
    p.add_argument("--max-waiting-per-person", type=positive, default=None, metavar="N",
                   help="requests one person may have waiting for the engine; more get a 429 "
                        "(default: only --max-queue bounds them)")
    p.add_argument("--metrics-open", action="store_true",
                   help="answer /metrics without a key (for a scraper that holds none)")


def keys(args: argparse.Namespace) -> Keys:
    """The keys the server takes; raises KeyFileError for a keys file it cannot read."""
    return Keys(args.api_key or None, KeyRing(args.api_keys) if args.api_keys else None)


def options(args: argparse.Namespace) -> dict:
    """ServiceOptions' fields these flags set."""
    return {"shared_namespace": shared_namespace(args.shared_namespace)
            if args.shared_namespace else "",
            "max_waiting_per_person": args.max_waiting_per_person}


def warm_owner(args: argparse.Namespace, requests: list[tuple[str, ChatRequest]]) -> Optional[str]:
    """Give --warm's requests the shared namespace; the reason they cannot be warmed for
    anyone, or None. With named keys and no shared namespace, what --warm stored would be
    found by no one: refused rather than done for nothing."""
    if args.shared_namespace:
        for _, req in requests:
            req.owner = shared_namespace(args.shared_namespace)
    elif requests and args.api_keys:
        return ("--warm with --api-keys needs --shared-namespace NAME: every person's "
                "snapshots are their own, and only a shared namespace's are everyone's")
    return None


def banner_lines(args: argparse.Namespace, server_keys: Keys) -> list[str]:
    if server_keys.ring is None:
        return []
    people = f"{len(server_keys.ring)} people from {args.api_keys} (SIGHUP reads it again)"
    unnamed = ", and one unnamed (--api-key)" if args.api_key else ""
    shared = (f"; namespace {args.shared_namespace!r} shared by all" if args.shared_namespace
              else "; nothing shared between them")
    return [f"keys     {people}{unnamed}{shared}"]


def reread_on_hangup(server_keys: Keys, log: Callable[[str], None]) -> None:
    """SIGHUP reads the keys file again: new requests are checked against it, running ones
    go on. A file that does not parse keeps the keys read before, and says why."""
    ring = server_keys.ring
    if ring is None:
        return

    def reread(signum, frame) -> None:
        try:
            log(f"keys     {ring.reload()} people read again from {ring.path}")
        except ValueError as e:
            log(f"keys     {e}; the keys read before are kept")
    signal.signal(signal.SIGHUP, reread)
