"""How a token sequence becomes a snapshot's key: blocks of token ids hashed in a chain.

Lookups cost O(prompt length) whatever the number of entries: tokens are
hashed in blocks of BLOCK, each block's hash chained to the one before; an
entry is found by the chain hash of its whole blocks (its anchor) and then a
hash of its few tokens past the last whole block. Both tiers (the local
directory and the shared one) key entries this way.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Container, Iterator, Sequence

BLOCK = 64                  # tokens per hashed block
ID_BYTES = 4                # one token id, little-endian int32


def digest(prev: bytes, data: bytes) -> bytes:
    """The one hash the index uses (tests count its calls)."""
    return hashlib.blake2b(prev + data, digest_size=16).digest()


def seed(identity: str) -> bytes:
    """chain[0]: what keeps one model's and engine's keys apart from another's."""
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


def raw_ids(tokens: Sequence[int]) -> bytes:
    ids = array("i", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def ids_of(raw: bytes) -> tuple[int, ...]:
    ids = array("i")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)


def anchors(chain_seed: bytes, raw: bytes, blocks: int) -> list[bytes]:
    """chain[q]: the hash of the first q whole blocks (chain[0] is the namespace seed)."""
    chain, step = [chain_seed], BLOCK * ID_BYTES
    for q in range(blocks):
        chain.append(digest(chain[-1], raw[q * step:(q + 1) * step]))
    return chain


def entry_key(anchor: bytes, tail: bytes) -> bytes:
    return digest(anchor, b"T" + tail)  # the marker keeps keys apart from anchors


def key_of(chain_seed: bytes, tokens: Sequence[int]) -> tuple[bytes, bytes]:
    """(anchor, key) of the entry holding exactly `tokens`."""
    raw = raw_ids(tokens)
    whole = len(tokens) // BLOCK
    anchor = anchors(chain_seed, raw, whole)[-1]
    return anchor, entry_key(anchor, raw[whole * BLOCK * ID_BYTES:])


def candidates(chain_seed: bytes, raw: bytes, longest: int,
               known_anchors: Container[bytes]) -> Iterator[tuple[int, bytes]]:
    """(length, key) of every entry that could hold a prefix of raw, longest first, probing
    position by position only the blocks whose anchor is in `known_anchors`: O(longest)
    hashes. A caller that finds one early stops hashing."""
    return probe(anchors(chain_seed, raw, longest // BLOCK), raw, longest, known_anchors)


def probe(chain: Sequence[bytes], raw: bytes, longest: int, known_anchors: Container[bytes],
          beyond: int = -1) -> Iterator[tuple[int, bytes]]:
    """candidates() over a chain hashed already (anchors(), kept by a lookup made earlier),
    only those longer than `beyond`: probing again costs a few tail hashes, no block's."""
    for q in range(len(chain) - 1, -1, -1):
        start = q * BLOCK
        if start + BLOCK - 1 <= beyond:
            return
        if chain[q] not in known_anchors:
            continue
        for end in range(min(start + BLOCK - 1, longest), max(start, beyond + 1) - 1, -1):
            yield end, entry_key(chain[q], raw[start * ID_BYTES:end * ID_BYTES])


def scoped(chain_seed: bytes, namespace: str) -> bytes:
    """chain[0] of a namespace's keys (serve/snapshots/scope.py): "" keeps the model's seed."""
    return digest(chain_seed, b"S" + namespace.encode("utf-8", "surrogatepass")) if namespace \
        else chain_seed
